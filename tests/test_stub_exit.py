"""stub_exit.py: a finished Triton stub ends without the interpreter's teardown; no other process does.

tritonserver counts a model unloaded once its stub process has exited, and waits for it at shutdown;
the teardown it skips is most of a second with torch and an engine loaded (docs/OPERATIONS.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server_watch import stub_pids

pytestmark = pytest.mark.unit


def test_the_servers_stubs_run_the_executable_stub_exit_recognises(triton_server):
    pids = stub_pids(triton_server)
    assert pids, "the session's server has no stub process"
    from tritonllm.serving.stub_exit import STUB_EXECUTABLE

    assert {os.path.basename(os.readlink(f"/proc/{pid}/exe")) for pid in pids} == {STUB_EXECUTABLE}


def test_outside_a_stub_nothing_changes_at_exit():
    # A handler registered before, and the process's own exit status, both survive: the fast exit is not
    # installed in a process that is not a stub.
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('earlier handler ran', flush=True))\n"
            "from tritonllm.serving import stub_exit\n"
            "stub_exit.skip_interpreter_teardown()\n"
            "assert not stub_exit.in_triton_stub()\n"
            "sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert "earlier handler ran" in done.stdout
