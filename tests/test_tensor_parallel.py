"""Tensor parallelism on CPU: two ranks give the same greedy ids as one; a dead worker fails loudly.

Offline through the Engine, and end to end through a real tritonserver whose smollm2 runs with
tensor_parallel_size=2 (rank 0 in Triton's stub process, rank 1 in a worker process).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from grpc_stream import StreamClient, make_inputs, metric, scrape
from prompts import PLAIN_PROMPTS

pytestmark = pytest.mark.engine

GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


def worker_pids(ancestor: int) -> list[int]:
    """Tensor-parallel worker processes descended from `ancestor` (from /proc)."""
    parents = {}
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
        if "tritonllm.runner.tp_worker" in cmdline:
            workers.append(int(entry.name))

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == ancestor:
                return True
        return False

    return [pid for pid in workers if descends(pid)]


@pytest.fixture(scope="module")
def tp_engine(model_dir):
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    # No warm-up (a throw-away step at load: no result changes); exact blocks on, as by default, so that the
    # ranks' greedy ids are compared with both ranks reading their shards' exact blocks.
    eng = Engine(EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=512, max_num_seqs=16, tensor_parallel_size=2,
                                              warmup=False))
    yield eng
    eng.close()


def test_two_ranks_give_the_same_greedy_ids_as_one(engine, tp_engine):
    prompts = PLAIN_PROMPTS[:6]
    expected = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    got = [o.token_ids for o in tp_engine.generate(prompts, GREEDY)]  # continuously batched
    assert got == expected
    assert tp_engine.runner.model.num_kv_heads == 2  # 3 KV heads split 2 + 1
    assert tp_engine.runner.tp.local_all_reduce is not None  # the CPU kernels' shared-memory all-reduce
    assert not tp_engine.has_unfinished() and tp_engine.block_manager.num_used_blocks == 0


def test_two_ranks_copy_a_partly_matched_prefix_block_on_every_rank(engine, tp_engine):
    tok, bs = engine.tokenizer, engine.config.cache.block_size
    shared = tok.encode(" ".join(PLAIN_PROMPTS))[:bs + bs // 2]
    first = shared + tok.encode(" " + PLAIN_PROMPTS[0])[:2 * bs]
    tp_engine.generate(prompt_token_ids=[first], params={"max_tokens": 1})
    prompts = [shared + tok.encode(f" Then tell me about the number {i}.") for i in range(3)]
    got = tp_engine.generate(prompt_token_ids=prompts, params=GREEDY)
    assert [o.num_cached_prompt_tokens for o in got] == [len(shared)] * 3  # one whole block and half of one
    expected = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, params=GREEDY)]
    assert [o.token_ids for o in got] == expected


def test_two_ranks_with_a_float16_kv_cache_and_no_kernels_give_the_same_greedy_ids_as_one(model_dir, capfd):
    # Each worker allocates its own pool: it must use the configured KV dtype too, not the model's
    # (short greedy outputs do not tell them apart, so the worker's own report is checked as well).
    # Without the CPU kernels the ranks sum through gloo, the fallback of the shared-memory all-reduce.
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    # Exact blocks off on both (the KV dtype is what is tested here; tp_engine's tests read them): a quicker load.
    prompts = PLAIN_PROMPTS[:3]
    params = dict(model=str(model_dir), num_kv_blocks=128, kv_cache_dtype="float16", warmup=False,
                  exact_block_weights=False, cpu_kernels=False)
    one = Engine(EngineConfig.from_parameters(**params))
    expected = [o.token_ids for o in one.generate(prompts, GREEDY)]
    two = Engine(EngineConfig.from_parameters(**params, tensor_parallel_size=2))
    try:
        assert two.runner.tp.local_all_reduce is None
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == expected
    finally:
        two.close()
    err = capfd.readouterr().err
    assert "rank 1 ready: 1 KV heads, 128 blocks of float16" in err
    assert "all_reduce=gloo (cpu_kernels=false)" in err


def test_a_shard_count_the_model_cannot_take_is_refused(model_dir):
    from tritonllm.core.config import EngineConfig
    from tritonllm.core.parameters import ConfigError
    from tritonllm.engine.engine import Engine

    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        Engine(EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=64, tensor_parallel_size=4, warmup=False))
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig.from_parameters(tensor_parallel_size=0)


def test_a_worker_dying_mid_stream_fails_the_requests_and_the_engine(model_dir):
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine
    from tritonllm.engine.engine_loop import EngineDeadError, EngineLoop

    eng = Engine(EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=256, max_num_seqs=8, tensor_parallel_size=2,
                              warmup=False, exact_block_weights=False))  # a quick load: it only has to stream
    loop = EngineLoop(eng)
    try:
        outputs: dict[str, list] = {}
        done: dict[str, threading.Event] = {}

        def submit(prompt: str) -> str:
            box: list = []
            event = threading.Event()

            def callback(out):
                box.append(out)
                if out.finished:
                    event.set()
            rid = loop.submit(callback, prompt, {"max_tokens": 2000, "ignore_eos": True})
            outputs[rid], done[rid] = box, event
            return rid

        ids = [submit(p) for p in PLAIN_PROMPTS[:3]]
        deadline = time.monotonic() + 60
        while not all(outputs[r] for r in ids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(outputs[r] for r in ids), "no tokens before the kill"
        (worker,) = eng.runner.workers.pids
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        for rid in ids:
            assert done[rid].wait(10), f"{rid} hung after the worker died"
            last = outputs[rid][-1]
            assert last.error and "worker rank 1" in last.error, last.error
        assert time.monotonic() - killed < 10
        assert not loop.alive
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            loop.submit(lambda out: None, "hello", {"max_tokens": 4})
    finally:
        loop.shutdown(timeout_s=10)
    assert eng.runner.workers is None  # shut down: nothing left running


@pytest.fixture(scope="module")
def tp_server(variant_server):
    # No warm-up, no exact blocks: a quicker load, the same results (tp_engine's tests cover two ranks reading
    # exact blocks; the offline reference reads them, so the served ids also show they change nothing).
    return variant_server("tp2", tensor_parallel_size=2, num_kv_blocks=512, max_num_seqs=16, warmup="false",
                          exact_block_weights="false")


def test_served_with_two_ranks_the_streams_equal_one_rank_offline(engine, tp_server):
    prompts = PLAIN_PROMPTS[:4]
    expected = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    client = StreamClient(tp_server.grpc_url)
    try:
        for i, prompt in enumerate(prompts):
            client.send(f"r{i}", make_inputs(prompt, sampling=GREEDY, exclude_input=True))
        results = client.wait(timeout=120)
    finally:
        client.close()
    assert [results[f"r{i}"].ids for i in range(len(prompts))] == expected
    assert all(results[f"r{i}"].error is None for i in range(len(prompts)))


def test_served_worker_death_errors_in_flight_and_new_requests(tp_server):
    (worker,) = worker_pids(tp_server.process.pid)
    client = StreamClient(tp_server.grpc_url)
    try:
        client.send("long", make_inputs(PLAIN_PROMPTS[0], sampling={"max_tokens": 2000, "ignore_eos": True}))
        deadline = time.monotonic() + 60
        while not client.results["long"].num_responses and time.monotonic() < deadline:
            try:
                client._apply(*client.events.get(timeout=1))
            except Exception:  # noqa: BLE001 - queue.Empty: keep waiting until the deadline
                pass
        assert client.results["long"].num_responses, "no tokens before the kill"
        os.kill(worker, signal.SIGKILL)
        result = client.wait(["long"], timeout=30)["long"]
        assert result.error and "worker rank 1" in result.error, result.error
        # Refused while the engine is dead, then unknown to tritonserver once the model has unloaded itself.
        client.send("after", make_inputs("hello", sampling={"max_tokens": 4}))
        after = client.wait(["after"], timeout=30)["after"]
        assert after.error, "a request to the dead engine was answered"
        # The model unloads itself (engine_health.py): not ready, instead of READY and refusing everything.
        deadline = time.monotonic() + 10
        while tp_server.is_model_ready("smollm2"):
            assert time.monotonic() < deadline, "the model with a dead engine still reports ready"
            time.sleep(0.1)
        # Its gauge says so too until the unload ends (then the family goes with the model).
        assert metric(scrape(tp_server.metrics_url), "llm_engine_alive", model="smollm2") == 0
    finally:
        client.close()


def test_a_worker_that_cannot_load_fails_the_engine_start_with_its_reason(model_dir, monkeypatch):
    import dataclasses

    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine
    from tritonllm.runner.tp_workers import TensorParallelError, WorkerSpec
    from tritonllm.runner import model_runner

    def spec_without_weights(*args):
        return dataclasses.replace(WorkerSpec(*args), model_dir="/nonexistent/model")

    monkeypatch.setattr(model_runner, "WorkerSpec", spec_without_weights)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 failed to load: .*nonexistent"):
        Engine(EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=64, tensor_parallel_size=2, warmup=False,
                                            exact_block_weights=False))
    assert time.monotonic() - started < 300  # well under the workers' 600 s start-up limit: no hang
