"""Top log-probs per output token (vLLM's `logprobs: N`): against transformers' distribution, and through tritonserver."""

from __future__ import annotations

import pytest
import torch

from grpc_stream import StreamClient, make_inputs
from prompts import PLAIN_PROMPTS
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.unit

MAX_NEW = 12


def _hf_logprobs(hf_model, ids: list[int], out: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each output position: [len(out), vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_greedy_top_logprobs_equal_transformers_distribution(engine, hf_model, tokenizer):
    prompts = [tokenizer.encode(p) for p in PLAIN_PROMPTS[:2]]
    outs = engine.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=MAX_NEW, top_logprobs=5))
    for ids, out in zip(prompts, outs):
        ref = _hf_logprobs(hf_model, ids, out.token_ids)
        assert len(out.top_logprobs) == len(out.token_ids) == MAX_NEW
        for pos, (token, entries) in enumerate(zip(out.token_ids, out.top_logprobs)):
            values, top_ids = ref[pos].topk(5)
            # greedy: the chosen token is the most likely, so it comes first either way
            assert [t for t, _, _ in entries] == top_ids.tolist()
            assert [lp for _, lp, _ in entries] == pytest.approx(values.tolist(), abs=1e-4)
            assert [r for _, _, r in entries] == [1, 2, 3, 4, 5]
            assert entries[0][0] == token and entries[0][1] == pytest.approx(out.logprobs[pos], abs=1e-6)


def test_a_sampled_token_outside_the_top_n_comes_with_its_rank(engine, tokenizer):
    ids = tokenizer.encode(PLAIN_PROMPTS[0])
    [out] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(
        max_tokens=24, temperature=1.5, seed=11, top_logprobs=1))
    outside = 0
    for token, lp, entries in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert entries[0][0] == token and entries[0][1] == pytest.approx(lp, abs=1e-6)  # the chosen token first
        if entries[0][2] == 1:
            assert len(entries) == 1
        else:  # then the most likely one, which was not chosen
            outside += 1
            assert len(entries) == 2 and entries[1][2] == 1 and entries[1][1] >= lp - 1e-6
            assert entries[0][2] >= 2
    assert outside  # at temperature 1.5 some tokens are not the most likely one


def test_zero_top_logprobs_give_the_chosen_token_only(engine, tokenizer):
    [out] = engine.generate(prompt_token_ids=[tokenizer.encode(PLAIN_PROMPTS[1])],
                            params=SamplingParams(max_tokens=4, top_logprobs=0))
    assert [[(t, r) for t, _, r in entries] for entries in out.top_logprobs] == [[(t, 1)] for t in out.token_ids]


def _streamed(engine, prompt: str, **sampling) -> tuple[list[str], str]:
    """The chosen tokens' texts (decoded_token) and the output's text, as the engine streams them."""
    outs = list(engine.stream(prompt, SamplingParams(top_logprobs=0, **sampling)))
    return [t for out in outs for t in out.new_token_texts], "".join(out.new_text for out in outs)


def test_the_token_a_stop_ends_the_output_with_reads_whole(engine):
    """A stop string or stop token cuts text out of the output, yet the token that ended it reads whole
    (vLLM's decoded_token); the tokens before it spell the text before it."""
    prompt = "The capital of France is"
    whole, text = _streamed(engine, prompt, max_tokens=8, ignore_eos=True)
    assert "".join(whole) == text
    [ref] = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    k = next(i for i, t in enumerate(whole) if len(t.strip()) >= 4)  # a word that a stop string can cut inside
    before = "".join(whole[:k])
    assert text.find(whole[k][2:]) == len(before) + 2  # the stop string below first appears there
    cases = [  # (sampling, the output's text)
        (dict(stop=[whole[k][2:]]), before + whole[k][:2]),
        (dict(stop=[whole[k][1:-1]], include_stop_str_in_output=True), before + whole[k][:-1]),
        (dict(stop_token_ids=[ref.token_ids[k]]), before),
        (dict(stop_token_ids=[ref.token_ids[k]], include_stop_str_in_output=True), before + whole[k]),
    ]
    assert ref.token_ids[k] not in ref.token_ids[:k]
    for sampling, expected in cases:
        tokens, cut = _streamed(engine, prompt, max_tokens=8, ignore_eos=True, **sampling)
        assert cut == expected and tokens == whole[:k + 1], sampling


def test_top_logprobs_see_the_penalties_as_the_choice_does(engine, tokenizer):
    ids = tokenizer.encode(PLAIN_PROMPTS[0])
    [out] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(
        max_tokens=MAX_NEW, top_logprobs=3, repetition_penalty=1.5, logit_bias={ids[-1]: -5.0}))
    assert all(entries[0][0] == token for token, entries in zip(out.token_ids, out.top_logprobs))


@pytest.mark.parametrize("value", [21, -1, 2.5, "many"])
def test_a_bad_logprobs_count_is_refused(value):
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams.from_dict({"logprobs": value})


def test_the_vllm_logprobs_count_maps_to_top_logprobs():
    assert SamplingParams.from_dict({"logprobs": 4}).top_logprobs == 4
    assert SamplingParams.from_dict({"logprobs": True}).top_logprobs == 1  # vLLM's SamplingParams: true is 1


@pytest.mark.server
def test_top_logprobs_through_triton_as_the_vllm_backend(triton_server, engine):
    prompt = PLAIN_PROMPTS[0]
    client = StreamClient(triton_server.grpc_url)
    client.send("top", make_inputs(prompt, stream=True, sampling={"max_tokens": MAX_NEW, "logprobs": 3}))
    client.send("plain", make_inputs(prompt, stream=True, sampling={"max_tokens": MAX_NEW}))
    got = client.wait(timeout=120)
    client.close()
    [ref] = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW, top_logprobs=3))
    top = got["top"]
    assert top.error is None and top.ids == ref.token_ids
    assert [len(r) for r in top.top_logprobs] == top.response_id_counts  # one entry per token of each response
    flat = [entry for response in top.top_logprobs for entry in response]
    for entries, expected in zip(flat, ref.top_logprobs):
        assert [(int(t), e["rank"]) for t, e in entries.items()] == [(t, r) for t, _, r in expected]
        assert [e["logprob"] for e in entries.values()] == pytest.approx([lp for _, lp, _ in expected], abs=1e-5)
    assert all(isinstance(e["decoded_token"], str) for entries in flat for e in entries.values())
    # return_logprobs without the `logprobs` count: the vLLM backend's JSON null in every response.
    assert got["plain"].top_logprobs == [None] * got["plain"].num_responses and got["plain"].ids == ref.token_ids


def test_a_request_asks_for_top_logprobs_with_return_logprobs_only():
    import json

    import numpy as np

    from tritonllm.serving.request_parsing import parse_request

    def parse(flag: bool, count):
        inputs = {"text_input": np.array([b"Hi"], dtype=np.object_), "return_logprobs": np.array([flag]),
                  "sampling_parameters": np.array([json.dumps({"logprobs": count}).encode()], dtype=np.object_)}
        return parse_request(inputs, None).params

    assert parse(True, 3).top_logprobs == 3 and parse(True, "3").top_logprobs == 3  # numbers as strings too
    assert parse(False, 3).top_logprobs is None  # not returned, so not computed
