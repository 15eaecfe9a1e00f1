"""One rank's model on its device: built with its backend's ops, prepared, its KV pools, and the
forward of one step. The scheduler rank's runner (model_runner.py) and every tensor-parallel worker
(tp_worker.py) run a step through this one class.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tritonllm.core.config import EngineConfig
from tritonllm.devices import select_backend
from tritonllm.models.loader import load_model
from tritonllm.parallel.shard import TPShard
from tritonllm.runner.kv_pool import allocate_kv_pool
from tritonllm.runner.step_inputs import DeviceStep, copy_kv_slots

logger = logging.getLogger(__name__)


class ModelShard:
    """This rank's shard of the model in `folder`: the device backend chosen for it, the model built with
    that backend's ops and their weights prepared; `allocate` makes its KV pools, `forward` runs a step."""

    def __init__(self, config: EngineConfig, folder: Path, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, tp: TPShard):
        started = time.perf_counter()
        self.backend = select_backend(config, device, dtype, max_model_len, tp.rank)
        self.model = load_model(folder, dtype, device, max_model_len, tp, self.backend.ops)
        self.backend.quantize(self.model)
        self.backend.prepare(self.model)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.window_pool_layers: list[bool] | None = None
        logger.info("loaded %s (%s, %s, tensor-parallel rank %d of %d) in %.1f s", folder, device, dtype, tp.rank,
                    tp.world_size, time.perf_counter() - started)

    def allocate(self, num_blocks: int, num_window_blocks: int) -> None:
        """The KV pools, laid out as the backend's attention reads them; then what the backend captures on them."""
        rt = self.backend.runtime
        self.kv_caches = allocate_kv_pool(self.model, num_blocks, rt.block_size, rt.kv_dtype, rt.device,
                                          num_window_blocks, self.backend.capabilities.kv_layout)
        self.window_pool_layers = self.model.window_pool_layers if num_window_blocks else None
        self.backend.capture(self.model, self.kv_caches, num_window_blocks)
        logger.info("plan (rank %d): %s", rt.rank, self.backend.describe())

    def forward(self, step: DeviceStep) -> torch.Tensor:
        """The step's prefix K/V copies, then its forward: the final hidden states of its tokens."""
        copy_kv_slots(self.kv_caches, step, self.window_pool_layers, self.backend.capabilities.kv_layout)
        return self.backend.forward(self.model, step.input_ids, step.positions, self.kv_caches, step.meta)
