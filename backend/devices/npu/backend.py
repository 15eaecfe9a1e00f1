"""The Ascend backend: the model built with the Ascend ops (ops.py): torch_npu's paged attention.

Graph mode is not used yet: every step runs eagerly.
"""

from __future__ import annotations

import logging

from torch import nn

from tritonllm.core.config import NpuOptions
from tritonllm.devices.backend import Capabilities, DeviceBackend, Runtime
from tritonllm.devices.npu.ops import NpuOps
from tritonllm.layers.attention import PagedAttention

logger = logging.getLogger(__name__)


class NpuBackend(DeviceBackend):
    name = "npu"

    def __init__(self, options: NpuOptions, runtime: Runtime):
        super().__init__(options, runtime)
        fused = options.attention != "torch"
        self.ops = NpuOps(fused, runtime.device, "" if fused else "npu_attention=torch")

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(kv_layout=self.ops.kv_layout, skips_pruned_blocks=not self.ops.fused)

    def prepare(self, model: nn.Module) -> None:
        layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        if self.ops.fused and any(m.window is not None or m.softcap is not None for m in layers):
            logger.warning("the model has sliding-window or soft-capped attention: the torch reference attention runs")
            self.ops.use_torch_attention("sliding-window or soft-capped layers")
