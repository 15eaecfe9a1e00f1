"""A tensor-parallel worker process (rank >= 1): load a shard, then run every step rank 0 sends.

Started by `workers.TensorParallelWorkers` as `python -m tritonllm.parallel.worker`, with its end of a
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
from pathlib import Path

import torch

from tritonllm.devices import platform, select_backend
from tritonllm.models.loader import load_model
from tritonllm.runner.kv_pool import allocate_kv_pool
from tritonllm.runner.step_inputs import copy_kv_slots, to_device
from tritonllm.parallel.shard import TPShard
from tritonllm.parallel.workers import WorkerSpec, make_store, new_process_group

logger = logging.getLogger("tritonllm.parallel.worker")


def serve(conn: Connection) -> None:
    spec: WorkerSpec = conn.recv()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    platform.set_device(device)
    dtype = getattr(torch, spec.dtype)
    tp = TPShard(spec.rank, spec.world_size)
    backend = select_backend(device, dtype, spec.config).for_worker()
    model = backend.optimize(load_model(Path(spec.model_dir), dtype, device, spec.max_model_len, tp))
    conn.send("loaded")
    _, store_port, num_blocks, num_window_blocks = conn.recv()
    store = make_store(store_port, spec.world_size, False)
    tp.group = new_process_group(device, spec.rank, spec.world_size, store)
    kv_caches = allocate_kv_pool(model, num_blocks, spec.config.cache.block_size, getattr(torch, spec.kv_cache_dtype),
                                 device, num_window_blocks, backend.kv_layout)
    logger.info("rank %d ready: %d KV heads, %d blocks of %s on %s", spec.rank, model.num_kv_heads, num_blocks,
                str(kv_caches[0][0].dtype).removeprefix("torch."), device)
    with torch.inference_mode():
        while True:
            try:
                kind, host = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0 is gone
                break
            if kind == "stop":
                break
            step = to_device(host, device)
            copy_kv_slots(kv_caches, step, model.window_pool_layers if num_window_blocks else None, backend.kv_layout)
            backend.forward(model, step.input_ids, step.positions, kv_caches, step.meta)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    conn = Connection(int(os.environ["TRITONLLM_TP_FD"]))
    try:
        serve(conn)
    except BaseException as exc:
        logger.exception("tensor-parallel worker failed")
        try:  # rank 0 may still be waiting for this rank to load: tell it why
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(1)


if __name__ == "__main__":
    main()
