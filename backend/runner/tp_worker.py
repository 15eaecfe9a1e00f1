"""A tensor-parallel worker process (rank >= 1): load a shard, then run every step rank 0 sends.

Started by `workers.TensorParallelWorkers` as `python -m tritonllm.runner.tp_worker`, with its end of a
socket pair in TRITONLLM_TP_FD. It never schedules, samples or answers requests: it only runs the
model forward, meeting the other ranks in its all-reduces. When rank 0 goes away (its socket closes)
the worker exits; any error exits non-zero, which rank 0's watchdog turns into failed requests.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from pathlib import Path

import torch

from tritonllm.devices import platform
from tritonllm.devices.cpu.shared_memory_all_reduce import SharedMemoryAllReduce
from tritonllm.parallel.shard import TPShard
from tritonllm.runner.model_shard import ModelShard
from tritonllm.runner.step_inputs import to_device
from tritonllm.runner.tp_workers import COLLECTIVE_TIMEOUT, WorkerSpec, make_store, new_process_group

logger = logging.getLogger("tritonllm.runner.tp_worker")


def serve(conn: Connection) -> None:
    spec: WorkerSpec = conn.recv()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    platform.set_device(device)
    dtype = getattr(torch, spec.dtype)
    tp = TPShard(spec.rank, spec.world_size)
    shard = ModelShard(spec.config, Path(spec.model_dir), device, dtype, spec.max_model_len, tp)
    conn.send("loaded")
    _, store_port, num_blocks, num_window_blocks, shared_memory = conn.recv()
    if shared_memory:  # mapped (and joined) before this rank joins the group, which rank 0 waits for
        tp.local_all_reduce = SharedMemoryAllReduce.attach(recv_handle(conn), spec.rank,
                                                           COLLECTIVE_TIMEOUT.total_seconds())
    store = make_store(store_port, spec.world_size, False)
    tp.group = new_process_group(device, spec.rank, spec.world_size, store)
    shard.allocate(num_blocks, num_window_blocks)
    logger.info("rank %d ready: %d KV heads, %d blocks of %s on %s", spec.rank, shard.model.num_kv_heads, num_blocks,
                str(shard.kv_caches[0][0].dtype).removeprefix("torch."), device)
    with torch.inference_mode():
        while True:
            try:
                kind, host = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0 is gone
                break
            if kind == "stop":
                break
            shard.forward(to_device(host, device))


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    conn = Connection(int(os.environ["TRITONLLM_TP_FD"]))
    code = 0
    try:
        serve(conn)
    except BaseException as exc:
        logger.exception("tensor-parallel worker failed")
        try:  # rank 0 may still be waiting for this rank to load: tell it why
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        code = 1
    # Stopped or failed: nothing is left to give back (the pool and the weights are this process's memory, and
    # rank 0 starts no more collectives with it), so once the logs are written the interpreter's own teardown
    # of torch, most of a second that rank 0's close (or its watchdog, after a failure) would wait for, is skipped.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
