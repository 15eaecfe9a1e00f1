"""Ends a model's Triton stub process when its tritonserver is gone.

Triton runs each Python-backend model instance in a stub process that is meant to exit when the
server dies. Its own check can deadlock: a thread blocked in a call to the server (a metric update,
`is_cancelled()`, a response) waits forever for an answer, holding the GIL and the stub's message
locks, so the stub, with the model weights and the KV pool in memory, outlives the server. That
happened here after `kill -9` of tritonserver and after tritonserver gave up on its exit timeout,
each time leaving a ~3 GB stub behind, still using CPU.

No thread inside the stub can be relied on then, so the guard is a small process of its own: it
polls the stub's parent pid, and once that changes (the server died; the orphan was re-parented)
it gives the stub `grace_s` to exit by itself, then kills it. It exits on its own as soon as the
stub does, whatever the way: it holds the read end of a pipe whose write end only the stub has.

Run as `python -m tritonllm.serving.orphan_guard STUB_PID SERVER_PID PIPE_FD GRACE_S` by `start()`.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time

logger = logging.getLogger(__name__)

POLL_S = 0.5
GRACE_S = 5.0

_pipe_ends: list[int] = []  # write ends held open for the life of this process (never written)


def start(grace_s: float = GRACE_S) -> subprocess.Popen | None:
    """Start a guard for this process (a stub) and its parent (tritonserver). None where impossible."""
    from tritonllm.runner.tp_workers import python_executable

    read_fd, write_fd = os.pipe()  # both ends close-on-exec: no other child inherits the write end
    try:
        proc = subprocess.Popen(
            [python_executable(), "-m", "tritonllm.serving.orphan_guard", str(os.getpid()), str(os.getppid()),
             str(read_fd), str(grace_s)],
            pass_fds=(read_fd,), stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    except Exception as exc:  # noqa: BLE001 - serving goes on; only the orphan protection is missing
        os.close(write_fd)
        logger.warning("could not start the orphan guard: %s", exc)
        return None
    finally:
        os.close(read_fd)
    _pipe_ends.append(write_fd)
    return proc


def parent_of(pid: int) -> int | None:
    """The parent pid of `pid` from /proc (None if it is gone or /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces or parentheses; the last ')' ends it.
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(stub: int, server: int, pipe_fd: int, grace_s: float) -> str:
    """Block until the stub exits (returns "stub exited") or is killed as an orphan ("killed")."""
    orphaned_at = None
    while True:
        readable, _, _ = select.select([pipe_fd], [], [], POLL_S)
        if readable:  # EOF: the stub's end closed, i.e. the stub is gone
            return "stub exited"
        if orphaned_at is None:
            ppid = parent_of(stub)
            if ppid is None and os.path.isdir("/proc/self"):
                continue  # /proc/STUB vanished between polls: the pipe reports it next
            if (ppid is not None and ppid != server) or (ppid is None and not _pid_alive(server)):
                orphaned_at = time.monotonic()
                print(f"tritonllm orphan guard: tritonserver (pid {server}) is gone; the model's stub process "
                      f"(pid {stub}) gets {grace_s:g} s to exit", file=sys.stderr, flush=True)
        elif time.monotonic() - orphaned_at >= grace_s:
            try:
                os.kill(stub, signal.SIGKILL)
            except ProcessLookupError:
                return "stub exited"
            print(f"tritonllm orphan guard: killed the stub process (pid {stub}) its tritonserver left behind",
                  file=sys.stderr, flush=True)
            return "killed"


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on tritonserver's terminal: the server decides
    stub, server, pipe_fd, grace_s = (argv if argv is not None else sys.argv[1:])
    watch(int(stub), int(server), int(pipe_fd), float(grace_s))


if __name__ == "__main__":
    main()
