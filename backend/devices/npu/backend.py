"""The Ascend backend: torch_npu's paged attention, applied to the plain model at load.

What `optimize` does: attention through torch_npu's fused operators (attention.py) on token-major
pools, the step's sequences as lengths and block tables; mixtures of experts routed without a host
sync. A model with sliding-window or soft-capped attention keeps the torch reference (the fused
call here is plain causal attention). Graph mode is not used yet: every step runs eagerly.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tritonllm.devices.backend import DeviceBackend
from tritonllm.engine.config import EngineConfig
from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.kv_layout import TOKEN_MAJOR
from tritonllm.models.moe import SparseMoeMLP

logger = logging.getLogger(__name__)


class NpuBackend(DeviceBackend):
    name = "npu"

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.options = config.npu
        self.device = device
        self.attention = "torch" if self.options.attention == "torch" else "torch_npu"

    def optimize(self, model: nn.Module) -> nn.Module:
        for module in model.modules():
            if isinstance(module, SparseMoeMLP):
                module.dense_routing = True
        layers = [m for m in model.modules() if type(m) is PagedAttention]
        if self.attention == "torch_npu" and any(m.window is not None or m.softcap is not None for m in layers):
            logger.warning("the model has sliding-window or soft-capped attention: the torch reference attention runs")
            self.attention = "torch"
        if self.attention == "torch_npu":
            from tritonllm.devices.npu.attention import NpuAttention, causal_mask

            mask = causal_mask(self.device)
            for module in layers:
                module.__class__ = NpuAttention
                module.mask = mask
            self.kv_layout, self.skips_pruned_blocks = TOKEN_MAJOR, False
        return model

    def describe(self) -> str:
        return "npu: " + ("torch_npu fused paged attention" if self.attention == "torch_npu" else "torch reference attention")
