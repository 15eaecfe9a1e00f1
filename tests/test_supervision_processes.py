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
        kill_if_same(second.pid, None)  # no start time known: killed if alive
        assert second.wait(10) == -9
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
