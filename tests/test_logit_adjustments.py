"""Logit adjustments and min-p: penalties (transformers' and vLLM's formulas), logit_bias (OpenAI's),
bad words and allowed tokens (vLLM's), per row."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from greedy_reference import transformers_greedy
from grpc_stream import StreamClient, make_inputs
from prompts import CHAT_PROMPTS, PLAIN_PROMPTS
from tritonllm.guided.decoding import Guides
from tritonllm.runner.logit_adjustments import LogitAdjustments
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams
from tritonllm.scheduling.scheduler import ScheduledSeq
from tritonllm.core.sequence import Sequence

pytestmark = pytest.mark.unit

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
        penalty = [RepetitionPenaltyLogitsProcessor(rp)] if rp != 1.0 else []
        ref, _ = transformers_greedy(hf_model, ids, out.token_ids, MAX_NEW, eos=sorted(engine.eos_token_ids),
                                     processors=penalty)
        assert out.token_ids == ref, (rp, tokenizer.decode(ids))
    plain = [out.token_ids for (_, rp), out in zip(cases, outs) if rp == 1.0]
    penalized = [out.token_ids for (_, rp), out in zip(cases, outs) if rp == 1.3]
    assert plain != penalized  # the penalty changed something on these prompts


def _reference(hf_model, ids: list[int], candidate: list[int], presence: float = 0.0, frequency: float = 0.0,
               bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding on transformers' logits with OpenAI's presence / frequency penalties and logit_bias
    applied by hand, no EOS stop (greedy_reference.py checks `candidate`)."""
    def adjust(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[0, len(ids):].tolist()
        scores = scores.clone()
        for token in set(out):
            scores[0, token] -= frequency * out.count(token) + presence
        for token, value in (bias or {}).items():
            scores[0, token] += value
        return scores

    return transformers_greedy(hf_model, ids, candidate, MAX_NEW, eos=[], processors=[adjust])[0]


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.0), (0.5, 0.5), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_match_a_reference_on_transformers_logits(engine, hf_model, tokenizer,
                                                                                   presence, frequency):
    prompts = _ids(tokenizer)[:2]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency)
    outs = engine.generate(prompt_token_ids=prompts, params=params)
    for ids, out in zip(prompts, outs):
        assert out.token_ids == _reference(hf_model, ids, out.token_ids, presence, frequency)


def test_penalties_combine_with_sampling_and_log_probs(engine, tokenizer):
    """A sampled, seeded, penalized row repeats itself run to run, and its log-probs are probabilities."""
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, repetition_penalty=1.2, frequency_penalty=0.3)
    [a] = engine.generate(prompt_token_ids=_ids(tokenizer)[:1], params=params)
    [b] = engine.generate(prompt_token_ids=_ids(tokenizer)[:1], params=params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert all(lp <= 0 for lp in a.logprobs)


def test_logit_bias_matches_a_reference_on_transformers_logits_beside_an_unbiased_row(engine, hf_model, tokenizer):
    ids = _ids(tokenizer)[0]
    [plain] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    # Ban the greedy first token and nudge two others: the whole continuation changes.
    bias = {plain.token_ids[0]: -100.0, plain.token_ids[1]: 2.5, tokenizer.encode(" the")[0]: -1.0}
    biased, unbiased = engine.generate(prompt_token_ids=[ids, ids], params=[
        SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logit_bias=bias),
        SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)])
    assert biased.token_ids == _reference(hf_model, ids, biased.token_ids, bias=bias)
    assert biased.token_ids[0] != plain.token_ids[0] and unbiased.token_ids == plain.token_ids


def test_a_large_logit_bias_forces_its_token_and_string_keys_are_token_ids(engine, tokenizer):
    forced = tokenizer.encode(" banana")[0]
    params = SamplingParams.from_dict({"max_tokens": 5, "ignore_eos": True, "logit_bias": {str(forced): 100}})
    assert params.logit_bias == {forced: 100}
    [out] = engine.generate(prompt_token_ids=_ids(tokenizer)[:1], params=params)
    assert out.token_ids == [forced] * 5


def test_min_p_keeps_tokens_near_the_most_likely_one(engine, tokenizer):
    """min_p = 1 keeps only the most likely token: sampling then equals greedy; below 1, seeded runs repeat."""
    prompts = _ids(tokenizer)
    greedy = engine.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    sampled = engine.generate(prompt_token_ids=prompts, params=SamplingParams(
        max_tokens=MAX_NEW, ignore_eos=True, temperature=1.5, min_p=1.0, seed=1))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=1.5, min_p=0.2, seed=7)
    first, again = (engine.generate(prompt_token_ids=prompts[:1], params=params)[0].token_ids for _ in range(2))
    loose = engine.generate(prompt_token_ids=prompts[:1], params=SamplingParams(
        max_tokens=MAX_NEW, ignore_eos=True, temperature=1.5, seed=7))[0].token_ids
    assert first == again and first != loose  # the same seed without min_p wanders elsewhere


def test_a_bad_words_last_token_is_banned_only_where_it_would_complete_the_word():
    seq = Sequence("b", [1, 2], SamplingParams(bad_words=["x"]))
    seq.bad_word_ids = [(5,), (7, 8), (1, 2, 3)]
    for output, due in (([], {5}), ([9, 7], {5, 8}), ([1, 2], {5, 3}), ([7, 1], {5}), ([2], {5})):
        seq.token_ids = [1, 2] + output
        adjustments = LogitAdjustments.build([ScheduledSeq(seq, 1)], 16, torch.device("cpu"))
        assert set(adjustments.banned.ids.tolist()) == due, output


def test_bad_words_are_never_generated(engine, tokenizer):
    ids = _ids(tokenizer)[0]
    [plain] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    words = [w for w in plain.text.split() if w.isalpha()][:3]
    [out] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(
        max_tokens=MAX_NEW, ignore_eos=True, bad_words=words))
    variants = engine._bad_word_ids(words)
    assert out.token_ids != plain.token_ids and len(variants) >= len(words)
    for w in variants:
        assert not any(tuple(out.token_ids[i:i + len(w)]) == w for i in range(len(out.token_ids))), w


@pytest.mark.parametrize("cut", [0, 30000])
def test_a_guides_tokens_meet_allowed_token_ids_and_win_when_they_share_none(tokenizer, cut):
    """A regex guide beside allowed_token_ids: the step allows what both allow, or the guide's tokens
    where they share none. A model vocabulary `cut` tokens short of the tokenizer's (a tokenizer can
    list tokens the model has no row for) cuts the guide's mask."""
    guided = {"regex": "[ab]+"}
    guide = Guides(tokenizer, {tokenizer.eos_token_id}).for_request(SamplingParams(guided_decoding=guided).guided_decoding)
    model_vocab = len(tokenizer) - cut
    a, c = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("c")
    a_or_b = {i for i in range(model_vocab) if set(tokenizer.decode([i]) or "-") <= {"a", "b"}}
    assert a in a_or_b and c not in a_or_b
    for explicit, allowed in ((None, a_or_b), ([a, c, model_vocab - 1], {a}), ([c], a_or_b)):
        seq = Sequence("g", [7], SamplingParams(allowed_token_ids=explicit, guided_decoding=guided))
        seq.guided = guide.start()  # what the engine gives such a request
        adjustments = LogitAdjustments.build([ScheduledSeq(seq, 1)], model_vocab, torch.device("cpu"))
        assert set(torch.nonzero(~adjustments.allowed.forbidden[0]).flatten().tolist()) == allowed, explicit


def test_allowed_token_ids_choose_the_best_allowed_token(engine, hf_model, tokenizer):
    ids = _ids(tokenizer)[1]
    allowed = sorted({tokenizer.encode(w)[0] for w in (" yes", " no", " maybe", ".")})
    params = SamplingParams(max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)
    restricted, free = engine.generate(prompt_token_ids=[ids, ids], params=[params, SamplingParams(max_tokens=6)])
    assert set(restricted.token_ids) <= set(allowed) and free.token_ids != restricted.token_ids
    with torch.no_grad():
        first = hf_model(torch.tensor([ids])).logits[0, -1]
    assert restricted.token_ids[0] == allowed[int(first[allowed].argmax())]


def test_logit_bias_token_beyond_the_vocabulary_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="logit_bias token ids must be below the vocabulary size"):
        engine.add_request("Hi", {"logit_bias": {"10000000": 1.0}})
    with pytest.raises(InvalidRequestError, match="allowed_token_ids must be below the vocabulary size"):
        engine.add_request("Hi", {"allowed_token_ids": [1, 10000000]})


@pytest.mark.parametrize("values, name", [
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": "1,2"}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"logit_bias": [5, 1]}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.2}, "repetition_penalty"),
    ({"repetition_penalty": "strong"}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
])
def test_out_of_range_values_are_refused_by_name(values, name):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams.from_dict(values)


def test_integer_penalties_are_taken_as_numbers():
    params = SamplingParams.from_dict({"repetition_penalty": 2, "presence_penalty": 1, "frequency_penalty": -1})
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (2.0, 1.0, -1.0)
    assert params.adjusts_logits and not SamplingParams().adjusts_logits


@pytest.mark.server
def test_penalties_and_logit_bias_through_triton_equal_the_offline_engine(triton_server, engine):
    sampling = {"max_tokens": MAX_NEW, "ignore_eos": True, "repetition_penalty": 1.3, "presence_penalty": 0.5}
    prompts = [CHAT_PROMPTS[0], PLAIN_PROMPTS[0]]
    [plain] = engine.generate([prompts[1]], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    # JSON object keys are strings: the greedy second token banned, another one favoured.
    biased = {"max_tokens": MAX_NEW, "ignore_eos": True, "logit_bias": {str(plain.token_ids[1]): -100, "314": 1.5}}
    client = StreamClient(triton_server.grpc_url)
    for i, p in enumerate(prompts):
        client.send(f"p{i}", make_inputs(p, stream=True, sampling=sampling))
    client.send("plain", make_inputs(prompts[1], stream=True, sampling={"max_tokens": MAX_NEW, "ignore_eos": True}))
    client.send("biased", make_inputs(prompts[1], stream=True, sampling=biased))
    got = client.wait(timeout=120)
    client.close()
    refs = engine.generate(prompts, SamplingParams(**sampling))
    for i, ref in enumerate(refs):
        assert got[f"p{i}"].error is None and got[f"p{i}"].ids == ref.token_ids
    assert got["plain"].ids == plain.token_ids != got["p1"].ids
    [ref] = engine.generate([prompts[1]], SamplingParams.from_dict(biased))
    assert got["biased"].error is None and got["biased"].ids == ref.token_ids
    assert ref.token_ids[0] == plain.token_ids[0] and ref.token_ids[1] != plain.token_ids[1]
