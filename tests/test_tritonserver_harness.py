"""tritonserver_harness.py's `TritonServer.stop`: a clean exit is waited for, a crash while shutting down
(whose signal handler can hang) is ended at once instead of at the deadline; `stop_later` signals once
and returns, and `wait_for_stopped` waits for those servers."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import tritonserver_harness
from tritonserver_harness import TritonServer

pytestmark = pytest.mark.unit

# Stands in for tritonserver's shutdown: on SIGTERM it writes `lines` to its log, then exits with
# `code`, or (code None) hangs as a handler stuck after a crash does.
FAKE = """
import signal, sys, time
lines, code = sys.argv[1].split("|"), sys.argv[2]
def term(*_):
    for line in lines:
        print(line, flush=True)
        time.sleep(0.2)
    if code != "hang":
        sys.exit(int(code))
    while True:
        time.sleep(1)
signal.signal(signal.SIGTERM, term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _fake_server(tmp_path, lines: list[str], code: str) -> TritonServer:
    server = TritonServer(tmp_path, log_path=tmp_path / "tritonserver.log")
    # Append mode: the test's own lines (a crash's, written before the stop) stay where they are; a plain
    # write would let the fake's next line, at its own offset, overwrite them.
    with open(server.log_path, "ab") as log:
        server.process = subprocess.Popen([sys.executable, "-c", FAKE, "|".join(lines), code], stdout=log,
                                          stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while "ready" not in server.log_text():
        assert time.monotonic() < deadline and server.process.poll() is None, server.log_text()
        time.sleep(0.05)
    return server


def test_a_clean_shutdown_is_waited_for(tmp_path):
    server = _fake_server(tmp_path, ["Signal (15) received.", "unloading models"] * 5, "0")
    assert server.stop(timeout=30) == 0  # two seconds of lines, then its own exit


def test_a_crash_while_shutting_down_is_killed_at_once_not_at_the_deadline(tmp_path):
    server = _fake_server(tmp_path, ["Signal (15) received.", "malloc_consolidate(): unaligned fastbin chunk "
                                     "detected", "Signal (6) received."], "hang")
    started = time.monotonic()
    assert server.stop(timeout=60) == -9
    assert time.monotonic() - started < 15


def test_a_server_that_never_exits_is_killed_at_the_deadline(tmp_path):
    server = _fake_server(tmp_path, ["Signal (15) received."], "hang")
    started = time.monotonic()
    assert server.stop(timeout=2) == -9
    assert 2 <= time.monotonic() - started < 15


def test_a_server_that_crashed_before_the_stop_is_killed_at_once(tmp_path):
    server = _fake_server(tmp_path, ["still here"], "hang")
    with open(server.log_path, "a") as log:  # as a crash mid-test leaves it: the handler's line, then a hang
        log.write("Signal (11) received.\n")
    started = time.monotonic()
    assert server.stop(timeout=60) == -9
    assert time.monotonic() - started < 15


def test_stop_later_signals_once_returns_at_once_and_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(tritonserver_harness, "_stopping", [])
    server = _fake_server(tmp_path, ["Signal (15) received.", "unloading models"] * 5, "0")
    started = time.monotonic()
    server.stop_later()
    assert time.monotonic() - started < 0.5 and server.process.poll() is None
    # A second SIGTERM would cut the fake's unload short (as it does tritonserver's): stop() must not send one.
    assert server.stop(timeout=30) == 0
    assert server.log_text().count("unloading models") == 5
    tritonserver_harness.wait_for_stopped()
    assert tritonserver_harness._stopping == []


def test_at_most_a_few_servers_are_left_stopping(tmp_path, monkeypatch):
    monkeypatch.setattr(tritonserver_harness, "_stopping", [])
    servers = []
    for i in range(tritonserver_harness._MAX_STOPPING + 1):
        folder = tmp_path / str(i)
        folder.mkdir()
        servers.append(_fake_server(folder, ["Signal (15) received."], "0"))
        servers[-1].stop_later()
    assert servers[0].process.poll() == 0  # waited for, to make room
    assert len(tritonserver_harness._stopping) == tritonserver_harness._MAX_STOPPING
    tritonserver_harness.wait_for_stopped()
    assert all(s.process.returncode == 0 for s in servers)
