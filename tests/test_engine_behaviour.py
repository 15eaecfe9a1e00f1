"""Engine behaviour on the real packaged model: stop conditions, abort, preemption, prefix cache, bad input."""

from __future__ import annotations

import pytest

from greedy_reference import transformers_greedy
from prompts import CHAT_PROMPTS, LONG_TEXT, PLAIN_PROMPTS
from tritonllm.core.config import EngineConfig
from tritonllm.engine.engine import Engine
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.engine


def greedy(engine, prompts, **params):
    return engine.generate(prompts, SamplingParams(**params))


def test_max_tokens_and_ignore_eos(engine):
    [out] = greedy(engine, ["Hello"], max_tokens=40, ignore_eos=True)
    assert len(out.token_ids) == 40 and out.finish_reason == "length"


def test_eos_stops_and_min_tokens_suppresses_it(engine):
    [free] = engine.generate([CHAT_PROMPTS[0]], SamplingParams(max_tokens=64), apply_chat_template=True)
    assert free.finish_reason == "stop" and free.token_ids[-1] in engine.eos_token_ids
    n = len(free.token_ids)
    [held] = engine.generate([CHAT_PROMPTS[0]], SamplingParams(max_tokens=64, min_tokens=n + 5),
                             apply_chat_template=True)
    assert len(held.token_ids) >= n + 5
    assert not set(held.token_ids[:n + 4]) & engine.eos_token_ids


def test_stop_token_ids(engine):
    [ref] = greedy(engine, [PLAIN_PROMPTS[0]], max_tokens=20, ignore_eos=True)
    stop_id = ref.token_ids[5]
    [out] = greedy(engine, [PLAIN_PROMPTS[0]], max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
    first = ref.token_ids.index(stop_id)
    assert out.token_ids == ref.token_ids[:first + 1] and out.finish_reason == "stop"
    # The stop token's text is left out, as vLLM's; with include_stop_str_in_output it ends the text.
    before = engine.tokenizer.decode(ref.token_ids[:first], skip_special_tokens=True)
    through = engine.tokenizer.decode(ref.token_ids[:first + 1], skip_special_tokens=True)
    assert before != through and out.text == before
    [kept] = greedy(engine, [PLAIN_PROMPTS[0]], max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id],
                    include_stop_str_in_output=True)
    assert kept.token_ids == out.token_ids and kept.text == through


def test_stop_string_returns_the_text_before_it(engine):
    [ref] = greedy(engine, [PLAIN_PROMPTS[0]], max_tokens=30, ignore_eos=True)
    words = ref.text.split()
    stop = " " + words[4]
    [out] = greedy(engine, [PLAIN_PROMPTS[0]], max_tokens=30, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == ref.text[:ref.text.index(stop)]
    assert stop not in out.text
    # vLLM's include_stop_str_in_output: the text up to the end of the stop string.
    first = " " + words[6]
    [kept] = greedy(engine, [PLAIN_PROMPTS[0]], max_tokens=30, ignore_eos=True, stop=[stop, first],
                    include_stop_str_in_output=True)
    end = min(ref.text.index(stop) + len(stop), ref.text.index(first) + len(first))
    assert kept.finish_reason == "stop" and kept.text == ref.text[:end] and kept.text.endswith(stop)


def test_streamed_text_pieces_join_to_the_full_text_and_never_split_characters(engine):
    prompt = "Répète ces emojis: 🎉🚀🌍 et ces mots: ünïcödé, 東京, Ελληνικά."
    pieces = []
    for out in engine.stream(prompt, SamplingParams(max_tokens=40, ignore_eos=True)):
        pieces.append(out.new_text)
        assert "\ufffd" not in out.new_text
    [whole] = greedy(engine, [prompt], max_tokens=40, ignore_eos=True)
    assert "".join(pieces) == whole.text
    # A character cut by max_tokens is incomplete: it is never sent half-way.
    full = engine.tokenizer.decode(whole.token_ids, skip_special_tokens=True)
    assert "\ufffd" not in whole.text and full.startswith(whole.text)
    assert full == whole.text or full.endswith("\ufffd")


def test_abort_frees_blocks_before_the_next_step(engine):
    rid = engine.add_request("Tell me a long story.", SamplingParams(max_tokens=200, ignore_eos=True))
    other = engine.add_request("Hello", SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used = engine.block_manager.num_used_blocks
    [out] = engine.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert engine.block_manager.num_used_blocks < used
    assert engine.abort(rid) == []
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    assert other not in engine._seqs


@pytest.mark.parametrize("bad, message", [
    (dict(prompt=""), "empty"),
    (dict(prompt=LONG_TEXT * 6), "max_model_len"),
    (dict(prompt="hi", params={"max_tokens": -3}), "max_tokens"),
    (dict(prompt="hi", params={"max_tokens": 4, "nonsense": 1}), "nonsense"),
    (dict(prompt="hi", params={"stop": [""]}), "stop"),
    (dict(prompt="hi", params={"min_tokens": 9, "max_tokens": 2}), "min_tokens"),
    (dict(prompt_token_ids=[1, -5]), "input_ids"),
])
def test_bad_arguments_raise_a_clear_error_and_the_engine_keeps_serving(engine, bad, message):
    rid = engine.add_request("Hello", SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(**bad)
    while engine.has_unfinished():
        engine.step()
    assert rid not in engine._seqs and engine.block_manager.num_used_blocks == 0


def test_prefix_cache_hits_and_gives_identical_outputs(engine, model_dir):
    system = "You are a helpful assistant. " + LONG_TEXT
    prompts = [system + f" Question {i}: what is {i} plus {i}?" for i in range(4)]
    params = SamplingParams(max_tokens=12)
    hits_before = engine.block_manager.prefix_hit_tokens
    with_cache = [o.token_ids for o in engine.generate(prompts, params)]
    with_cache += [o.token_ids for o in engine.generate(prompts, params)]  # second round: all cached
    assert engine.block_manager.prefix_hit_tokens - hits_before > 4 * 300
    # Exact blocks off: a quicker load, the same results bit for bit (test_exact_blocks.py).
    no_cache = Engine(EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=256, enable_prefix_caching=False, warmup=False,
                                                   exact_block_weights=False))
    without = [o.token_ids for o in no_cache.generate(prompts, params)]
    assert with_cache[:4] == without and with_cache[4:] == without
    assert no_cache.block_manager.prefix_hit_tokens == 0


def test_a_prefix_ending_inside_a_block_is_reused_and_outputs_match_transformers(engine, hf_model, tokenizer):
    bs = engine.config.cache.block_size
    shared = tokenizer.encode("A test of prefixes that end inside a KV block. " + LONG_TEXT)[:2 * bs + bs // 2]
    first = shared + tokenizer.encode(" The first question is longer than the others, so that the block it"
                                      " shares with them is full and cached once it has run.")
    assert len(first) > 3 * bs
    engine.generate(prompt_token_ids=[first], params=SamplingParams(max_tokens=1))
    # Admitted together, these can only reuse the first prompt's blocks: 2 whole, then half of one.
    prompts = [shared + tokenizer.encode(f" Question {i}: what is {i} plus {i}?") for i in range(3)]
    outs = engine.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.num_cached_prompt_tokens for o in outs] == [len(shared)] * 3
    for ids, out in zip(prompts, outs):
        assert out.token_ids == transformers_greedy(hf_model, ids, out.token_ids, 8, min_new_tokens=8)[0]


@pytest.fixture(scope="module")
def tiny_pool_workload(engine):
    """The tiny-pool tests' prompts, parameters and reference outputs (from the shared engine, whose pool
    has room for all of them at once)."""
    prompts = [p for p in CHAT_PROMPTS + PLAIN_PROMPTS if len(p) < 200]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    return prompts, params, [o.token_ids for o in engine.generate(prompts, params)]


def test_tiny_pool_preempts_and_still_gives_identical_outputs(tiny_pool_workload, model_dir):
    prompts, params, ref = tiny_pool_workload
    # 20 blocks x 16 tokens = 320 token slots for 14 sequences of 33-47 tokens that need 42 blocks
    # (~570 tokens) together: preemption is forced.
    # Exact blocks off: a quicker load, the same results bit for bit (test_exact_blocks.py).
    tiny = Engine(EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=20, max_model_len=320,
                               enable_prefix_caching=False, warmup=False, exact_block_weights=False))
    got = [o.token_ids for o in tiny.generate([p for p in prompts], params)]
    assert tiny.scheduler.num_preemptions > 0
    assert got == ref
    assert tiny.block_manager.num_used_blocks == 0
    tiny.block_manager.check_invariants()


def test_tiny_pool_holding_back_known_outputs_preempts_nothing_and_gives_identical_outputs(tiny_pool_workload, model_dir):
    prompts, params, ref = tiny_pool_workload
    # The pool of the test above; with their lengths known, sequences wait instead of being preempted.
    tiny = Engine(EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=20, max_model_len=320, reserve_known_growth=True,
                               enable_prefix_caching=False, warmup=False, exact_block_weights=False))
    peak = 0
    seqs = [tiny._seqs[tiny.add_request(p, params)] for p in prompts]
    while tiny.has_unfinished():
        tiny.step()
        peak = max(peak, tiny.block_manager.num_used_blocks)
    assert tiny.scheduler.num_preemptions == 0
    assert [q.output_token_ids for q in seqs] == ref
    assert 15 <= peak <= 20 and tiny.block_manager.num_used_blocks == 0  # the pool was used, never overrun
    tiny.block_manager.check_invariants()


def test_sampling_with_a_seed_is_reproducible(engine):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = greedy(engine, ["Once upon a time"], **params.__dict__)[0].token_ids
    b = greedy(engine, ["Once upon a time"], **params.__dict__)[0].token_ids
    assert a == b and len(a) == 16


def test_kv_window_keeps_a_long_generation_within_the_window(model_dir):
    windowed = Engine(EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=128, kv_window=64, kv_sink_tokens=4,
                                   enable_prefix_caching=False, warmup=False))
    rid = windowed.add_request("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
    seq = windowed._seqs[rid]
    peak = 0
    while windowed.has_unfinished():
        windowed.step()
        if not seq.is_finished:
            peak = max(peak, windowed.block_manager.num_used_blocks)
    # sink block + 64-token window (4 blocks) + the block being written, whatever the length.
    assert peak <= 1 + 64 // 16 + 1
    assert seq.num_output_tokens == 200 and windowed.block_manager.num_used_blocks == 0


def test_extreme_but_valid_sampling_values_do_not_break_a_step(engine):
    # Found by fuzzing through Triton: these once raised inside a step and stopped the engine.
    params = SamplingParams(max_tokens=4, temperature=0.7, seed=10**30, top_k=2**70, ignore_eos=True)
    [out] = engine.generate(["Hello"], params)
    assert len(out.token_ids) == 4
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.add_request("Hello", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**9]))


def test_engine_loop_builds_its_engine_on_the_loop_thread(engine):
    """Serving builds and warms the model on the thread that runs it (one OpenMP pool, see EngineLoop)."""
    import threading

    from tritonllm.engine.engine_loop import EngineLoop

    built_on: list[str] = []

    def make():
        built_on.append(threading.current_thread().name)
        return engine

    loop = EngineLoop.build(make)
    try:
        assert built_on == ["tritonllm-engine"] and loop.engine is engine and loop.alive
    finally:
        loop._stopping.set()  # stop the thread without closing the shared engine
        loop._wake.set()
        loop._thread.join(10)

    def broken():
        raise RuntimeError("no model here")

    with pytest.raises(RuntimeError, match="no model here"):
        EngineLoop.build(broken)


def test_engine_loop_hands_over_each_steps_outputs_at_once(engine):
    """With `deliver_step`, a step's outputs come in one call (one wake-up of a response thread per step,
    not per request), each with its request's callback; an abort's final output still comes alone."""
    import queue

    from tritonllm.core.sampling_params import SamplingParams
    from tritonllm.engine.engine_loop import EngineLoop

    steps: queue.SimpleQueue = queue.SimpleQueue()
    alone: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop.build(lambda: engine, deliver_step=steps.put)
    try:
        callbacks = {name: (lambda out, name=name: alone.put((name, out))) for name in ("a", "b", "c")}
        ids = {name: loop.submit(callbacks[name], f"Count to ten, {name}:",
                                 SamplingParams(max_tokens=8 if name != "c" else 200, ignore_eos=True))
               for name in callbacks}
        by_request: dict[str, list] = {request_id: [] for request_id in ids.values()}
        while not all(outs and outs[-1].finished for request_id, outs in by_request.items() if request_id != ids["c"]):
            batch = steps.get(timeout=60)
            assert batch and len({out.request_id for _, out in batch}) == len(batch)  # one output per request
            for callback, out in batch:
                assert callback is callbacks[next(k for k, v in ids.items() if v == out.request_id)]
                by_request[out.request_id].append(out)
        loop.abort(ids["c"])
        name, last = alone.get(timeout=60)
        assert name == "c" and last.finished and last.finish_reason == "abort"
        assert [sum(len(o.new_token_ids) for o in by_request[ids[k]]) for k in "ab"] == [8, 8]
    finally:
        loop._stopping.set()  # stop the thread without closing the shared engine
        loop._wake.set()
        loop._thread.join(10)
    assert not engine.has_unfinished()
