"""Incremental detokenization (engine/detokenizer.py): each token's text, the same through the tokenizers
library's own decode as through transformers' wrapper around it."""

from __future__ import annotations

import random

import pytest

from tritonllm.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_library_decode_gives_transformers_text_token_by_token(tokenizer, skip_special_tokens):
    """Random ids (special tokens, pieces of multi-byte characters and word starts among them), and a text
    with accents and emoji, decoded one token at a time both ways."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    streams = [[rng.randrange(vocab) for _ in range(48)] for _ in range(40)]
    streams.append(tokenizer.encode("Crème brûlée, 東京 and 🙂🙂 — <|im_end|> done.", add_special_tokens=False))
    for ids in streams:
        fast = IncrementalDetokenizer(tokenizer, ids[:5], skip_special_tokens)
        plain = IncrementalDetokenizer(tokenizer, ids[:5], skip_special_tokens)
        assert fast._rust_decode is not None, "the default model's tokenizer keeps the library's decode"
        plain._rust_decode = None
        assert [fast.add(t) for t in ids[5:]] == [plain.add(t) for t in ids[5:]]


def test_a_tokenizer_that_changes_decoding_keeps_its_own():
    class Custom:
        _tokenizer = None

        def decode(self, ids, **kwargs):
            return "".join(chr(97 + i % 26) for i in ids)

    detok = IncrementalDetokenizer(Custom(), [1, 2])
    assert detok._rust_decode is None and detok.add(3) == "d"
