"""The supervisor's view of tritonserver's children: found while still theirs, killed only if still the same."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tritonllm.serving.supervision.processes import children_of, kill_if_same

pytestmark = pytest.mark.unit


def test_children_of_names_each_living_child_with_its_start_time_and_kill_if_same_kills_only_that_process():
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        found = children_of(os.getpid())
        assert {p.pid for p in sleepers} <= set(found)
        first, second = sleepers
        kill_if_same(second.pid, "1")  # a start time of another process that had this pid: left alone
        kill_if_same(first.pid, found[first.pid])
        assert first.wait(10) == -9
        time.sleep(0.2)
        assert second.poll() is None
        assert first.pid not in children_of(os.getpid())  # exited (a zombie until reaped, then gone)
        kill_if_same(first.pid, found[first.pid])  # gone: nothing to do, no error
        kill_if_same(second.pid, None)  # no start time known: killed only if it is a Triton stub, which it is not
        time.sleep(0.2)
        assert second.poll() is None
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
    stub = subprocess.Popen(["bash", "-c", "exec -a /opt/tritonserver/backends/python/triton_python_backend_stub sleep 60"])
    try:
        deadline = time.monotonic() + 10
        while not open(f"/proc/{stub.pid}/cmdline", "rb").read().startswith(b"/opt/"):  # until bash has exec'd
            assert time.monotonic() < deadline
            time.sleep(0.01)
        kill_if_same(stub.pid, None)
        assert stub.wait(10) == -9
    finally:
        stub.kill()
        stub.wait()
