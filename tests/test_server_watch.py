"""server_watch.py: what the suite reports when a shared tritonserver stops answering mid-run."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from conftest import write_variant_repo
from server_watch import diagnose, stub_pids

pytestmark = pytest.mark.server


def test_a_frozen_stub_is_found_out_with_its_threads_stacks(tmp_path):
    """A stub frozen with SIGSTOP stands in for one stuck for good. (Its own server: tritonserver itself
    aborts on a lock timeout once a stub that froze mid-exchange goes on.)"""
    from tritonserver_harness import TritonServer

    from supervised import FAST  # the model's speed is not what this is about

    repo = write_variant_repo(tmp_path / "repo", **FAST)
    server = TritonServer(repo, log_path=tmp_path / "tritonserver.log",
                          extra_args=["--model-control-mode=explicit", "--load-model=smollm2"]).start()
    try:
        assert diagnose(server) is None
        (pid,) = stub_pids(server)
        os.kill(pid, signal.SIGSTOP)
        try:
            finding = diagnose(server, timeout=0.5)  # frozen: no answer comes, however long
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        # Its exit would wait on the thawed stub (a 2 s wait ended in a kill every time): not what this test is about.
        server.stop(timeout=0.5)
    assert finding is not None and finding.startswith("a one-token request got"), finding
    assert "the server log's last lines" in finding and f"stub {pid}, Python threads" in finding
    assert f"stub {pid} is stopped" in finding, finding  # said at once, not after waiting for a dump
    if shutil.which("gdb"):
        assert f"stub {pid}, native threads" in finding and "Thread 1 " in finding, finding
