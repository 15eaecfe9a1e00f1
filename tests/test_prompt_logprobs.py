"""Prompt log-probs (vLLM's `prompt_logprobs: N`): against transformers' distribution over the prompt,
across prompt chunks and beside other requests in one step, and through tritonserver."""

from __future__ import annotations

import json

import pytest
import torch

from grpc_stream import StreamClient, make_inputs
from prompts import PLAIN_PROMPTS
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.unit

LONG = " ".join(PLAIN_PROMPTS[:6])  # longer than the engine's 512-token step budget: several chunks


def _hf_prompt_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each prompt position but the last: [len(ids) - 1, vocab]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def _check_against(ref: torch.Tensor, ids: list[int], scored: list, n: int) -> None:
    assert len(scored) == len(ids) and scored[0] is None
    for pos, entries in enumerate(scored[1:]):
        values, top_ids = ref[pos].topk(n)
        target = ids[pos + 1]
        token, lp, rank = entries[0]  # the prompt's own token first, then the rest of the top n
        by_rank = sorted(entries, key=lambda e: e[2])
        assert token == target and [t for t, _, _ in by_rank[:n]] == top_ids.tolist()
        assert [v for _, v, _ in by_rank[:n]] == pytest.approx(values.tolist(), abs=1e-4)
        assert lp == pytest.approx(float(ref[pos, target]), abs=1e-4)
        # 1 + the tokens more likely than it, up to tokens within float32 rounding of it (ranks run to thousands)
        assert int((ref[pos] > ref[pos, target] + 1e-4).sum()) + 1 <= rank <= int((ref[pos] > ref[pos, target] - 1e-4).sum()) + 1
        assert len(entries) == n + (target not in top_ids.tolist())


def test_prompt_logprobs_equal_transformers_across_chunks_and_beside_other_requests(engine, hf_model, tokenizer):
    long_ids, short_ids = tokenizer.encode(LONG), tokenizer.encode(PLAIN_PROMPTS[1])
    assert len(long_ids) > 512
    outs = engine.generate(prompt_token_ids=[short_ids, long_ids, tokenizer.encode(PLAIN_PROMPTS[2])],
                           params=[SamplingParams(max_tokens=4, prompt_logprobs=2),
                                   SamplingParams(max_tokens=4, prompt_logprobs=3), SamplingParams(max_tokens=4)])
    _check_against(_hf_prompt_logprobs(hf_model, short_ids), short_ids, outs[0].prompt_logprobs, 2)
    _check_against(_hf_prompt_logprobs(hf_model, long_ids), long_ids, outs[1].prompt_logprobs, 3)
    assert outs[2].prompt_logprobs is None


def test_a_cached_prompt_is_computed_again_to_be_scored(engine, tokenizer):
    ids = tokenizer.encode(PLAIN_PROMPTS[3] * 3)
    [plain] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=2))
    [again] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=2))
    [scored] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=2, prompt_logprobs=0))
    [scored_again] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert again.num_cached_prompt_tokens > 0 and scored.num_cached_prompt_tokens == 0
    assert [len(e) for e in scored.prompt_logprobs[1:]] == [1] * (len(ids) - 1)  # N = 0: the prompt's own token
    assert scored_again.prompt_logprobs == scored.prompt_logprobs and scored.token_ids == plain.token_ids


def test_only_the_first_of_n_completions_carries_them(engine, tokenizer):
    ids = tokenizer.encode(PLAIN_PROMPTS[0])
    outs = engine.generate(prompt_token_ids=[ids], params=SamplingParams(
        n=3, max_tokens=3, temperature=1.0, seed=5, prompt_logprobs=1))
    assert len(outs[0].prompt_logprobs) == len(ids) and [o.prompt_logprobs for o in outs[1:]] == [None, None]


@pytest.mark.parametrize("value", [21, -1, 1.5, "all"])
def test_a_bad_prompt_logprobs_count_is_refused(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be an integer in"):
        SamplingParams.from_dict({"prompt_logprobs": value})


def test_prompt_logprobs_true_is_one_as_vllm_reads_it():
    assert SamplingParams.from_dict({"prompt_logprobs": True}).prompt_logprobs == 1


@pytest.mark.server
def test_prompt_logprobs_through_tritonserver_in_the_first_response_only(triton_server, engine, tokenizer):
    prompt = PLAIN_PROMPTS[4]
    client = StreamClient(triton_server.grpc_url)
    client.send("bad", make_inputs(prompt, stream=True, sampling={"max_tokens": 6, "prompt_logprobs": 99}))
    got = client.wait(timeout=120)  # alone: the test client attributes an error to the one request pending
    client.send("scored", make_inputs(prompt, stream=True, sampling={"max_tokens": 6, "prompt_logprobs": "2"}))
    client.send("plain", make_inputs(prompt, stream=True, sampling={"max_tokens": 6}))
    got.update(client.wait(["scored", "plain"], timeout=120))
    client.close()
    [ref] = engine.generate([prompt], SamplingParams(max_tokens=6, prompt_logprobs=2))
    scored = got["scored"]
    assert scored.error is None and scored.ids == ref.token_ids
    carrying = [r["prompt_logprobs"] for r in scored.arrays if "prompt_logprobs" in r]
    assert len(carrying) == 1 and "prompt_logprobs" in scored.arrays[0]
    sent = json.loads(carrying[0].reshape(-1)[0])
    assert sent[0] is None and len(sent) == len(ref.prompt_logprobs)
    for entries, expected in zip(sent[1:], ref.prompt_logprobs[1:]):
        assert [(int(t), e["rank"]) for t, e in entries.items()] == [(t, r) for t, _, r in expected]
        assert [e["logprob"] for e in entries.values()] == pytest.approx([lp for _, lp, _ in expected], abs=1e-5)
        assert all(e["decoded_token"] == tokenizer.decode([int(t)]) for t, e in entries.items())
    assert not any("prompt_logprobs" in r for r in got["plain"].arrays)
    assert got["bad"].error is not None and "prompt_logprobs must be an integer" in got["bad"].error
