"""Chat log-probs' `bytes`: each token's own bytes, which put together are the text's UTF-8 (token_bytes.py)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tritonllm.openai.choices import Choices
from tritonllm.openai.token_bytes import token_bytes_of
from tritonllm.openai.triton import TritonOutput

pytestmark = pytest.mark.unit

TEXT = "Party 🎉, café, 東京!"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def test_each_tokens_bytes_put_together_are_the_texts_utf8(tokenizer):
    token_bytes = token_bytes_of(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)  # some token holds part of a character
    assert b"".join(token_bytes(i) for i in ids) == TEXT.encode("utf-8")
    assert token_bytes(tokenizer.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


def test_chat_logprobs_give_each_token_its_own_bytes_and_alternatives_theirs(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # As the model answers: the chosen token first, its text the text it added (nothing for part of a character).
    per_token, added = [], ""
    for i, token_id in enumerate(ids):
        text = tokenizer.decode(ids[:i + 1])
        piece = "" if text.endswith("\ufffd") else text[len(added):]
        added += piece
        other = ids[(i + 1) % len(ids)]
        per_token.append({str(token_id): {"logprob": -0.1, "rank": 1, "decoded_token": piece},
                          str(other): {"logprob": -3.0, "rank": 2, "decoded_token": tokenizer.decode([other])}})
    choices = Choices(chat=True, n=1, num_prompts=1, top_logprobs=2, token_bytes=token_bytes_of(tokenizer))
    choices.add(0, TritonOutput(texts=[TEXT], token_counts=[len(ids)], logprobs=[[-0.1] * len(ids)],
                                top_logprobs=[per_token], finish_reasons=["length"], final=True))
    items = choices.choices[0].chat_logprobs
    assert "".join(item["token"] for item in items) == TEXT
    assert bytes(b for item in items for b in item["bytes"]) == TEXT.encode("utf-8")
    for item, token_id in zip(items, ids[1:] + ids[:1]):
        assert item["top_logprobs"][1]["bytes"] == list(token_bytes_of(tokenizer)(token_id))
