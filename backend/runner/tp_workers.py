"""The scheduler rank's side of tensor parallelism: start ranks 1..N-1, send them each step, watch them.

This process is rank 0: it keeps the scheduler, block manager and Triton glue, and runs its own
shard of the model. Every other rank is a worker process (`python -m tritonllm.runner.tp_worker`) that
only runs the model: it receives each step's host inputs over a private socket pair, in order, and
meets the other ranks in the forward's all-reduces (torch.distributed: gloo on CPU, NCCL on CUDA,
HCCL on Ascend; on CPU with our kernels loaded, through a shared-memory segment instead:
devices/cpu/shared_memory_all_reduce.py). A worker that exits is noticed by a watchdog thread within a
fraction of a second, and a collective waiting on it fails at once (the watchdog sets the segment's abort
word; a process group's collective fails as its peer's socket closes): the engine then stops and fails its
requests.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

import torch

from tritonllm.core.config import EngineConfig
from tritonllm.devices.cpu.shared_memory_all_reduce import SharedMemoryAllReduce

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)  # a rank silent this long inside a collective is hung


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed to start or died."""


@dataclass
class WorkerSpec:
    """What a worker needs to load its shard (sent once, pickled, over its socket)."""

    config: EngineConfig  # the engine's, whole: the device backend's options travel in it
    model_dir: str
    dtype: str  # torch dtype name, e.g. "float32"
    device: str  # this rank's device, e.g. "cpu" or "cuda:1"
    max_model_len: int
    rank: int
    num_threads: int  # torch intra-op threads on CPU (0: leave torch's default)

    @property
    def world_size(self) -> int:
        return self.config.parallel.tensor_parallel_size


def threads_per_rank(config: EngineConfig) -> int:
    """Torch threads for each rank on a CPU, where the ranks share the machine's cores."""
    return config.device.num_threads or max(1, (os.cpu_count() or 1) // config.parallel.tensor_parallel_size)


def python_executable() -> str:
    """The interpreter that runs workers: ours, even when embedded (Triton's stub is not python)."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python") and os.path.exists(exe):
        return exe
    for candidate in (os.path.join(sys.prefix, "bin", "python3"), os.path.join(sys.prefix, "bin", "python"),
                      shutil.which("python3")):
        if candidate and os.path.exists(candidate):
            return candidate
    raise TensorParallelError("cannot find a python interpreter to start tensor-parallel workers")


class TensorParallelWorkers:
    def __init__(self, specs: list[WorkerSpec], startup_timeout_s: float = 600.0):
        self.world_size = len(specs) + 1
        self.failure: str | None = None
        self._closing = False
        self._startup_timeout_s = startup_timeout_s
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self.shared_memory: SharedMemoryAllReduce | None = None  # the CPU's all-reduce, once connected with it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        exe = python_executable()
        for spec in specs:
            ours, theirs = socket.socketpair()
            env["TRITONLLM_TP_FD"] = str(theirs.fileno())
            proc = subprocess.Popen([exe, "-m", "tritonllm.runner.tp_worker"], env=env, pass_fds=(theirs.fileno(),))
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(spec)
            self._procs.append(proc)
            self._conns.append(conn)
        logger.info("started %d tensor-parallel worker(s) with %s (pids %s)", len(specs), exe,
                    [p.pid for p in self._procs])
        self._watchdog = threading.Thread(target=self._watch, name="tritonllm-tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- start-up ----------------------------------------------------------------------------
    def wait_loaded(self) -> None:
        """Block until every worker has loaded its shard; a worker that dies first raises."""
        deadline = time.monotonic() + self._startup_timeout_s
        for rank, conn in enumerate(self._conns, start=1):
            while not conn.poll(0.1):
                self._raise_if_failed()
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel worker rank {rank} did not load its shard "
                                              f"in {self._startup_timeout_s:.0f} s")
            try:
                message = conn.recv()
            except (EOFError, OSError):
                time.sleep(0.5)  # let the watchdog read its exit code for the message
                self._raise_if_failed()
                raise TensorParallelError(f"tensor-parallel worker rank {rank} closed its connection") from None
            if isinstance(message, tuple) and message[0] == "error":
                raise TensorParallelError(f"tensor-parallel worker rank {rank} failed to load: {message[1]}")
            if message != "loaded":
                raise TensorParallelError(f"tensor-parallel worker rank {rank}: unexpected {message!r}")

    def connect(self, device: torch.device, num_blocks: int, num_window_blocks: int, shared_memory: bool = False):
        """Every rank joins this model's process group, the workers told their pools' sizes; returns rank 0's
        group. The rendezvous store lives as long as the workers. With `shared_memory` (CPU ranks, kernels
        loaded) every rank also maps one all-reduce segment (`self.shared_memory`): each worker gets its
        file descriptor after the message, and has joined it when this returns."""
        self._store = make_store(0, self.world_size, is_master=True)
        if shared_memory:
            self.shared_memory = SharedMemoryAllReduce.create(self.world_size, COLLECTIVE_TIMEOUT.total_seconds())
        for conn, proc in zip(self._conns, self._procs):
            conn.send(("connect", self._store.port, num_blocks, num_window_blocks, shared_memory))
            if self.shared_memory is not None:
                send_handle(conn, self.shared_memory.fileno(), proc.pid)
        group = new_process_group(device, 0, self.world_size, self._store)
        if self.shared_memory is not None:  # every worker maps it before it joins the group: a formality
            self.shared_memory.wait_joined(self._startup_timeout_s, self._raise_if_failed)
        return group

    # ---- steps -------------------------------------------------------------------------------
    def broadcast(self, host_step) -> None:
        """Send one step's host inputs to every worker (pickled once); they run it as it arrives."""
        self._raise_if_failed()
        payload = pickle.dumps(("step", host_step), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(payload)
            except OSError as exc:
                raise TensorParallelError(f"tensor-parallel worker rank {rank} is gone: {exc}") from exc

    def _raise_if_failed(self) -> None:
        if self.failure:
            raise TensorParallelError(self.failure)

    def explain(self, exc: BaseException, timeout_s: float = 5.0) -> None:
        """After a collective failed with `exc`: raise TensorParallelError naming the worker that died, if
        one did. The watchdog polls every 0.1 s, but on a starved machine it may take longer to run, so
        wait for its word (bounded) rather than a fixed moment."""
        deadline = time.monotonic() + timeout_s
        while not self.failure and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.failure:
            raise TensorParallelError(self.failure) from exc

    # ---- health ------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in enumerate(self._procs, start=1):
                code = proc.poll()
                if code is not None and not self._closing and self.failure is None:
                    self.failure = f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
                    logger.error("%s", self.failure)
                    self._abort_collectives()
            time.sleep(0.1)

    def _abort_collectives(self) -> None:
        """Make every rank waiting in a shared-memory all-reduce (or entering one) fail at once."""
        if self.shared_memory is not None:
            self.shared_memory.abort()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker: a polite message first, then SIGKILL for any that do not leave."""
        self._closing = True
        self._abort_collectives()  # a worker left waiting in an all-reduce (this rank's step failed) leaves too
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(("stop", None)))
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        if self.shared_memory is not None:
            self.shared_memory.close()


def new_process_group(device: torch.device, rank: int, world_size: int, store):
    """A process group of this model's ranks only, meeting through `store`.

    Not torch.distributed's global default group: the engine owns it, and several engines (or a
    user's own distributed code) can live in one process.
    """
    import torch.distributed as dist

    if device.type == "cpu":
        return dist.ProcessGroupGloo(store, rank, world_size, COLLECTIVE_TIMEOUT)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if device.type == "npu":
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return ProcessGroupHCCL(store, rank, world_size, options)
    raise TensorParallelError(f"no collective backend for device {device}")


def make_store(port: int, world_size: int, is_master: bool):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size, is_master, timeout=datetime.timedelta(seconds=120),
                         wait_for_workers=False)
