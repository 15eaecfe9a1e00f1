"""Linear layers whose CPU GEMMs run through oneDNN with the weight packed once at load.

On x86 CPUs `F.linear` calls MKL on the plain [out, in] weight at every step. oneDNN can instead
keep the weight in its own blocked layout, reordered once, so each call streams it straight into
its AVX-512/AVX2 kernels. For the decode shapes of a small model this is what the CPU spends most
of a step on, and the packed path is 1.2-2x faster (AMD EPYC, 2 threads, fp32: [64,576]x[576,960]
157 -> 203 GFLOPS, the LM head [64,576]x[576,49152] 96 -> 201, [8,576]x[576,3072] 70 -> 176; see
docs/PERFORMANCE.md). It is the same primitive torch's own compiler uses when it freezes a CPU
model's linears. Accelerators keep `F.linear`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def onednn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packed linears exist for float32 and bfloat16 on a CPU build with mkldnn."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """[out, in] weight -> oneDNN's blocked layout (an opaque tensor only `packed_linear` reads).

    `batch_hint` is the row count oneDNN tunes the layout for; any row count works with it.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that can hand its weight to oneDNN (`pack`) and then frees the plain copy."""

    packed: torch.Tensor | None = None

    def pack(self, batch_hint: int) -> None:
        self.packed = pack_weight(self.weight, batch_hint)
        # Rebind rather than resize: the plain weight may be shared (tied embeddings).
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Pack every `Linear` of `model` for oneDNN; returns how many were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is None:
            module.pack(batch_hint)
            count += 1
    return count
