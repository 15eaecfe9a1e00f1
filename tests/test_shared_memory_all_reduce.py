"""Tensor parallelism's shared-memory all-reduce on CPU (devices/cpu/shared_memory_all_reduce.py), between
real processes: exact sums in rank order, the same bits on every rank, and a bounded failure when a
rank dies or rank 0 aborts.

This process is rank 0 (it creates the segment); the other ranks are this file run as a script with the
segment's file descriptor. Each rank draws every rank's tensors from fixed seeds, so each checks its own
result against the reference itself, and prints a digest of its results for the cross-rank comparison.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")]

SLOT_BYTES = 4096  # small, so that a few thousand elements already go piece by piece
# Element counts: below a slot, a float32 slot exactly (1024), a bfloat16 slot exactly (2048), just
# above, odd sizes across several pieces, and a decode step's [64, 576] activations.
SIZES = (1, 7, 1023, 1024, 1025, 2048, 2049, 5001, 64 * 576)
DTYPES = (torch.float32, torch.bfloat16)
MEMFD_NAME = "tritonllm-all-reduce"


def rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * numel + 10 * rank + DTYPES.index(dtype))
    return torch.randn(numel, generator=gen).to(dtype)


def reference_sum(world_size: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The ranks' tensors added in rank order, in float32 (bfloat16 rounded once at the end)."""
    total = rank_input(0, numel, dtype).float()
    for rank in range(1, world_size):
        total = total + rank_input(rank, numel, dtype).float()
    return total.to(dtype)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


def reduce_every_case(reducer) -> str:
    """Every (dtype, size) case through `reducer`, each checked bit for bit against the reference; the
    digest of all results."""
    digest = hashlib.sha256()
    for dtype in DTYPES:
        for numel in SIZES:
            x = rank_input(reducer.rank, numel, dtype)
            assert reducer(x) is x
            expected = reference_sum(reducer.world_size, numel, dtype)
            assert torch.equal(bits(x), bits(expected)), f"rank {reducer.rank}: {dtype} x {numel} differs"
            digest.update(bits(x).numpy().tobytes())
    return digest.hexdigest()


def reduce_once(reducer) -> None:
    reducer(torch.ones(3))


# ---- the other ranks: this file as a script ---------------------------------------------------------
def child(fd: int, rank: int, scenario: str, timeout_s: float) -> None:
    from tritonllm.devices.cpu.shared_memory_all_reduce import SharedMemoryAllReduce

    torch.set_num_threads(1)
    reducer = SharedMemoryAllReduce.attach(fd, rank, timeout_s)
    if scenario == "sums":
        print("digest", reduce_every_case(reducer), flush=True)
        return
    reduce_once(reducer)  # "stall", "fail": all ranks are in step once
    if scenario == "stall":  # alive, but never in the next all-reduce
        time.sleep(60)
        return
    started = time.monotonic()  # "fail": the next all-reduce must fail
    try:
        reduce_once(reducer)
    except RuntimeError as exc:
        print(f"failed after {time.monotonic() - started:.2f} s: {exc}", flush=True)
        return
    print("no failure", flush=True)


# ---- rank 0: the tests ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_memory_all_reduce():
    from tritonllm.devices.cpu import kernels
    from tritonllm.devices.cpu import shared_memory_all_reduce as module

    assert kernels.load(), kernels.error()
    return module.SharedMemoryAllReduce


def start_ranks(cls, world_size: int, scenarios: dict[int, str], timeout_s: float = 60.0):
    """Rank 0 (here) and ranks 1..N-1 (processes, each with its scenario), all joined."""
    reducer = cls.create(world_size, timeout_s, slot_bytes=SLOT_BYTES)
    fd = reducer.fileno()
    procs = {rank: subprocess.Popen([sys.executable, __file__, str(fd), str(rank), scenarios[rank], str(timeout_s)],
                                    pass_fds=(fd,), stdout=subprocess.PIPE, text=True)
             for rank in range(1, world_size)}
    try:
        reducer.wait_joined(120, lambda: None)
    except BaseException:
        for proc in procs.values():
            proc.kill()
        raise
    return reducer, procs


def finish(procs) -> dict[int, str]:
    out = {}
    for rank, proc in procs.items():
        stdout, _ = proc.communicate(timeout=120)
        out[rank] = stdout.strip()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_gets_the_rank_order_sum_bit_for_bit(shared_memory_all_reduce, world_size):
    reducer, procs = start_ranks(shared_memory_all_reduce, world_size, dict.fromkeys(range(1, world_size), "sums"))
    try:
        mine = reduce_every_case(reducer)
    finally:
        outputs = finish(procs)
        reducer.close()
    assert all(proc.returncode == 0 for proc in procs.values()), outputs
    assert outputs == dict.fromkeys(range(1, world_size), f"digest {mine}")  # the same bits on every rank


def test_a_non_contiguous_tensor_is_summed_in_place(shared_memory_all_reduce):
    one = shared_memory_all_reduce.create(1, 5.0, slot_bytes=SLOT_BYTES)  # one rank: the sum is the tensor itself
    try:
        x = torch.arange(12.0).view(3, 4).t()
        assert not x.is_contiguous()
        assert one(x) is x and torch.equal(x, torch.arange(12.0).view(3, 4).t())
    finally:
        one.close()


def test_a_rank_that_dies_mid_wait_fails_the_others_quickly_naming_it(shared_memory_all_reduce):
    reducer, procs = start_ranks(shared_memory_all_reduce, 3, {1: "fail", 2: "stall"})
    doomed = procs[2]
    reduce_once(reducer)
    # Killed while ranks 0 and 1 wait for it; not collected (a zombie) until they have failed.
    threading.Timer(0.3, doomed.send_signal, (signal.SIGKILL,)).start()
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=rf"rank 2 \(pid {doomed.pid}\) is gone"):
            reduce_once(reducer)
        assert time.monotonic() - started < 3
    finally:
        outputs = finish(procs)
        reducer.close()
    assert f"rank 2 (pid {doomed.pid}) is gone" in outputs[1], outputs[1]
    assert float(outputs[1].split()[2]) < 3, outputs[1]


def test_the_abort_word_fails_every_waiting_rank_at_once(shared_memory_all_reduce):
    reducer, procs = start_ranks(shared_memory_all_reduce, 3, {1: "fail", 2: "stall"})
    reduce_once(reducer)
    threading.Timer(0.3, reducer.abort).start()  # as rank 0's watchdog does; rank 2 is alive, only late
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="aborted by rank 0"):
            reduce_once(reducer)
        assert time.monotonic() - started < 3
    finally:
        procs[2].kill()
        outputs = finish(procs)
        reducer.close()
    assert "aborted by rank 0" in outputs[1], outputs[1]
    assert float(outputs[1].split()[2]) < 3, outputs[1]


def test_a_rank_that_never_comes_times_out(shared_memory_all_reduce):
    reducer = shared_memory_all_reduce.create(2, 0.3, slot_bytes=SLOT_BYTES)  # rank 1 never joins
    try:
        with pytest.raises(RuntimeError, match="rank 1 .* did not arrive in 0.3 s"):
            reduce_once(reducer)
    finally:
        reducer.close()


def our_files() -> list[str]:
    """The segment's traces: files in /dev/shm and this process's descriptors of its memfd."""
    found = [name for name in os.listdir("/dev/shm") if "tritonllm" in name] if os.path.isdir("/dev/shm") else []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if MEMFD_NAME in os.readlink(f"/proc/self/fd/{fd}"):
                found.append(fd)
        except OSError:
            pass
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc")
def test_the_segment_has_no_name_and_leaves_nothing_behind(shared_memory_all_reduce):
    assert our_files() == []
    reducer = shared_memory_all_reduce.create(2, 5.0, slot_bytes=SLOT_BYTES)
    assert not [name for name in os.listdir("/dev/shm") if "tritonllm" in name]
    reducer.close()
    assert our_files() == []


if __name__ == "__main__":
    child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
