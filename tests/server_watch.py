"""Test helper: tell whether a tritonserver that a test failed against still serves, and if not, why.

A server shared by many tests (the session's `triton_server`) that stops answering would otherwise
make every later test wait out its own timeouts, minutes each, and the run would end at the CI's
time limit with no word of the cause. `diagnose` finds it out once, right after the failing test:
one short request, then, where it gets no answer, what the model's stub process is doing: every
Python thread's stack (the stub dumps them into the server log on SIGUSR1, serving/generate_model.py) and
every native thread's top frames from gdb where the machine has it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from grpc_stream import StreamClient, make_inputs

def answers(server, timeout: float = 60.0) -> str | None:
    """None when a one-token greedy request gets its final response within `timeout`, else why not."""
    client = None
    try:
        client = StreamClient(server.grpc_url)
        client.send("watch", make_inputs("Hello", sampling={"max_tokens": 1, "temperature": 0}))
        result = client.wait(["watch"], timeout=timeout)["watch"]
        return None if result.error is None else f"a one-token request got an error: {result.error}"
    except Exception as exc:  # noqa: BLE001 - any failure to be answered is the finding
        return f"a one-token request got no answer: {type(exc).__name__}: {exc}"
    finally:
        if client is not None:
            try:
                client.close(cancel=True)
            except Exception:  # noqa: BLE001 - a stuck server may not take the close either
                pass


def children(pid: int, marker: str) -> list[int]:
    """Live processes whose parent is `pid` and whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != b"Z" and marker in cmdline:
            found.append(int(entry))
    return found


def _state(pid: int) -> str | None:
    """The process state letter of `pid` (R, S, D, T, Z, ...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()[0].decode()


def stub_pids(server) -> list[int]:
    """The pids of the server's Python-backend stub processes."""
    return children(server.process.pid, "triton_python_backend_stub")


def python_stacks(server, pid: int) -> str:
    """Every Python thread's stack of stub `pid`, as it dumps them into the server log on SIGUSR1."""
    state = _state(pid)
    if state in ("T", "t"):  # stopped (SIGSTOP, a tracer): the handler runs only once it is continued
        return f"(none: stub {pid} is stopped, state {state}, and cannot run its signal handler)"
    before = len(server.log_text())
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return f"stub {pid} is gone"
    # faulthandler writes them from its signal handler, all at once: done when the log has grown and then
    # stays still a moment (bounded: a frozen stub's handler still runs, but give up after 2 s).
    deadline, seen = time.monotonic() + 2.0, before
    while time.monotonic() < deadline:
        time.sleep(0.2)
        size = len(server.log_text())
        if size == seen > before:
            break
        seen = size
    return server.log_text()[before:].strip() or "(nothing written to the log)"


def native_stacks(pid: int, frames: int = 8) -> str:
    """One line per native thread of `pid`: its top `frames` functions, innermost first (gdb)."""
    if shutil.which("gdb") is None:
        return "(no gdb on this machine)"
    try:
        out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", f"thread apply all bt {frames}"],
                             capture_output=True, text=True, timeout=120).stdout
    except subprocess.TimeoutExpired:
        return "(gdb did not finish in 120 s)"
    lines, current = [], None
    for line in out.splitlines():
        if line.startswith("Thread "):
            current = [line.split(" (LWP")[0] + " " + line[line.find('"'):line.rfind('"') + 1]]
            lines.append(current)
        elif line.startswith("#") and current is not None:
            words = line.split()
            # "#1  0x... in func (args) at file:line" or "#0  func (args) at ...": the function's name.
            name = words[3] if len(words) > 3 and words[2] == "in" else words[1]
            current.append(name)
    return "\n".join(" < ".join(t) for t in lines) or out[-2000:]


def diagnose(server, timeout: float = 60.0) -> str | None:
    """None while `server` still serves; else why not: its exit, or its stubs' stacks and the log's tail."""
    if server.process is None:
        return None
    if server.process.poll() is not None:
        tail = "\n".join(server.log_text().splitlines()[-40:])
        return f"tritonserver exited with code {server.process.returncode}; the log's last lines:\n{tail}"
    why = answers(server, timeout)
    if why is None:
        return None
    tail = "\n".join(server.log_text().splitlines()[-30:])
    parts = [why, f"the server log's last lines ({server.log_path}):\n{tail}"]
    for pid in stub_pids(server):
        parts.append(f"stub {pid}, Python threads:\n{python_stacks(server, pid)}")
        parts.append(f"stub {pid}, native threads (innermost frame first):\n{native_stacks(pid)}")
    return "\n\n".join(parts)
