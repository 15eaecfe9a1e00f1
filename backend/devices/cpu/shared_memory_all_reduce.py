"""Tensor parallelism's all-reduce between the ranks' processes on one machine's CPU, through shared memory.

The ranks sum their partial results with our kernels' op (csrc/shared_memory_all_reduce.cpp: each rank
copies its tensor into its slot of a segment they all map, publishes a sequence number, waits for the
others', and sums the slots in rank order, so every rank gets the same bits) instead of gloo's
loopback TCP. gloo keeps the process group; this only replaces its all-reduce.

Rank 0 creates the segment as an anonymous file (a memfd, or an unlinked temporary file where there is
none): it never has a name, so nothing is left in /dev/shm however the processes end, and a container's
small /dev/shm does not limit it. Each worker gets its file descriptor over its socket
(runner/tp_workers.py), maps it and joins by writing its pid into the header; the memory goes when the
last rank unmaps it. A waiting rank fails (RuntimeError) when a rank it waits on dies, when rank 0 sets
the abort word (`abort`: its watchdog saw a worker die, or it is closing), or after `timeout_s`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable

import torch

from tritonllm.devices.cpu import kernels

# A piece of up to this many bytes per rank goes through the segment at once: a decode step's
# tensors and most prompt steps' in one piece; larger ones go piece by piece. The segment holds two
# slots per rank, and only the pages a step touches take memory.
DEFAULT_SLOT_BYTES = 4 << 20


def _anonymous_file() -> int:
    """A file descriptor of a new, empty file in memory that no path names."""
    if hasattr(os, "memfd_create"):
        with contextlib.suppress(OSError):  # a sandbox may refuse the call
            return os.memfd_create("tritonllm-all-reduce", os.MFD_CLOEXEC)
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryFile(dir=folder) as f:  # unlinked as soon as it is made
        return os.dup(f.fileno())


def _require_kernels() -> None:
    if not kernels.load():
        raise RuntimeError(f"the shared-memory all-reduce needs the CPU kernels, which did not load: {kernels.error()}")


class SharedMemoryAllReduce:
    """One rank's view of the segment; `__call__` sums a tensor in place across the ranks. Make it with
    `create` (rank 0) or `attach` (a worker, with the descriptor rank 0 sent)."""

    def __init__(self, fd: int, rank: int, timeout_s: float):
        self._fd = fd
        self._map = mmap.mmap(fd, os.fstat(fd).st_size)  # shared, read-write
        self.segment: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self.rank = rank
        self.timeout_s = timeout_s
        self.world_size = 0

    @classmethod
    def create(cls, world_size: int, timeout_s: float, slot_bytes: int = DEFAULT_SLOT_BYTES) -> SharedMemoryAllReduce:
        """Rank 0: a new segment for `world_size` ranks, joined as rank 0; `fileno()` is for the workers."""
        _require_kernels()
        fd = _anonymous_file()
        try:
            os.ftruncate(fd, kernels.shm_all_reduce_segment_bytes(world_size, slot_bytes))
            reducer = cls(fd, 0, timeout_s)
        except BaseException:
            os.close(fd)
            raise
        kernels.shm_all_reduce_init(reducer.segment, world_size, slot_bytes)
        reducer._join()
        return reducer

    @classmethod
    def attach(cls, fd: int, rank: int, timeout_s: float) -> SharedMemoryAllReduce:
        """A worker: map rank 0's segment (its descriptor, which this object then owns) and join as `rank`."""
        try:
            _require_kernels()
            reducer = cls(fd, rank, timeout_s)
        except BaseException:
            os.close(fd)
            raise
        reducer._join()
        return reducer

    def _join(self) -> None:
        self.world_size = kernels.shm_all_reduce_join(self.segment, self.rank, os.getpid())

    def fileno(self) -> int:
        return self._fd

    def wait_joined(self, timeout_s: float, check: Callable[[], None] = lambda: None) -> None:
        """Rank 0: until every rank has joined (each waiting rank watches the others' pids from then on);
        `check` raises if a worker is known to have failed."""
        deadline = time.monotonic() + timeout_s
        while (joined := kernels.shm_all_reduce_joined(self.segment)) < self.world_size:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"shared-memory all-reduce: {joined} of {self.world_size} ranks joined "
                                   f"in {timeout_s:.0f} s")
            time.sleep(0.002)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks in place (every rank calls it with a tensor of the same shape and dtype)."""
        if not x.is_contiguous():
            return x.copy_(self(x.contiguous()))
        return kernels.shm_all_reduce_(x, self.segment, self.rank, self.timeout_s)

    def abort(self) -> None:
        """Make every rank waiting in (or later entering) an all-reduce fail at once."""
        segment = self.segment  # once: close() may drop it meanwhile (the watchdog's thread calls this)
        if segment is not None:
            kernels.shm_all_reduce_abort(segment)

    def close(self) -> None:
        """Unmap (once no tensor made from the segment is left) and close the descriptor."""
        self.segment = None
        with contextlib.suppress(BufferError):  # a view still held elsewhere: the mapping goes with it
            self._map.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
