"""The processes the supervisor watches: tritonserver's stubs found in /proc, exits seen through a pidfd.

Everything here reads the kernel's view of a process, from outside it: a stub that died cannot report
its own death, and the gauges it owned keep their last values.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
from pathlib import Path

STUB_MARKER = "triton_python_backend_stub"


def _proc_stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return []


def exit_description(pid: int) -> str:
    """How a process that has just exited ended, while it is a zombie (its parent has not reaped it)."""
    fields = _proc_stat(pid)
    if fields is None or fields[0] != "Z" or len(fields) < 50:
        return "exited"
    status = int(fields[49])  # exit_code: the waitpid() status
    return returncode_description(-(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF)


def returncode_description(returncode: int) -> str:
    """How a process ended, from its return code as subprocess gives it (negative: the signal that ended it)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    sig = -returncode
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    hint = " (what an OOM kill or kill -9 looks like)" if sig == signal.SIGKILL else (
        " (a crash)" if sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE) else "")
    return f"killed by {name}{hint}"


def _living_stubs(server_pid: int):
    """(pid, argv) of each stub process of tritonserver `server_pid` that has not exited."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _proc_stat(int(entry))
        if fields is None or int(fields[1]) != server_pid or fields[0] == "Z":
            continue
        args = _cmdline(int(entry))
        if len(args) >= 2 and args[0].endswith(STUB_MARKER):
            yield int(entry), args


def children_of(server_pid: int) -> dict[int, str]:
    """Every living child of `server_pid`, whatever it runs (a stub still between fork and exec has
    tritonserver's command line): pid -> its start time, which tells the same process from a pid reused later."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _proc_stat(int(entry))
            if fields is not None and int(fields[1]) == server_pid and fields[0] != "Z":
                found[int(entry)] = fields[19]
    return found


def kill_if_same(pid: int, started: str | None) -> None:
    """SIGKILL `pid` unless it has exited, or its pid now belongs to a process started at another time
    (`started` None, not known: unless it is no longer a Triton stub)."""
    fields = _proc_stat(pid)
    if fields is None or fields[0] == "Z":
        return
    if (fields[19] != started) if started is not None else not (_cmdline(pid) or [""])[0].endswith(STUB_MARKER):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def stubs_of(server_pid: int, repository: Path, model: str) -> dict[int, str]:
    """The live stub processes of tritonserver `server_pid` that serve `model`: pid -> instance name."""
    folder = str(repository / model) + os.sep
    return {pid: next((a for a in args[2:] if a.startswith(f"{model}_")), model)
            for pid, args in _living_stubs(server_pid) if args[1].startswith(folder)}


def any_stub_alive(server_pid: int) -> bool:
    """Whether tritonserver `server_pid` has a stub process, of any model, that has not exited."""
    return next(_living_stubs(server_pid), None) is not None


def open_connections(port: int) -> int:
    """TCP connections on this machine's loopback whose local end is `port` (a server's side) that the server
    has not closed yet: ESTABLISHED, or CLOSE_WAIT (the client closed; the server has yet to see it)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in ("01", "08"):
                count += 1
    return count


def set_parent_death_signal() -> None:
    """In the child before exec: SIGKILL it if the launcher dies, so no tritonserver outlives its front."""
    if LIBC is not None:
        LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


try:
    LIBC = ctypes.CDLL("libc.so.6", use_errno=True)  # loaded before any fork: the child only calls it
except OSError:
    LIBC = None


class ProcessWatch:
    """Calls `on_exit()` once when process `pid` exits: a pidfd on the event loop, else polling /proc."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pid: int, on_exit):
        self.pid, self._on_exit, self._loop = pid, on_exit, loop
        self._fd = None
        self._poller = None
        try:
            self._fd = os.pidfd_open(pid)
            loop.add_reader(self._fd, self._fire)
        except (AttributeError, OSError):
            self._poller = loop.create_task(self._poll())

    async def _poll(self):
        while True:
            fields = _proc_stat(self.pid)
            if fields is None or fields[0] == "Z":
                self._fire()
                return
            await asyncio.sleep(0.2)

    def _fire(self):
        cb, self._on_exit = self._on_exit, None
        self.cancel()
        if cb is not None:
            cb()

    def cancel(self):
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        if self._poller is not None and self._poller is not asyncio.current_task():
            self._poller.cancel()
        self._poller = None
