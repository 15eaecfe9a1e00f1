"""A model's stub process never outlives its tritonserver (backend/serving/orphan_guard.py), and ends cleanly
with it.

Without the guard, `kill -9` of tritonserver left the smollm2 stub running (~3 GB, still using
CPU): its own parent check deadlocked behind a call to the dead server.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from conftest import write_variant_repo
from server_watch import children
from supervised import FAST, needed_by, start_together, stop_together

pytestmark = pytest.mark.server


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:].split()[0] != b"Z"


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _server(tmp_path: Path):
    from tritonserver_harness import TritonServer

    repo = write_variant_repo(tmp_path / "repo", **FAST)  # a quick load: the model is not what this is about
    return TritonServer(repo, log_path=tmp_path / "tritonserver.log",
                        extra_args=["--model-control-mode=explicit", "--load-model=smollm2"])


@pytest.fixture(scope="module")
def _servers(request, tmp_path_factory):
    """A server for each test of this module being run, all started at once (each test ends its own)."""
    servers = [_server(tmp_path_factory.mktemp("orphan-guard")) for _ in range(needed_by(request, "started"))]
    start_together(*servers)
    try:
        yield servers
    finally:
        stop_together(*servers)  # what a failed test left running


@pytest.fixture
def started(_servers, tmp_path):
    """(tritonserver, its smollm2 stub, the stub's orphan guard), a server of its own."""
    server = _servers.pop() if _servers else _server(tmp_path).start()
    try:
        [stub] = children(server.process.pid, "triton_python_backend_stub")
        [guard] = children(stub, "tritonllm.serving.orphan_guard")
        yield server, stub, guard
    finally:
        server.stop()


def test_the_stub_is_ended_when_tritonserver_dies_while_it_waits_on_the_server(started):
    server, stub, guard = started
    try:
        # Frozen first, so the stub's response thread is surely waiting inside a call to the server
        # (its metrics refresh, every 0.5 s) when the server dies: the case where the stub's own exit
        # deadlocks and it would run on, with the model in memory, forever. That call starts within 0.7 s (a refresh
        # is due every 0.5 s, made at the thread's next wake-up, 0.2 s at most); gdb found the thread blocked in
        # Metric::SendSetValueRequest 1 s after the freeze, every time.
        os.kill(server.process.pid, signal.SIGSTOP)
        time.sleep(1)
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)
        left = _wait_gone([stub, guard], timeout=30)  # the guard's grace is 5 s
    finally:
        if _alive(stub):
            os.kill(stub, signal.SIGKILL)  # never leave a 3 GB orphan behind a failed test
    assert not left, f"still running after tritonserver died: {left}"
    assert "is gone; the model's stub process" in server.log_text()


def test_a_normal_stop_ends_the_stub_and_its_guard_cleanly(started):
    server, stub, guard = started
    assert server.stop() == 0
    assert not _wait_gone([stub, guard], timeout=15)
    log = server.log_text()
    assert "orphan guard" not in log
    # The stub writes its stacks on a crash (serving/generate_model.py): with the model's metrics left to Python's
    # exit, tritonserver 2.51's stub crashed there at every stop (metrics.EngineMetrics.close).
    assert "Fatal Python error" not in log, log[log.find("Fatal Python error"):][:2000]
