"""The Ascend backend: the model built with the Ascend ops (ops.py): torch_npu's paged attention.

Graph mode is not used yet: every step runs eagerly.
"""

from __future__ import annotations

import logging

from torch import nn

from tritonllm.core.config import NpuOptions
from tritonllm.devices.backend import Capabilities, DeviceBackend, Runtime
from tritonllm.devices.npu.ops import NpuOps, fused_attention_unsupported
from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.fp8 import is_fp8

logger = logging.getLogger(__name__)


def choose_attention(requested: str, runtime: Runtime) -> tuple[bool, str]:
    """`npu_attention=requested` for this runtime: (whether torch_npu's fused path runs, why not where it
    does not). torch_npu's calls are only called within what their documentation allows: outside it,
    `auto` runs the torch reference and an explicit `torch_npu` fails the load."""
    if requested == "torch":
        return False, "npu_attention=torch"
    why = fused_attention_unsupported(runtime.dtype, runtime.kv_dtype, runtime.block_size)
    if not why:
        return True, ""
    if requested == "torch_npu":
        raise ValueError(f"npu_attention=torch_npu: {why}")
    logger.warning("%s: the torch reference attention runs", why)
    return False, why


class NpuBackend(DeviceBackend):
    name = "npu"

    def __init__(self, options: NpuOptions, runtime: Runtime):
        super().__init__(options, runtime)
        # FP8 needs float8 tensors on the device, which torch_npu's documentation does not list for these
        # ops: refused by name rather than failing somewhere in the first step.
        if runtime.quantization == "fp8" or is_fp8(runtime.kv_dtype):
            raise ValueError("quantization=fp8 and kv_cache_dtype=fp8 are not supported on Ascend NPUs; "
                             "use dtype bfloat16 or float16")
        fused, why = choose_attention(options.attention, runtime)
        self.ops = NpuOps(fused, runtime.device, why)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(kv_layout=self.ops.kv_layout, skips_pruned_blocks=not self.ops.fused)

    def prepare(self, model: nn.Module) -> None:
        layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        if self.ops.fused and any(m.window is not None or m.softcap is not None for m in layers):
            logger.warning("the model has sliding-window or soft-capped attention: the torch reference attention runs")
            self.ops.use_torch_attention("sliding-window or soft-capped layers")
