"""FP8 (e4m3) weights and KV cache: `quantization=fp8` and `kv_cache_dtype=fp8`.

Weights: each decoder linear's [out, in] weight is rounded once after load to FP8 e4m3 with one
float32 scale per output row (its largest magnitude maps to e4m3's largest finite value, 448). A
product quantizes its input the same way per row (per token) on the fly and multiplies the two FP8
matrices with `torch._scaled_mm`, sums in float32, both scales applied to the result: the form FP8
tensor cores (H100/H200, sm89+) compute. Elsewhere (a CPU, whose `_scaled_mm` is a slow reference;
an older GPU) the layer keeps the FP8 values widened to the model's dtype and multiplies the widened
input by them: the same numbers up to the order of the sums, at the model dtype's speed and memory.
That form is for checking accuracy where no FP8 hardware is at hand, not for speed. The LM head and
the embeddings keep the model's dtype, as the field's FP8 checkpoints do: the head's rounding would
move every log-prob; so do a mixture of experts' routers (models/moe.py).

KV cache: K and V are stored as e4m3 with a scale of 1 (no calibration): values are clamped to
+-448 and rounded; attention widens them back. e4m3 keeps 3 mantissa bits, so each stored value
is within 1/16 of itself (relative), and anything below 2^-9 becomes 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_fp8_saturated(t: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """`t` rounded to `dtype`, values past its largest finite one clamped to it (a plain cast makes them
    NaN in e4m3, which has no infinity)."""
    limit = torch.finfo(dtype).max
    return t.clamp(-limit, limit).to(dtype)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (FP8 e4m3 [rows, cols], float32 scales [rows, 1]) with t ~= fp8 * scale, each row's
    largest magnitude at 448. An all-zero row gets scale 1."""
    t = t.float()
    amax = t.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return to_fp8_saturated(t / scale), scale


class Fp8Weight:
    """A linear's [out, in] weight in FP8 with per-output-row scales; `self(x, bias)` ~= F.linear(x, W, bias).

    `fused`: whether `torch._scaled_mm` runs for this weight (a CUDA device where it runs, tried once at
    build); otherwise `wide` holds the FP8 values widened to the weight's dtype.
    """

    kernel = "fp8"

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.q, scale = quantize_rows(weight.detach())
        self.scale_t = scale.t().contiguous()  # [1, out]: `_scaled_mm`'s per-column scale of W^T
        self.fused = weight.device.type == "cuda" and self._scaled_mm_runs(weight.dtype)
        self.wide = None if self.fused else self.dequantized(weight.dtype)

    def _scaled_mm_runs(self, dtype: torch.dtype) -> bool:
        try:  # a decode's single row and a larger step
            for rows in (1, 16):
                self._fused(torch.zeros(rows, self.in_features, dtype=dtype, device=self.q.device), None)
            return True
        except (RuntimeError, NotImplementedError, TypeError):
            return False

    def _fused(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xq, xs = quantize_rows(x)
        # CUDA's row-wise scaled GEMM writes bfloat16.
        y = torch._scaled_mm(xq, self.q.t(), scale_a=xs, scale_b=self.scale_t, out_dtype=torch.bfloat16).to(x.dtype)
        return y if bias is None else y.add_(bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight this layer multiplies by, [out, in] in `dtype`."""
        return (self.q.float() * self.scale_t.t()).to(dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] == 0:
            return x.new_empty(*shape[:-1], self.out_features)
        if self.fused:
            y = self._fused(rows.contiguous(), bias)
        else:
            xq, xs = quantize_rows(rows)
            y = F.linear((xq.float() * xs).to(x.dtype), self.wide, bias)
        return y.view(*shape[:-1], self.out_features)


def quantize_linears(model: nn.Module) -> str:
    """Every linear of the decoder layers (`model.layers`; a mixture of experts' routers excepted) to FP8 (`Linear.packed` = an Fp8Weight, its
    plain weight dropped). Returns how they compute, for the load plan."""
    from tritonllm.layers.linear import Linear

    fused = []
    for layer in model.layers.modules():
        if isinstance(layer, Linear) and layer.quantizable and not layer.tied and layer.weight is not None:
            layer.packed = Fp8Weight(layer.weight)
            layer.weight = None
            fused.append(layer.packed.fused)
    if all(fused):
        return "FP8 e4m3 (per-row weight and per-token input scales) by torch._scaled_mm"
    if not any(fused):
        return "FP8 e4m3 values widened to the model's dtype (no FP8 GEMM here: same numbers, not faster)"
    return f"FP8 e4m3: {sum(fused)} of {len(fused)} linears by torch._scaled_mm, the rest widened per product"
