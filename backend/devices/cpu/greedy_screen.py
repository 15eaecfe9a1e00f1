"""The float32 greedy head's token ids at about the cost of a bfloat16 LM head.

A greedy row that wants no log-prob needs only the argmax of its float32 logits. The screen computes
all logits with the bfloat16 GEMM (csrc/packed_gemm.cpp, about twice the float32 rate), bounds each one's
error by ||x|| * col_bounds[j], and recomputes in float32 only the tokens that bound cannot rule out
(csrc/screened_greedy_head.cpp) with the float32 GEMM's own arithmetic: the ids are those of the
float32 head on `cpu_gemm=avx512`, ties included (oneDNN and MKL order their sums otherwise, and can
differ from it, and from each other, where two logits are within float32 rounding). In an all-greedy
step the rows that want their log-prob take the float32 head; a step with a sampled row or banned
tokens takes it for every row (runner/head.py).

With `cpu_gemm=avx512_bf16` (every GEMM in bfloat16) the screen makes the head's choice the float32
one on the same hidden states, which keeps more outputs equal to the float32 model's.

Needs AVX-512 with BF16 (`kernels.packed_gemm_bf16_supported()`); it costs a bfloat16 copy of the
LM head (vocab x hidden x 2 bytes) and keeps a plain float32 one to recompute rows from (for a tied
head that is the embedding table itself).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from tritonllm.devices.cpu import kernels as cpu_kernels
from tritonllm.devices.cpu.load_timing import faster

_BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bfloat16 keeps 8 significant bits, rounded to nearest
_FP32_UNIT_ROUNDOFF = 2.0 ** -24


def error_bound_factor(in_features: int) -> float:
    """c with |float32 logit - bfloat16-GEMM logit| <= c * sum_i |x_i| |w_i| <= c * ||x|| * ||w||.

    Per product, rounding x and w to bfloat16 errs by at most (2u + u^2) |x_i| |w_i|; the float32 sums
    of either GEMM add at most ~K * 2^-24 of the same sum each (kept with room: 2K + 4 terms, 1 %
    more); the last 1 % covers the float32 rounding of the screen's own comparisons.
    """
    u = _BF16_UNIT_ROUNDOFF
    summing = (2 * in_features + 4) * _FP32_UNIT_ROUNDOFF * 1.01
    return (2 * u + u * u + summing) * 1.01


class GreedyScreen:
    """`self(x)` -> (ids, candidates): argmax_j of float32 x @ weight[j], via the bfloat16 screen.

    `weight` [vocab, hidden] float32 is kept by reference (not copied): the screen recomputes the
    rows it cannot rule out from it.
    """

    def __init__(self, weight: torch.Tensor):
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"GreedyScreen: float32 [vocab, hidden] weight, got {weight.dtype} {tuple(weight.shape)}")
        self.weight = weight.detach().contiguous()
        self.vocab_size, self.in_features = self.weight.shape
        self.packed = cpu_kernels.pack_gemm_weight_bf16(self.weight)
        norms = self.weight.double().norm(dim=1) * error_bound_factor(self.in_features)
        # Rounded up to float32, so no bound comes out smaller than its real value.
        bounds = norms.float()
        self.col_bounds = torch.where(bounds.double() < norms, torch.nextafter(bounds, torch.tensor(math.inf)), bounds)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, hidden] float32 (the final norm applied) -> (ids int64 [rows], tokens recomputed per row)."""
        x = x.contiguous()
        approx = cpu_kernels.packed_gemm_bf16(x, self.packed, None, self.vocab_size, self.in_features)
        return cpu_kernels.screened_greedy_head(x, approx, self.weight, self.col_bounds)


def screen_min_rows(screen: GreedyScreen, head: Callable[[torch.Tensor], torch.Tensor], max_rows: int) -> int | None:
    """The fewest rows (of max_rows, then halving down to 8) from which the screen finds a step's greedy ids
    faster on this CPU than `head` (the float32 LM head) and the fused argmax, timed once at load; None
    where it is not faster at max_rows.

    Whether it pays depends on the CPU: the bfloat16 dot products run at twice the float32 FMAs' rate on
    some (AMD Zen 4 and 5) and at the same rate on others (Intel Xeons without AMX), while a float32 head
    on exact 8-bit blocks reads fewer bytes than the bfloat16 copy. Its many rows favour the screen most,
    so fewer are tried only once it pays there. The screen's own recheck (a few % of it) is left out of the
    timing, and it must win by 5 %.
    """
    best = None
    rows = max_rows
    while rows >= 8:
        x = torch.randn(rows, screen.in_features)

        def screened() -> None:
            cpu_kernels.packed_gemm_bf16(x, screen.packed, None, screen.vocab_size, screen.in_features)

        def plain() -> None:
            cpu_kernels.greedy_head(head(x), logprobs=False)  # what the screen stands in for: ids alone

        if not faster(screened, plain, 0.95):
            break
        best = rows
        rows //= 2
    return best

