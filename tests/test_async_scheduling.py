"""Async scheduling (`async_scheduling`): the host builds step N+1 while step N runs, and the outputs are
those of the synchronous loop: the same tokens, text, finish reasons and counts, and the same log-probs.

The shared engine runs on the CPU, where async scheduling is off by default; each test runs the same
requests with it off, then on, and compares what every request was told. On a GPU (the device check) the
shared engine runs in bfloat16, where a row's log-prob moves by rounding from one batch to another: there
the outputs must agree up to a near-tie (`_compare_in_half_precision`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from prompts import CHAT_PROMPTS, LONG_TEXT, PLAIN_PROMPTS
from tritonllm.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tritonllm.core.sampling_params import SamplingParams
from tritonllm.core.sequence import FinishReason, Sequence
from tritonllm.engine.engine import PLACEHOLDER, Engine
from tritonllm.scheduling.block_manager import BlockManager
from tritonllm.scheduling.scheduler import Scheduler

pytestmark = pytest.mark.engine

# Where the two loops batch requests differently (a sequence ended by EOS or a stop string still has a
# row in the step after, so prompt chunks split elsewhere and sampled rows share other steps), a row's
# log-prob may differ in its last bits, as it does in the synchronous loop from one batch to another.
LOGPROB_TOLERANCE = 1e-4
# In bfloat16 a batch of other rows moves a row's log-probs by hundredths to tenths of a nat (logits near
# 20 round to steps of 0.125); a token fed from the wrong row or step moves them by whole nats.
HALF_PRECISION_DRIFT = 0.5
COMMA = 28  # the default model's token for ","


@contextmanager
def async_scheduling(engine: Engine, on: bool):
    """The shared engine with async scheduling switched on or off while it is idle."""
    assert not engine.has_unfinished()
    before, engine.async_scheduling = engine.async_scheduling, on
    try:
        yield engine
    finally:
        engine.async_scheduling = before


@contextmanager
def free_blocks_left(engine: Engine, num_blocks: int):
    """All but `num_blocks` of the KV pool held by a sequence that never runs, so that long requests
    preempt each other."""
    bm = engine.block_manager
    holder = Sequence("holder", [0], SamplingParams())
    bm.append_slots(holder, (bm.num_free_blocks - num_blocks) * bm.block_size)
    try:
        yield
    finally:
        bm.free(holder)


class _Driver:
    """Requests joining when an earlier one has shown some tokens, aborts likewise; everything each
    request's outputs said, joined."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.got: dict[str, dict] = {}
        self.steps_left_in_flight = 0  # calls after which a step was still on the device
        self.sampled: set[str] = set()

    def add(self, request_id: str, prompt: str, params: SamplingParams, chat: bool = False) -> None:
        if params.temperature > 0:
            self.sampled.add(request_id)
        self.engine.add_request(prompt, params, request_id=request_id, apply_chat_template=chat)

    def seen(self, request_id: str) -> int:
        return len(self.got.get(request_id, {}).get("token_ids", []))

    def record(self, out) -> None:
        got = self.got.setdefault(out.request_id, {"token_ids": [], "logprobs": [], "top": [], "text": "",
                                                   "num_outputs": 0,
                                                   "sampled": out.request_id.split("/")[0] in self.sampled})
        assert not got.get("finished"), f"{out.request_id}: an output after its last one"
        got["token_ids"] += out.new_token_ids
        got["logprobs"] += [None if math.isnan(lp) else lp for lp in out.new_logprobs]
        got["top"] += out.new_top_logprobs
        got["text"] += out.new_text
        got["num_outputs"] += 1
        if out.prompt_logprobs is not None:
            got["prompt_logprobs"] = out.prompt_logprobs
        if out.finished:
            got.update(finished=True, finish_reason=out.finish_reason, num_output_tokens=out.num_output_tokens)
        assert PLACEHOLDER not in out.new_token_ids

    def run(self, events: list) -> dict[str, dict]:
        """`events`: (request id, tokens seen, action) in order; each action runs once that request has
        shown that many tokens (or has finished)."""
        events = list(events)
        for _ in range(10_000):
            while events and (self.seen(events[0][0]) >= events[0][1] or self.got.get(events[0][0], {}).get("finished")):
                for out in events.pop(0)[2](self):
                    self.record(out)
            if not self.engine.has_unfinished() and not events:
                break
            for out in self.engine.step():
                self.record(out)
            self.steps_left_in_flight += self.engine.num_steps_in_flight
        assert not self.engine.has_unfinished()
        return self.got


def _add(*requests):
    def action(driver: _Driver):
        for request in requests:
            driver.add(*request)
        return []
    return action


def _abort(request_id: str):
    return lambda driver: driver.engine.abort(request_id)


def _script() -> list:
    greedy = dict(logprobs=True)
    first = [
        ("lead", PLAIN_PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True, **greedy)),
        ("eos", CHAT_PROMPTS[0], SamplingParams(max_tokens=48, **greedy), True),  # ends on EOS
        ("eos-min", CHAT_PROMPTS[2], SamplingParams(max_tokens=40, min_tokens=12), True),
        ("stop-string", PLAIN_PROMPTS[1], SamplingParams(max_tokens=40, stop=[" the", "."], ignore_eos=True)),
        ("short", PLAIN_PROMPTS[7], SamplingParams(max_tokens=3, **greedy)),
        ("aborted", PLAIN_PROMPTS[3], SamplingParams(max_tokens=60, ignore_eos=True)),
        ("top", PLAIN_PROMPTS[5], SamplingParams(max_tokens=10, logprobs=True, top_logprobs=2, prompt_logprobs=1)),
    ]
    later = [
        ("long", LONG_TEXT[:700], SamplingParams(max_tokens=12, ignore_eos=True)),  # prompt chunks beside decodes
        ("forks", CHAT_PROMPTS[1], SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=7, max_tokens=16), True),
        ("stop-id", "Count: 1, 2, 3", SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[COMMA])),
    ]
    return [("lead", 0, _add(*first)), ("lead", 5, _add(*later)), ("aborted", 6, _abort("aborted")),
            ("lead", 12, _add(("late", PLAIN_PROMPTS[6], SamplingParams(max_tokens=8, ignore_eos=True))))]


def _compare(sync: dict, overlapped: dict, exact: bool = False, engine: Engine | None = None) -> None:
    if engine is not None and engine.dtype in (torch.float16, torch.bfloat16) and not exact:
        _compare_in_half_precision(sync, overlapped)
        return
    assert sorted(sync) == sorted(overlapped)
    for request_id, want in sync.items():
        got = overlapped[request_id]
        for key in ("token_ids", "text", "finish_reason", "num_output_tokens"):
            assert got.get(key) == want.get(key), f"{request_id}: {key} differs"
        for key in ("logprobs", "top", "prompt_logprobs"):
            same = got.get(key) == want.get(key) if exact else _close(got.get(key), want.get(key))
            assert same, f"{request_id}: {key} differs"


def _compare_in_half_precision(sync: dict, overlapped: dict) -> None:
    """Where the two loops batch rows differently, half-precision rounding may tip a near-tie: each
    request's tokens are equal up to where they part, their log-probs within HALF_PRECISION_DRIFT, and
    where a greedy request's tokens part, both choices are a near-tie (within HALF_PRECISION_DRIFT of each
    other, where it asked for log-probs; a sampled request's draw may fall on either side of a boundary).
    A request whose tokens do not part must have said the same in every way."""
    assert sorted(sync) == sorted(overlapped)
    for request_id, want in sync.items():
        got = overlapped[request_id]
        a, b = want["token_ids"], got["token_ids"]
        parts_at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        common = min(len(a), len(b)) if parts_at is None else parts_at
        for i in range(common + (parts_at is not None and not want["sampled"])):
            x, y = want["logprobs"][i], got["logprobs"][i]
            assert (x is None) == (y is None), f"{request_id}: log-prob {i} asked in one loop only"
            if x is not None:
                assert abs(x - y) <= HALF_PRECISION_DRIFT, f"{request_id}: log-prob {i} {x} against {y}"
        if parts_at is None:
            for key in ("token_ids", "text", "finish_reason", "num_output_tokens"):
                assert got.get(key) == want.get(key), f"{request_id}: {key} differs"


def _close(a, b) -> bool:
    """Equal, floats within LOGPROB_TOLERANCE (in lists of log-probs, top entries, prompt entries)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= LOGPROB_TOLERANCE
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _both(engine: Engine, events: list) -> tuple[dict, dict]:
    """What each request was told by the synchronous loop, then with async scheduling, on one engine."""
    results = []
    for on in (False, True):
        with async_scheduling(engine, on):
            driver = _Driver(engine)
            results.append(driver.run(events))
            if on:
                assert driver.steps_left_in_flight > 3, "async scheduling never left a step in flight"
    return results[0], results[1]


def test_a_burst_ending_by_length_takes_the_same_steps_with_bit_identical_outputs(engine):
    """Requests that end by max_tokens take no wasted row: the steps are the synchronous loop's, also
    where queued requests take the places of those that end (more requests than max_num_seqs)."""
    prompts = (PLAIN_PROMPTS[:4] + CHAT_PROMPTS[:6]) * 4
    assert len(prompts) > engine.config.scheduler.max_num_seqs
    requests = [(f"r{i}", prompt, SamplingParams(max_tokens=2 + i % 7, ignore_eos=True))
                for i, prompt in enumerate(prompts)]
    steps, results = [], []
    for on in (False, True):
        with async_scheduling(engine, on):
            before = engine.num_steps
            results.append(_Driver(engine).run([("r0", 0, _add(*requests))]))
            steps.append(engine.num_steps - before)
    assert steps[0] == steps[1]
    _compare(*results, exact=True)


def test_outputs_equal_the_synchronous_loop_as_requests_join_stop_and_abort(engine):
    sync, overlapped = _both(engine, _script())
    _compare(sync, overlapped, engine=engine)
    assert {r["finish_reason"] for r in sync.values()} == {"stop", "length", "abort"}
    assert sync["aborted"]["num_output_tokens"] == len(sync["aborted"]["token_ids"]) >= 6
    assert sync["stop-id"]["token_ids"][-1] == COMMA and sync["stop-id"]["finish_reason"] == "stop"
    assert sync["eos"]["token_ids"][-1] in engine.eos_token_ids
    assert len(sync["forks/0"]["token_ids"]) == len(sync["forks/1"]["token_ids"]) == 16


def test_requests_that_read_their_tokens_on_the_host_give_the_same_outputs(engine):
    """A guide's mask, penalties and bad words are built on the host from the tokens so far: the step
    after one of theirs is built once its tokens are there."""
    events = [("plain", 0, _add(
        ("plain", PLAIN_PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True)),
        ("plain-2", PLAIN_PROMPTS[5], SamplingParams(max_tokens=14, ignore_eos=True)))),
        ("plain", 4, _add(
            ("choice", CHAT_PROMPTS[4], SamplingParams(max_tokens=12, guided_decoding={"choice": ["Buenos días", "Hola"]}),
             True),
            ("penalty", PLAIN_PROMPTS[1], SamplingParams(max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5)),
            ("bad-words", PLAIN_PROMPTS[3], SamplingParams(max_tokens=12, bad_words=["the", "France"]))))]
    sync, overlapped = _both(engine, events)
    _compare(sync, overlapped, engine=engine)
    assert sync["choice"]["text"] in ("Buenos días", "Hola")


def test_preempted_sequences_give_the_same_outputs(engine):
    """Four requests admitted into what is left of the pool outgrow it: running sequences are preempted,
    some with a token in flight."""
    events = [("a", 0, _add(*[(name, prompt, SamplingParams(max_tokens=50, ignore_eos=True))
                              for name, prompt in zip("abcd", PLAIN_PROMPTS[:4])]))]
    before = engine.scheduler.num_preemptions
    with free_blocks_left(engine, 14):
        sync, overlapped = _both(engine, events)
    assert engine.scheduler.num_preemptions > before, "nothing was preempted"
    _compare(sync, overlapped, engine=engine)


@pytest.mark.unit
@pytest.mark.parametrize("setting, device, plans_on_host, tensor_parallel_size, on", [
    ("auto", "cpu", False, 1, False), ("auto", "cuda", False, 1, True), ("auto", "cuda", True, 1, False),
    ("auto", "npu", False, 1, True), ("true", "cpu", False, 1, True), ("true", "cuda", True, 1, True),
    ("false", "cuda", False, 1, False), ("true", "cuda", False, 2, False)])
def test_the_setting_and_the_device_decide(setting, device, plans_on_host, tensor_parallel_size, on):
    config = EngineConfig.from_parameters(async_scheduling=setting, tensor_parallel_size=tensor_parallel_size)
    engine = SimpleNamespace(device=SimpleNamespace(type=device), runner=SimpleNamespace(plans_on_host=plans_on_host))
    assert Engine._async_scheduling(engine, config) is on


# ---- the scheduler's side, without a model ----------------------------------------------------------

def _scheduler(num_blocks: int = 32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, enable_prefix_caching=True), SchedulerConfig(max_num_batched_tokens=64),
                     max_model_len=32, cache=CacheConfig(block_size=4))


@pytest.mark.unit
def test_a_sequence_whose_token_in_flight_is_its_last_is_not_scheduled_and_frees_its_place():
    scheduler = _scheduler()
    scheduler.config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64)
    by_tokens = Sequence("max-tokens", [1, 2, 3], SamplingParams(max_tokens=2))
    by_length = Sequence("model-len", list(range(1, 31)), SamplingParams())
    goes_on = Sequence("goes-on", [1, 2, 3], SamplingParams(max_tokens=8))
    for seq in (by_tokens, by_length, goes_on):
        scheduler.add(seq)
    scheduler.commit(scheduler.schedule())
    waiting = Sequence("waiting", [1, 2], SamplingParams())
    scheduler.add(waiting)
    # The step in flight chose each one's next token: the second (last) of "max-tokens", the one that
    # brings "model-len" to max_model_len (32).
    by_tokens.token_ids += [5, PLACEHOLDER]
    by_length.token_ids += [5, PLACEHOLDER]
    goes_on.token_ids += [PLACEHOLDER]
    for seq in (by_tokens, by_length, goes_on):
        seq.num_computed_tokens = seq.num_tokens - 1
    out = scheduler.schedule(speculate=False)
    assert [item.seq for item in out.scheduled] == [goes_on, waiting]  # max_num_seqs 3: two of 4 running end


@pytest.mark.unit
def test_a_preempted_sequence_ended_by_its_token_in_flight_is_removed_once():
    scheduler = _scheduler()
    seq = Sequence("s", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8))
    scheduler.add(seq)
    scheduler.commit(scheduler.schedule())
    scheduler._preempt(seq)  # its blocks went back while its token was on its way
    free = scheduler.block_manager.num_free_blocks
    scheduler.finish(seq, FinishReason.STOP)
    assert seq.is_finished and not scheduler.has_work()
    assert scheduler.block_manager.num_free_blocks == free  # not freed twice


@pytest.mark.unit
def test_commit_skips_a_sequence_that_ended_before_its_step_landed():
    scheduler = _scheduler()
    seq = Sequence("s", [1, 2, 3], SamplingParams(max_tokens=8))
    scheduler.add(seq)
    out = scheduler.schedule()
    scheduler.finish(seq, FinishReason.STOP)
    scheduler.commit(out)
    assert seq.num_computed_tokens == 0 and scheduler.block_manager.num_used_blocks == 0


def test_the_half_precision_comparison_accepts_a_near_tie_and_nothing_else():
    """What the device check's bfloat16 runs are held to: a parting at a near-tie passes; a parting at a
    confident choice, drifting log-probs before it, or a request that differs without parting fails."""
    def told(tokens, logprobs, text="x", reason="length", sampled=False):
        return {"token_ids": tokens, "logprobs": logprobs, "text": text, "finish_reason": reason,
                "num_output_tokens": len(tokens), "sampled": sampled}

    sync = {"r": told([1, 2, 3], [-0.1, -0.70, -0.2])}
    _compare_in_half_precision(sync, {"r": told([1, 2, 3], [-0.12, -0.69, -0.25])})
    _compare_in_half_precision(sync, {"r": told([1, 5, 6], [-0.12, -0.72, -3.0], text="y")})  # parts at a near-tie
    _compare_in_half_precision({"s": told([1, 2], [-0.1, -0.7], sampled=True)},  # a draw falls elsewhere
                               {"s": told([1, 9], [-0.1, -4.0], sampled=True)})
    for bad in (told([1, 5, 6], [-0.12, -2.9, -0.1]),  # parts where the other loop's choice was far less likely
                told([1, 2, 7], [-1.5, -0.7, -0.2]),  # a log-prob before the parting moved by more than rounding
                told([1, 2, 3], [-0.1, -0.7, -0.2], text="z")):  # the same tokens, another text
        with pytest.raises(AssertionError):
            _compare_in_half_precision(sync, {"r": bad})
