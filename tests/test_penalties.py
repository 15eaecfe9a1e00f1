"""Repetition, presence and frequency penalties: transformers' and vLLM's formulas, per row of a batch."""

from __future__ import annotations

import pytest
import torch

from grpc_stream import StreamClient, make_inputs
from prompts import CHAT_PROMPTS, PLAIN_PROMPTS
from tritonllm.sampling_params import InvalidRequestError, SamplingParams

MAX_NEW = 24


def _ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PLAIN_PROMPTS[:3]]


def test_repetition_penalty_matches_transformers_beside_unpenalized_rows(engine, hf_model, tokenizer):
    """Penalized and plain requests batched together: each equals transformers' generate with its own setting."""
    prompts = _ids(tokenizer)
    cases = [(ids, rp) for ids in prompts for rp in (1.3, 1.0)]
    cases.append((prompts[0], 0.8))  # below 1 rewards repeats: the formula holds either way
    params = [SamplingParams(max_tokens=MAX_NEW, repetition_penalty=rp) for _, rp in cases]
    outs = engine.generate(prompt_token_ids=[ids for ids, _ in cases], params=params)
    for (ids, rp), out in zip(cases, outs):
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=rp,
                                eos_token_id=sorted(engine.eos_token_ids), pad_token_id=tokenizer.eos_token_id)
        assert out.token_ids == ref[0, len(ids):].tolist(), (rp, tokenizer.decode(ids))
    plain = [out.token_ids for (_, rp), out in zip(cases, outs) if rp == 1.0]
    penalized = [out.token_ids for (_, rp), out in zip(cases, outs) if rp == 1.3]
    assert plain != penalized  # the penalty changed something on these prompts


def _reference_with_output_penalties(hf_model, ids: list[int], presence: float, frequency: float) -> list[int]:
    """Greedy decoding on transformers' logits with OpenAI's presence / frequency penalties applied by hand."""
    out: list[int] = []
    past, step_input = None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(MAX_NEW):
            result = hf_model(step_input, past_key_values=past, use_cache=True)
            past, logits = result.past_key_values, result.logits[0, -1].float().clone()
            for token in set(out):
                logits[token] -= frequency * out.count(token) + presence
            out.append(int(logits.argmax()))
            step_input = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.0), (0.5, 0.5), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_match_a_reference_on_transformers_logits(engine, hf_model, tokenizer,
                                                                                   presence, frequency):
    prompts = _ids(tokenizer)[:2]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency)
    outs = engine.generate(prompt_token_ids=prompts, params=params)
    for ids, out in zip(prompts, outs):
        assert out.token_ids == _reference_with_output_penalties(hf_model, ids, presence, frequency)


def test_penalties_combine_with_sampling_and_log_probs(engine, tokenizer):
    """A sampled, seeded, penalized row repeats itself run to run, and its log-probs are probabilities."""
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, repetition_penalty=1.2, frequency_penalty=0.3)
    [a] = engine.generate(prompt_token_ids=_ids(tokenizer)[:1], params=params)
    [b] = engine.generate(prompt_token_ids=_ids(tokenizer)[:1], params=params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert all(lp <= 0 for lp in a.logprobs)


@pytest.mark.parametrize("values, name", [
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.2}, "repetition_penalty"),
    ({"repetition_penalty": "strong"}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
])
def test_out_of_range_penalties_are_refused_by_name(values, name):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams.from_dict(values)


def test_integer_penalties_are_taken_as_numbers():
    params = SamplingParams.from_dict({"repetition_penalty": 2, "presence_penalty": 1, "frequency_penalty": -1})
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (2.0, 1.0, -1.0)
    assert params.penalized and not SamplingParams().penalized


@pytest.mark.server
def test_penalties_through_triton_equal_the_offline_engine(triton_server, engine):
    sampling = {"max_tokens": MAX_NEW, "ignore_eos": True, "repetition_penalty": 1.3, "presence_penalty": 0.5}
    prompts = [CHAT_PROMPTS[0], PLAIN_PROMPTS[0]]
    client = StreamClient(triton_server.grpc_url)
    for i, p in enumerate(prompts):
        client.send(f"p{i}", make_inputs(p, stream=True, sampling=sampling))
    client.send("plain", make_inputs(prompts[1], stream=True, sampling={"max_tokens": MAX_NEW, "ignore_eos": True}))
    got = client.wait(timeout=120)
    client.close()
    refs = engine.generate(prompts, SamplingParams(**sampling))
    for i, ref in enumerate(refs):
        assert got[f"p{i}"].error is None and got[f"p{i}"].ids == ref.token_ids
    [plain] = engine.generate([prompts[1]], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert got["plain"].ids == plain.token_ids != got["p1"].ids
