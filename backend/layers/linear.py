"""Linear layers whose CPU GEMMs run on a weight packed once at load, by our kernel or oneDNN.

On x86 CPUs `F.linear` calls MKL on the plain [out, in] weight at every step. For the decode shapes
of a small model the GEMMs are most of a step, and a weight packed once into a kernel's own layout
streams straight into its FMAs:
- `avx512`: our kernel (csrc/packed_gemm.cpp), 32-column panels streamed once per call. At the
  1-64 rows a decode step runs it overlaps that stream with the arithmetic: 1.6x oneDNN at 1-8 rows,
  1.2x at 32, equal from 128 on (AMD EPYC, 2 threads, fp32, cold weights; docs/PERFORMANCE.md).
  float32 on CPUs with AVX-512; elsewhere it falls back to oneDNN.
- `avx512_bf16`: the same kernel on a bfloat16 copy of the weight, x rounded to bfloat16 per call,
  sums in float32 (`vdpbf16ps`): 1.7-2.1x `avx512` at 1-64 rows, half the weight memory. Lossy
  (relative error ~2.5e-3 per GEMM, so greedy outputs drift from float32 ones), hence opt-in; the
  rest of the model stays float32. CPUs with AVX512-BF16; elsewhere it falls back to `avx512`.
  With `exact_q4`, a weight whose every block of 32 along K is exactly 4-bit (layers/exact_q4.py: what
  a GGUF Q4_1 file dequantises to, as the default model's linears are) also keeps those 4-bit
  blocks, and steps of up to `Q4_MAX_ROWS` rows read them instead: the same float32 values, decoded
  in registers, so the same results bit for bit, from 5.3x fewer bytes (a step's GEMMs at 1 / 4 / 8
  rows 2.8x / 1.8x / 1.3x faster; from ~12 rows the arithmetic, not the stream, sets the pace).
- `onednn`: oneDNN's blocked layout, the primitive torch's own compiler uses when it freezes a CPU
  model's linears; 1.2-2x `F.linear` ([64,576]x[576,960] 157 -> 203 GFLOPS, the LM head
  [64,576]x[576,49152] 96 -> 201). float32 and bfloat16.
- `aten`: torch's `F.linear` on the plain weight. Accelerators always use it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels
from .exact_q4 import find_q4_blocks

logger = logging.getLogger(__name__)

Q4_MAX_ROWS = 10  # the most rows a GEMM on exactly-4-bit weights takes their 4-bit blocks for


def onednn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packed linears exist for float32 and bfloat16 on a CPU build with mkldnn."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def resolve_cpu_gemm(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The GEMM kernel the linears get for `cpu_gemm=requested`: the request, or the next one down
    (avx512_bf16 -> avx512 -> onednn -> aten) where it cannot run on this device, dtype, CPU or torch build."""
    if device.type != "cpu":
        return "aten"
    if requested == "avx512_bf16" and dtype == torch.float32 and cpu_kernels.packed_gemm_bf16_supported():
        return "avx512_bf16"
    if requested in ("avx512_bf16", "avx512") and dtype == torch.float32 and cpu_kernels.packed_gemm_supported():
        return "avx512"
    if requested in ("avx512_bf16", "avx512", "onednn") and onednn_packing_supported(device, dtype):
        return "onednn"
    return "aten"


class PackedWeight:
    """An [out, in] weight packed once for a CPU GEMM kernel; `self(x, bias)` is `F.linear(x, W, bias)`.

    `batch_hint` is the row count oneDNN tunes its layout for (any row count works with it).
    `packed`: this weight already packed for `kernel` elsewhere, to share instead of packing again.
    `exact_q4` (with `avx512`): also keep the weight's 4-bit blocks if it is exactly 4-bit, for GEMMs
    of up to Q4_MAX_ROWS rows.
    """

    def __init__(self, weight: torch.Tensor, kernel: str, batch_hint: int, packed: torch.Tensor | None = None,
                 exact_q4: bool = False):
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().contiguous()
        self.q4: tuple[torch.Tensor, torch.Tensor] | None = None  # (nibbles, dm) for packed_gemm_q4
        if exact_q4 and kernel == "avx512":
            blocks = find_q4_blocks(weight)
            if blocks is not None:
                self.q4 = cpu_kernels.pack_gemm_weight_q4(*blocks)
        if packed is not None:
            self.data = packed
        elif kernel == "avx512":
            self.data = cpu_kernels.pack_gemm_weight(weight)
        elif kernel == "avx512_bf16":
            self.data = cpu_kernels.pack_gemm_weight_bf16(weight)
        elif kernel == "onednn":
            self.data = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        else:
            raise ValueError(f"no packed layout for cpu_gemm={kernel!r}")

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel == "avx512":
            if self.q4 is not None and x.numel() <= Q4_MAX_ROWS * self.in_features:
                return cpu_kernels.packed_gemm_q4(x, *self.q4, bias, self.out_features)
            return cpu_kernels.packed_gemm(x, self.data, bias, self.out_features)
        if self.kernel == "avx512_bf16":
            return cpu_kernels.packed_gemm_bf16(x, self.data, bias, self.out_features, self.in_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.data, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that can hand its weight to a packed CPU kernel (`pack`) and then frees the plain copy."""

    packed: PackedWeight | None = None

    def pack(self, kernel: str, batch_hint: int, exact_q4: bool = False) -> None:
        self.packed = PackedWeight(self.weight, kernel, batch_hint, exact_q4=exact_q4)
        # Rebind rather than resize: the plain weight may be shared (tied embeddings).
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module, kernel: str, batch_hint: int, exact_q4: bool = False) -> int:
    """Pack every `Linear` of `model` for `kernel` ("avx512", "avx512_bf16" or "onednn"); returns how many were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is None:
            module.pack(kernel, batch_hint, exact_q4)
            count += 1
    return count
