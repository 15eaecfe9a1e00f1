"""Speculative decoding with n-gram drafts (ngram_draft.py): the same tokens, fewer steps."""

from __future__ import annotations

import dataclasses
import math

import pytest

from prompts import CHAT_PROMPTS, LONG_TEXT, PLAIN_PROMPTS
from tritonllm.core.config import EngineConfig, SpeculativeConfig
from tritonllm.core.parameters import ConfigError
from tritonllm.scheduling.ngram_draft import DraftAcceptance, NgramIndex, accepted_tokens
from tritonllm.core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

COPY_PROMPT = "Repeat the following text word for word.\n\n" + LONG_TEXT[:600]


# ---- the draft and its acceptance -----------------------------------------------------------------
def test_draft_follows_the_latest_earlier_occurrence_of_the_last_trigram():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert NgramIndex().draft(tokens, 2) == [7, 8]  # the latest earlier "1 2 3" is followed by 7 8
    assert NgramIndex().draft(tokens, 10) == [7, 8, 5, 1, 2, 3]  # as far as the list goes


def test_draft_falls_back_to_the_last_bigram_and_to_nothing():
    assert NgramIndex().draft([4, 5, 6, 0, 5, 6], 3) == [0, 5, 6]  # "0 5 6" is new, "5 6" is not
    assert NgramIndex().draft([1, 2, 3, 4], 3) == []
    assert NgramIndex().draft([7], 3) == []


def test_a_growing_list_drafts_as_a_fresh_index_does():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4, 1, 5, 9, 2, 6, 5, 1, 4, 1]
    grown = NgramIndex()
    for end in range(1, len(tokens) + 1):
        assert grown.draft(tokens[:end], 4) == NgramIndex().draft(tokens[:end], 4)


def test_accepted_tokens_stop_at_the_first_draft_token_the_model_did_not_choose():
    draft = [10, 11, 12]
    assert accepted_tokens(draft, [10, 11, 12, 13]) == 4  # every draft token and the last row's choice
    assert accepted_tokens(draft, [10, 99, 12, 13]) == 2  # 10 accepted, then the model's 99
    assert accepted_tokens(draft, [5, 11, 12, 13]) == 1  # only the model's own first choice


def test_speculative_tokens_must_not_be_negative():
    with pytest.raises(ConfigError, match="speculative_tokens"):
        EngineConfig.from_parameters(speculative_tokens=-1)
    with pytest.raises(ConfigError, match="speculative_min_acceptance"):
        EngineConfig.from_parameters(speculative_min_acceptance=1.5)


def test_draft_acceptance_scores_each_position_up_to_the_first_wrong_one():
    record = DraftAcceptance()
    record.expect(3, [7, 8, 9])
    record.settle([0, 1, 2, 7, 8])  # 7 and 8 right, 9 not known yet
    assert record.rate == pytest.approx(1 - (7 / 8) ** 2)
    record.settle([0, 1, 2, 7, 8, 5])  # scored once only
    assert record.rate == pytest.approx(1 - (7 / 8) ** 2)
    before = record.rate
    record.expect(6, [4, 4])
    record.settle([0, 1, 2, 7, 8, 5, 3, 4])  # the first wrong: one miss, the rest not counted
    assert record.rate == pytest.approx(before * 7 / 8)
    record.expect(8, [1])
    record.settle([0, 1, 2, 7, 8, 5, 3, 4])  # nothing new yet: kept for the next settle
    record.settle([0, 1, 2, 7, 8, 5, 3, 4, 1])
    assert record.rate == pytest.approx(before * 7 / 8 + (1 - before * 7 / 8) / 8)


def test_thirteen_right_guesses_in_a_row_earn_drafts_at_the_default_bar():
    record, tokens = DraftAcceptance(), []
    for n in range(40):
        record.expect(len(tokens), [n])
        tokens.append(n)
        record.settle(tokens)
        if record.rate >= EngineConfig().speculative.min_acceptance:
            break
    assert n + 1 == 13


# ---- on the engine: the tokens of one-at-a-time decoding ----------------------------------------
@pytest.fixture
def speculating(engine):
    """The shared engine with drafts of up to 4 tokens in steps of up to 8 sequences (and only there), for one test."""
    scheduler = engine.scheduler
    saved = scheduler.speculative
    scheduler.speculative = SpeculativeConfig(num_tokens=4, max_batch=8, min_acceptance=1.0)
    yield engine
    scheduler.speculative = saved


def _run(engine, prompts, params, spec: bool, chat: bool = True):
    scheduler = engine.scheduler
    saved = scheduler.speculative
    if not spec:
        scheduler.speculative = dataclasses.replace(saved, num_tokens=0)
    try:
        steps = engine.num_steps
        outs = engine.generate(prompts, params, apply_chat_template=chat)
        return outs, engine.num_steps - steps
    finally:
        scheduler.speculative = saved


def test_greedy_tokens_and_logprobs_are_those_of_decoding_one_at_a_time(speculating):
    prompts = [COPY_PROMPT, CHAT_PROMPTS[0], CHAT_PROMPTS[1], PLAIN_PROMPTS[0]]
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    plain, _ = _run(speculating, prompts, params, spec=False)
    drafted, _ = _run(speculating, prompts, params, spec=True)
    for a, b in zip(plain, drafted):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert b.logprobs == a.logprobs  # bit for bit: each row is a one-token decode's arithmetic
    # Alone, the copy prompt's drafts are mostly accepted: far fewer steps (a step per 96 tokens without).
    _, copy_steps = _run(speculating, [COPY_PROMPT], params, spec=True)
    assert copy_steps < 0.6 * 96


def test_stops_inside_accepted_drafts_end_where_they_would_without(speculating):
    [ref], _ = _run(speculating, [COPY_PROMPT], SamplingParams(max_tokens=80, ignore_eos=True), spec=False)
    stop_id = ref.token_ids[37]
    stop_text = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 6]
    # Without log-probs: the greedy rows take the screened head where there is one.
    for params in (SamplingParams(max_tokens=41, ignore_eos=True, logprobs=False),
                   SamplingParams(max_tokens=80, ignore_eos=True, stop_token_ids=[stop_id], logprobs=False),
                   SamplingParams(max_tokens=80, ignore_eos=True, stop=[stop_text], logprobs=False),
                   SamplingParams(max_tokens=80, logprobs=False)):
        [a], _ = _run(speculating, [COPY_PROMPT], params, spec=False)
        [b], _ = _run(speculating, [COPY_PROMPT], params, spec=True)
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)


def test_sampled_and_penalised_requests_beside_drafted_ones_are_unchanged(speculating):
    prompts = [COPY_PROMPT, CHAT_PROMPTS[0], CHAT_PROMPTS[1]]
    params = [SamplingParams(max_tokens=48, ignore_eos=True),
              SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.8, seed=7),
              SamplingParams(max_tokens=48, ignore_eos=True, repetition_penalty=1.3)]
    plain, _ = _run(speculating, prompts, params, spec=False)
    drafted, _ = _run(speculating, prompts, params, spec=True)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]


def test_many_sequences_take_no_drafts_and_the_prefix_cache_holds_accepted_tokens(speculating):
    # More sequences than speculative_max_batch: plain decode steps, the same tokens.
    prompts = [f"{p} ({i})" for i in range(3) for p in PLAIN_PROMPTS[:3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, plain_steps = _run(speculating, prompts, params, spec=False, chat=False)
    drafted, drafted_steps = _run(speculating, prompts, params, spec=True, chat=False)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain] and drafted_steps == plain_steps
    # The drafted copy's blocks, accepted tokens included, are found again by their content.
    [first], _ = _run(speculating, [COPY_PROMPT], SamplingParams(max_tokens=64, ignore_eos=True), spec=True)
    full = first.prompt_token_ids + first.token_ids
    [again] = speculating.generate(prompt_token_ids=[full[:-1]], params=SamplingParams(max_tokens=1, ignore_eos=True))
    bs = speculating.config.cache.block_size
    assert again.num_cached_prompt_tokens >= (len(full) - 1) // bs * bs - bs
    assert again.token_ids == [full[-1]]
    assert not math.isnan(first.logprobs[0])


def test_sequences_whose_drafts_keep_being_right_draft_in_larger_steps(speculating):
    # Nine copying sequences, more than speculative_max_batch: each drafts once its guesses have been
    # right often enough, and the tokens are those of decoding one at a time.
    prompts = [f"{COPY_PROMPT} ({i})" for i in range(9)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain, plain_steps = _run(speculating, prompts, params, spec=False)
    speculating.scheduler.speculative = dataclasses.replace(speculating.scheduler.speculative, min_acceptance=0.8)
    drafted, drafted_steps = _run(speculating, prompts, params, spec=True)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert [o.logprobs for o in drafted] == [o.logprobs for o in plain]
    assert drafted_steps < plain_steps - 10
    # Free text at a bar no average reaches: no drafts, the same steps.
    speculating.scheduler.speculative = dataclasses.replace(speculating.scheduler.speculative, min_acceptance=1.0)
    again, again_steps = _run(speculating, prompts, params, spec=True)
    assert again_steps == plain_steps and [o.token_ids for o in again] == [o.token_ids for o in plain]
