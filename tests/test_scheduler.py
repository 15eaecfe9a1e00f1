"""Scheduler invariants: token budget, sequence cap, chunked prefill, preemption order, policies."""

from __future__ import annotations

import pytest

from tritonllm.core.config import CacheConfig, SchedulerConfig
from tritonllm.scheduling.block_manager import BlockManager
from tritonllm.core.sampling_params import SamplingParams
from tritonllm.scheduling.scheduler import Scheduler
from tritonllm.core.sequence import FinishReason, Sequence

pytestmark = pytest.mark.unit

BS = 4


def make(num_blocks=64, max_seqs=8, budget=32, policy="fcfs", reserve_known_growth=False, **cache) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy,
                             reserve_known_growth=reserve_known_growth)
    return Scheduler(BlockManager(num_blocks, BS, watermark=0.0), config, 1024, CacheConfig(block_size=BS, **cache))


def seq(n, rid, max_tokens=8, priority=0) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, priority=priority))


def run_step(s: Scheduler, token=7):
    """Schedule, pretend the forward ran, append a token to every sequence that samples."""
    out = s.schedule()
    sampled = [it.seq for it in out.scheduled if it.samples]
    s.commit(out)
    for q in sampled:
        q.append_token(token, 0.0)
    return out


def test_token_budget_and_chunked_prefill():
    s = make(budget=10)
    a = seq(25, "a")
    s.add(a)
    out = s.schedule()
    assert [(it.seq.request_id, it.num_new_tokens, it.samples) for it in out.scheduled] == [("a", 10, False)]
    s.commit(out)
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 10 and not out.scheduled[0].samples
    s.commit(out)
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 5 and out.scheduled[0].samples
    assert out.num_batched_tokens <= 10


def test_decodes_first_then_prefill_fills_the_budget():
    s = make(budget=8)
    a = seq(4, "a")
    s.add(a)
    run_step(s)  # a prefilled, has sampled a token
    b = seq(20, "b")
    s.add(b)
    out = s.schedule()
    assert [(it.seq.request_id, it.num_new_tokens) for it in out.scheduled] == [("a", 1), ("b", 7)]


def test_sequence_cap():
    s = make(max_seqs=2, budget=100)
    for i in range(4):
        s.add(seq(3, f"s{i}"))
    out = s.schedule()
    assert len(out.scheduled) == 2 and s.num_waiting == 2


def test_preemption_frees_the_newest_and_requeues_it_first():
    # 6 blocks of 4 tokens; three sequences of 7 tokens take 2 blocks each; the next decode of
    # the first one needs a third block: the most recently admitted sequence is preempted.
    s = make(num_blocks=6, budget=100)
    seqs = [seq(7, f"s{i}") for i in range(3)]
    for q in seqs:
        s.add(q)
    run_step(s)  # prompts computed, 8 tokens each now: all blocks used
    assert s.block_manager.num_free_blocks == 0
    assert run_step(s).num_preempted == 0  # position 7 still fits in each second block
    out = run_step(s)
    assert out.num_preempted >= 1
    assert seqs[2] not in s.running and seqs[2].num_computed_tokens == 0 and not seqs[2].block_table
    assert s.waiting[0][1] is seqs[2]  # back at the head of the queue
    assert s.block_manager.num_free_blocks + s.block_manager.num_used_blocks == 6
    s.block_manager.check_invariants()


def test_abort_and_finish_free_everything():
    s = make()
    a, b, c = seq(9, "a"), seq(9, "b"), seq(9, "c")
    for q in (a, b, c):
        s.add(q)
    run_step(s)
    s.abort(a)
    s.finish(b, FinishReason.LENGTH)
    s.abort(c)
    assert a.finish_reason is FinishReason.ABORT and b.finish_reason is FinishReason.LENGTH
    assert s.block_manager.num_used_blocks == 0 and not s.has_work()
    assert not s.abort(a)  # already gone


def test_policies_order_the_waiting_queue():
    for policy, expected in (("fcfs", ["a", "b", "c"]), ("priority", ["c", "a", "b"]),
                             ("longest_output_first", ["b", "c", "a"])):
        s = make(policy=policy, max_seqs=1)
        s.add(seq(3, "a", max_tokens=8, priority=5))
        s.add(seq(3, "b", max_tokens=64, priority=9))
        s.add(seq(3, "c", max_tokens=32, priority=-1))
        assert [q.request_id for _, q in s.waiting] == expected, policy


def test_kv_window_keeps_memory_bounded():
    s = make(num_blocks=64, budget=64, kv_window=8, kv_sink_tokens=4)
    a = Sequence("a", list(range(1, 41)), SamplingParams(max_tokens=200, ignore_eos=True))
    s.add(a)
    run_step(s)  # the prompt's K/V are all written once; the window applies from then on
    for _ in range(60):
        run_step(s)
        live = sum(1 for b in a.block_table if b >= 0)
        assert live <= 1 + 8 // BS + 2  # sink block + window blocks + the block being written
    s.abort(a)
    assert s.block_manager.num_used_blocks == 0


def test_a_sibling_completion_waits_for_its_lead_prompt_without_holding_up_the_queue():
    s = make(budget=10)  # the lead's 22-token prompt takes three steps
    lead, sibling, other = seq(22, "r/0"), seq(22, "r/1"), seq(3, "other")
    sibling.prefill_after = lead
    for q in (lead, sibling, other):
        s.add(q)
    for _ in range(2):
        out = run_step(s)
        assert [it.seq.request_id for it in out.scheduled] == ["r/0"]  # budget spent on the lead
    third = run_step(s)
    # The sibling is passed over while the lead's prompt runs; the request behind it is not held up.
    assert [it.seq.request_id for it in third.scheduled] == ["r/0", "other"]
    assert sibling in [q for _, q in s.waiting]
    fourth = run_step(s)  # the lead's prompt is in the cache: its 5 full blocks serve the sibling
    [admitted] = [it for it in fourth.scheduled if it.seq is sibling]
    assert sibling.num_cached_prompt_tokens == 20 and admitted.num_new_tokens == 2


def test_admission_holds_blocks_back_for_outputs_of_known_length():
    # 12 blocks of 4 tokens. `a` runs with 40 more tokens to go; `b` (one block now) fits today, but
    # not beside both outputs at their peak when both run to max_tokens (ignore_eos). Outputs that may
    # stop at EOS are not held back for (as vLLM does), nor any with reserve_known_growth off.
    for ignore_eos, reserve, num_blocks, admitted in ((True, True, 12, False), (False, True, 12, True),
                                                      (True, False, 12, True), (True, True, 64, True)):
        s = make(num_blocks=num_blocks, budget=100, reserve_known_growth=reserve)
        params = SamplingParams(max_tokens=40, ignore_eos=ignore_eos)
        a, b = Sequence("a", [1, 2, 3, 4], params), Sequence("b", [5, 6, 7, 8], params)
        s.add(a)
        run_step(s)  # nothing ran: `a` is let in without holding anything back
        s.add(b)
        out = run_step(s)
        assert (b in s.running) is admitted, (ignore_eos, reserve, num_blocks)
        assert [it.seq for it in out.scheduled] == ([a, b] if admitted else [a])


def test_min_tokens_is_known_growth_too():
    s = make(num_blocks=12, budget=100, reserve_known_growth=True)
    params = SamplingParams(max_tokens=40, min_tokens=40)
    a, b = Sequence("a", [1, 2, 3, 4], params), Sequence("b", [5, 6, 7, 8], params)
    s.add(a)
    run_step(s)
    s.add(b)
    run_step(s)
    assert b not in s.running


def run_to_completion(s: Scheduler, max_steps=5000) -> int:
    """Steps until every sequence reached its max_tokens (finished there, as the engine does); returns
    the tokens computed on the way (each prompt once, plus every preempted prefix again)."""
    computed = 0
    for _ in range(max_steps):
        computed += run_step(s).num_batched_tokens
        for q in [q for q in s.running if q.num_output_tokens >= q.params.max_tokens]:
            s.finish(q, FinishReason.LENGTH)
        if not s.has_work():
            return computed
    raise AssertionError(f"not done in {max_steps} steps")


def test_known_long_outputs_in_short_memory_are_not_preempted_over_and_over():
    # 16 sequences of 8 + 120 tokens (ignore_eos; no prefix in common), all at once, in 96 blocks
    # (384 tokens: three finished sequences). Admitting whatever fits lets all 16 in; they grow
    # together, the newest is preempted, its blocks let the next waiting one in again, and every
    # preemption recomputes a prefix. Held back for their known lengths, none is preempted.
    runs = {}
    for reserve in (False, True):
        s = make(num_blocks=96, max_seqs=16, budget=64, reserve_known_growth=reserve)
        params = SamplingParams(max_tokens=120, ignore_eos=True)
        seqs = [Sequence(f"s{i}", [100 * i + j for j in range(8)], params) for i in range(16)]
        for q in seqs:
            s.add(q)
        computed = run_to_completion(s)
        assert all(q.num_output_tokens == 120 and q.finish_reason is FinishReason.LENGTH for q in seqs)
        assert s.block_manager.num_used_blocks == 0
        s.block_manager.check_invariants()
        runs[reserve] = (s.num_preemptions, computed)
    needed = 16 * (8 + 119)  # every token once (the last output token is sampled, never fed)
    assert runs[False][0] >= 30 and runs[False][1] > 1.5 * needed, runs
    assert runs[True] == (0, needed), runs


def test_sequences_admitted_in_one_step_leave_room_for_each_other():
    # Nothing runs: the first is let in whatever it will need, the second only beside the first's growth.
    s = make(num_blocks=12, budget=100, reserve_known_growth=True)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    a, b = Sequence("a", [1, 2, 3, 4], params), Sequence("b", [5, 6, 7, 8], params)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [it.seq for it in out.scheduled] == [a]
