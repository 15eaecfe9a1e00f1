"""Chaos under `tritonllm-serve` (what `bash scripts/serve.sh` runs): real tritonservers, real tritonclient streams.

A model's stub process killed mid-stream, a burst cut by a kill, a tensor-parallel worker killed
mid-stream, a model whose reload keeps failing, and shutdowns (SIGTERM drain, SIGINT with a dead stub).
First, with nothing killed: requests' errors on streams, each the way its client asked for them.
Each checks what the supervisor promises (docs/OPERATIONS.md): the death is seen within 5 s; every
request in flight gets exactly one terminal event, an error naming the death, within 10 s; readiness
is false until the model is back; the model is reloaded by itself; minilm, beside it, is untouched.

The servers run smollm2 with a quick-loading configuration (supervised.FAST): these tests reload it
on purpose, and a reload is a full model load.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from prompts import CHAT_PROMPTS, PLAIN_PROMPTS
from supervised import (FAST, EmbeddingTraffic, StreamProbe, Supervised, embed, generate_inputs, get, make_repository,
                        needed_by, start_together, stop_together, vector_ok, wait_streaming)

pytestmark = pytest.mark.server

PROMPTS = PLAIN_PROMPTS[:4] + CHAT_PROMPTS[:4]
TERMINAL_S = 10.0  # each request in flight ends within this long of the death
DETECT_S = 5.0  # readiness turns false within this long
BACK_S = 300.0  # generous: a reload is a model load, and this machine is shared
DRAIN_EXIT_TIMEOUT_S = 8  # the drain test's --exit-timeout-secs (see that test)


def _served(root):
    # Back-offs of 0.25 s, doubling to a cap of 0.5 s: the doubling itself is not what these tests are about, and
    # the failing-load test's restarts 3 and 4 would otherwise wait 1 s and 2 s. With the cap, a restart tried past
    # the limit would come within about half a second, well inside that test's wait for "nothing more is tried".
    return Supervised(make_repository(root / "repo", **FAST), root / "serve.log",
                      "--max-restarts", "4", "--restart-backoff", "0.25", "--restart-backoff-max", "0.5")


def _tp_served(root):
    return Supervised(make_repository(root / "repo", with_minilm=False, tensor_parallel_size=2, **FAST),
                      root / "serve.log", "--restart-backoff", "0.25")


def _drain_server(root):
    # A context long enough for the drain test's long request (8000 tokens).
    long_context = {**FAST, "max_model_len": 8192, "num_kv_blocks": 600}
    return Supervised(make_repository(root / "repo", with_minilm=False, **long_context), root / "serve.log",
                      f"--exit-timeout-secs={DRAIN_EXIT_TIMEOUT_S}")


_SERVERS = {"served": _served, "tp_served": _tp_served, "drain_server": _drain_server}


@pytest.mark.unit
def test_a_companion_that_dies_is_started_again_at_once_then_after_a_doubling_backoff(caplog):
    """The OpenAI server beside tritonserver (serving/supervision/companion.py), as a real process."""
    import subprocess
    import sys

    from tritonllm.serving.supervision.companion import Companion

    companion = Companion("sleeper", lambda: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]),
                          backoff_max_s=4)
    assert [companion.backoff(n) for n in range(7)] == [0, 0, 1, 2, 4, 4, 4]  # n: quick deaths in a row

    async def kill_and_wait(restarts: int):
        killed = companion.process
        killed.kill()
        deadline = time.monotonic() + 30
        while companion.restarts < restarts:
            assert time.monotonic() < deadline, "not started again"
            await asyncio.sleep(0.05)
        assert companion.process.pid != killed.pid and companion.process.poll() is None

    async def run():
        companion.run()
        try:
            with caplog.at_level("ERROR", logger="tritonllm.serving.supervision.companion"):
                await kill_and_wait(1)
                await kill_and_wait(2)
        finally:
            last = companion.process
            await companion.stop()
        assert last.poll() is not None

    asyncio.run(run())
    first, second = [r.getMessage() for r in caplog.records if "starting it again" in r.getMessage()]
    assert "killed by SIGKILL" in first and first.endswith("starting it again"), first  # at once
    assert second.endswith("starting it again in 1 s"), second  # died within a minute again


@pytest.fixture(scope="module")
def _servers(request, tmp_path_factory):
    """This module's servers that the tests being run need, all started at once: a load is mostly one core's work
    (imports, the tokenizer, the weights), and a server waiting for its tests uses ~2 % of one. The tests that end
    a server (SIGINT, SIGTERM) end their own; the rest are stopped here."""
    servers = {name: make(tmp_path_factory.mktemp(name)) for name, make in _SERVERS.items() if needed_by(request, name)}
    start_together(*servers.values())
    try:
        yield servers
    finally:
        stop_together(*servers.values())


def _server(servers: dict, name: str, tmp_path_factory) -> Supervised:
    if name not in servers:  # a test this module's fixture did not foresee: its server is started now
        servers[name] = _SERVERS[name](tmp_path_factory.mktemp(name)).start()
    return servers[name]


@pytest.fixture(scope="module")
def served(_servers, tmp_path_factory):
    return _server(_servers, "served", tmp_path_factory)


def _wait_running(server, n: int, timeout: float = 60) -> None:
    """Until the engine holds `n` requests (the gauges refresh twice a second)."""
    deadline = time.monotonic() + timeout
    while server.metric("llm_requests", model="smollm2", state="running") < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests running"
        time.sleep(0.1)


def _assert_not_ready_within(server, started: float) -> None:
    while server.ready("smollm2") or server.ready():
        assert time.monotonic() - started < DETECT_S, "still ready after the death"
        time.sleep(0.05)


def _assert_one_terminal(probes: list[StreamProbe]) -> None:
    bad = {p.request_id: (p.finals, p.errors, p.late) for p in probes if p.finals + len(p.errors) != 1 or p.late}
    assert not bad, f"not exactly one FINAL or error (finals, errors, late events): {bad}"


def _serves(server, max_tokens: int = 4) -> None:
    p = StreamProbe(server.grpc_url, "check", generate_inputs("The capital of France is", max_tokens))
    try:
        assert p.done.wait(120), "no answer"
        assert p.error is None and p.finals == 1 and p.responses >= 1, p.errors
    finally:
        p.close()


def _stream_error(url: str, sampling: dict, headers: dict | None = None, parameters: dict | None = None,
                  clients: int = 1, each: int = 1) -> list[str]:
    """`clients` tritonclient streams at once, each sending `each` requests one after another: per request,
    "status CODE: details" (the stream ended with an error status), "in stream: message" or "final"."""
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))

    async def one(client) -> str:
        ended = asyncio.Event()

        async def requests():
            yield {"model_name": "smollm2", "inputs": [text, params], "parameters": parameters}
            await ended.wait()

        try:
            async for result, error in client.stream_infer(requests(), headers=headers):
                if error is not None:
                    return f"in stream: {error.message()}"
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return "final"
            return "ended without a final response"
        except grpc.aio.AioRpcError as exc:
            return f"status {exc.code().name}: {exc.details()}"
        finally:
            ended.set()

    async def run() -> list[str]:
        async with grpcaio.InferenceServerClient(url) as client:
            async def serial() -> list[str]:
                return [await asyncio.wait_for(one(client), 60) for _ in range(each)]
            return [o for outcomes in await asyncio.gather(*(serial() for _ in range(clients))) for o in outcomes]

    return asyncio.run(run())


def test_request_errors_on_streams_come_as_each_client_asked_and_many_crash_nothing(served):
    server = served.server_pid()
    bad = {"temperature": 500}
    why = "temperature must be a number in [0.0, 100.0], got 500.0"
    assert _stream_error(served.grpc_url, bad) == [f"in stream: {why}"]  # Triton's default
    assert _stream_error(served.grpc_url, bad, parameters={"error_kind_in_message": True}) == [
        f"in stream: [invalid_argument] {why}"]
    # triton_grpc_error: the front ends the stream with the error's status itself (tritonserver 2.51 crashes on
    # that header when such streams end at once), here 16 streams at once, 12 errors each, as a burst of bad
    # requests would; a request without error is answered as usual.
    assert _stream_error(served.grpc_url, bad, {"triton_grpc_error": "true"}, clients=16, each=12) == [
        f"status INVALID_ARGUMENT: {why}"] * 192
    assert _stream_error(served.grpc_url, {"max_tokens": 2}, {"triton_grpc_error": "true"}) == ["final"]
    assert served.server_pid() == server and "Signal (" not in served.log_text()


def test_a_killed_stub_ends_its_requests_at_once_and_the_model_comes_back(served):
    (stub,) = served.stubs("smollm2")
    minilm = served.stubs("minilm")
    restarts = served.metric("llm_model_restarts_total", model="smollm2")
    bystander = EmbeddingTraffic(served.http)
    probes = [StreamProbe(served.grpc_url, f"stream{i}", generate_inputs(PLAIN_PROMPTS[i], 2000)) for i in range(2)]
    probes.append(StreamProbe(served.grpc_url, "whole", generate_inputs(PLAIN_PROMPTS[2], 2000, stream=False)))
    try:
        wait_streaming(probes[:2])
        _wait_running(served, 3)
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        for p in probes:
            assert p.done.wait(TERMINAL_S + 5), f"{p.request_id}: no error after the stub died"
        _assert_one_terminal(probes)
        for p in probes:
            assert p.ended_at - killed < TERMINAL_S, p.ended_at - killed
            assert "unavailable" in p.error and f"stub process (pid {stub}" in p.error and "SIGKILL" in p.error, p.error
        _assert_not_ready_within(served, killed)
        status, body = get(served.http + "/v2/models/smollm2/ready")
        assert status == 503 and "died" in body, (status, body)
        # The gauge the dead stub set stays at 1 in tritonserver; the front reports the truth.
        assert served.metric("llm_engine_alive", model="smollm2") == 0
        assert served.metric("llm_model_ready", model="smollm2") == 0
        refused = StreamProbe(served.grpc_url, "meanwhile", generate_inputs("Hello", 4))
        assert refused.done.wait(10) and refused.error and "unavailable" in refused.error, refused.errors
        refused.close()
        took = served.wait_ready("smollm2", BACK_S)
        assert served.ready()
        _serves(served)
        assert all(p.close() for p in probes), "a stream did not close after its error"
    finally:
        outcomes = bystander.stop()
        for p in probes:
            p.close(timeout=1)
    print(f"smollm2 back {took:.1f} s after the kill")
    assert served.metric("llm_model_restarts_total", model="smollm2") == restarts + 1, served.story()
    assert served.metric("llm_model_ready", model="smollm2") == 1
    assert "killed by SIGKILL" in served.log_text() and "serves again" in served.log_text()
    # minilm, beside it: the same stub, every request answered.
    assert served.stubs("minilm") == minilm, "minilm's stub changed: " + "\n".join(
        line for line in served.log_text().splitlines() if "minilm" in line or "tritonllm-serve" in line)[-4000:]
    assert outcomes and all(status == 200 and vector_ok(body) for status, body in outcomes), \
        [o for o in outcomes if o[0] != 200][:3]


def test_kill_and_restart_during_a_burst(served):
    (stub,) = served.stubs("smollm2")
    lengths = [16, 48, 400, 2000]
    probes = [StreamProbe(served.grpc_url, f"burst{i}", generate_inputs(f"{PROMPTS[i % len(PROMPTS)]} ({i})",
                                                                         lengths[i % 4], stream=i % 4 != 3))
              for i in range(16)]
    try:
        _wait_running(served, 8)
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        for p in probes:
            assert p.done.wait(TERMINAL_S + 5), f"{p.request_id} hung after the kill"
        _assert_one_terminal(probes)
        failed = [p for p in probes if p.errors]
        assert len(failed) >= 4, "the kill cut too few requests to mean anything"
        for p in failed:
            assert p.ended_at - killed < TERMINAL_S and "stub process" in p.error, (p.ended_at - killed, p.error)
        assert all(p.ended_at < killed + 1 for p in probes if p.finals)  # finished before the kill, not after
        _assert_not_ready_within(served, killed)
        served.wait_ready("smollm2", BACK_S)
    finally:
        for p in probes:
            p.close(timeout=2)
    again = [StreamProbe(served.grpc_url, f"again{i}", generate_inputs(PROMPTS[i], 16, stream=bool(i % 2)))
             for i in range(8)]
    try:
        for p in again:
            assert p.done.wait(180), f"{p.request_id}: no answer after the restart"
        _assert_one_terminal(again)
        assert all(p.error is None for p in again), [p.error for p in again]
    finally:
        for p in again:
            p.close()


def test_a_model_that_keeps_failing_to_load_is_marked_failed_with_the_reason(served):
    config = served.repository / "smollm2" / "config.pbtxt"
    original = config.read_text()
    broken, found = re.subn(r'key: "max_num_seqs", value: \{ string_value: "[^"]*"', 'key: "max_num_seqs", value: '
                            '{ string_value: "many"', original)
    assert found == 1
    config.write_text(broken)
    try:
        (stub,) = served.stubs("smollm2")
        os.kill(stub, signal.SIGKILL)
        deadline = time.monotonic() + BACK_S
        while served.metric("llm_model_failed", model="smollm2") != 1:
            assert time.monotonic() < deadline, "never marked failed:\n" + served.log_text()[-3000:]
            time.sleep(0.1)
        status, body = get(served.http + "/v2/models/smollm2/ready")
        assert status == 503 and "has failed" in body and "max_num_seqs" in body, body
        assert get(served.http + "/v2/health/ready")[0] == 503
        assert "not restarted again" in served.log_text()
        restarts = served.metric("llm_model_restarts_total", model="smollm2")
        time.sleep(1.5)  # nothing more is tried
        assert served.metric("llm_model_restarts_total", model="smollm2") == restarts
        assert embed(served.http)[0] == 200  # minilm serves on
    finally:
        config.write_text(original)
    # An operator's load through the repository API starts it afresh.
    status, body = get(served.http + "/v2/repository/models/smollm2/load", "POST", b"{}", timeout=BACK_S)
    assert status == 200, body
    assert served.ready("smollm2") and served.ready()
    assert served.metric("llm_model_failed", model="smollm2") == 0
    _serves(served)


def test_sigint_with_a_dead_stub_exits_0_without_hanging(served):
    # Runs last in this module: it ends the server. The dead stub's version never finishes unloading
    # in tritonserver, which on its own would hang at exit.
    (stub,) = served.stubs("smollm2")
    server_pid = served.server_pid()
    probe = StreamProbe(served.grpc_url, "last", generate_inputs(PLAIN_PROMPTS[0], 2000))
    wait_streaming([probe])
    os.kill(stub, signal.SIGKILL)
    assert probe.done.wait(TERMINAL_S) and probe.error, probe.errors
    served.signal(signal.SIGINT)
    started = time.monotonic()
    assert served.wait(60) == 0
    print(f"exited {time.monotonic() - started:.1f} s after SIGINT")
    # Not after tritonserver's exit timeout: once the living stubs had ended, only the dead one's version was left.
    assert "waits only on the version(s) whose stub died: stopping it now" in served.log_text()
    assert probe.close(timeout=5)
    deadline = time.monotonic() + 15  # the orphan guards end stubs a killed tritonserver leaves
    while os.path.exists(f"/proc/{server_pid}") or served_stubs_alive(served):
        assert time.monotonic() < deadline, (f"tritonserver (alive: {os.path.exists(f'/proc/{server_pid}')}) or a "
                                             f"stub outlived tritonllm-serve:\n{served.story()}")
        time.sleep(0.2)


def served_stubs_alive(served) -> bool:
    folder = str(served.repository.resolve())
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if len(argv) > 1 and argv[0].endswith(b"triton_python_backend_stub") and argv[1].decode().startswith(folder):
                return True
    return False


# ---- a tensor-parallel worker ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_served(_servers, tmp_path_factory):
    return _server(_servers, "tp_served", tmp_path_factory)


def test_a_killed_tensor_parallel_worker_fails_its_requests_and_the_model_comes_back(tp_served):
    (worker,) = tp_served.tp_workers()
    probes = [StreamProbe(tp_served.grpc_url, f"tp{i}", generate_inputs(PLAIN_PROMPTS[i], 2000)) for i in range(2)]
    try:
        wait_streaming(probes)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        for p in probes:
            assert p.done.wait(TERMINAL_S + 5), f"{p.request_id} hung after the worker died"
        _assert_one_terminal(probes)
        for p in probes:
            assert p.ended_at - killed < TERMINAL_S and "worker rank 1" in p.error, (p.ended_at - killed, p.error)
        _assert_not_ready_within(tp_served, killed)
        took = tp_served.wait_ready("smollm2", BACK_S)
        _serves(tp_served)
        assert all(p.close() for p in probes)
    finally:
        for p in probes:
            p.close(timeout=1)
    print(f"smollm2 (2 ranks) back {took:.1f} s after the worker was killed")
    assert len(tp_served.tp_workers()) == 1 and tp_served.tp_workers() != [worker]
    log = tp_served.log_text()
    assert "worker rank 1" in log and "engine died" in log and "serves again" in log
    assert tp_served.metric("llm_model_restarts_total", model="smollm2") == 1


# ---- drain -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drain_server(_servers, tmp_path_factory):
    return _server(_servers, "drain_server", tmp_path_factory)


def test_sigterm_lets_requests_finish_refuses_new_ones_and_exits_0(drain_server):
    # The short request has time to finish even at a token a second (a loaded 2-core machine); the long one
    # cannot, even at a few hundred tokens a second (an idle one). (With 5 s and 5 tokens the short one once
    # did not finish in time on a loaded machine.)
    exit_timeout = DRAIN_EXIT_TIMEOUT_S
    server = drain_server
    short = long = None
    try:
        # First, 20 streams each closed the moment its final response is in, as most clients do: none may keep
        # the model from unloading at the end (the front half-closes them upstream, never cancels them).
        quick = [StreamProbe(server.grpc_url, f"quick{i}", generate_inputs("Hello", 4)) for i in range(20)]
        closers = [threading.Thread(target=lambda p=p: p.done.wait(60) and p.close(timeout=10)) for p in quick]
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout=90)
        assert all(p.finals == 1 and p.error is None for p in quick), [p.errors for p in quick if p.errors]
        short = StreamProbe(server.grpc_url, "short", generate_inputs(PLAIN_PROMPTS[0], 6))
        long = StreamProbe(server.grpc_url, "long", generate_inputs(PLAIN_PROMPTS[1], 8000))
        wait_streaming([short, long])
        server.signal(signal.SIGTERM)
        started = time.monotonic()
        deadline = started + 5
        while get(server.http + "/v2/health/ready", timeout=2)[0] != 503:
            assert time.monotonic() < deadline, "still ready while draining"
            time.sleep(0.05)
        refused = StreamProbe(server.grpc_url, "late", generate_inputs("Hello", 4))
        assert refused.done.wait(10) and refused.error and "shutting down" in refused.error, refused.errors
        assert short.done.wait(exit_timeout) and short.error is None and short.finals == 1, short.errors
        assert short.close(timeout=5)  # as a client does after the final response, before the server is gone
        assert long.done.wait(exit_timeout + 10), "the long request was not ended at the exit timeout"
        assert long.error and "exit timeout" in long.error, long.error
        assert exit_timeout - 1 <= long.ended_at - started < exit_timeout + 10
        assert long.close(timeout=5)
        assert server.wait(60) == 0
        _assert_one_terminal([short, long])
        log = server.log_text()
        assert "successfully unloaded 'smollm2'" in log and "Exit timeout expired" not in log, log[-3000:]
    finally:
        if server.process.poll() is None:
            server.kill()
