"""The float32 greedy head's token ids at about the cost of an 8-bit or a bfloat16 LM head.

A greedy row that wants no log-prob needs only the argmax of its float32 logits. A screen approximates
every logit at a lower precision, bounds each one's error, and recomputes in float32 only the tokens
those bounds cannot rule out, with the float32 GEMM's own arithmetic: the ids are those of the
float32 head on `cpu_gemm=avx512`, ties included (oneDNN and MKL order their sums otherwise, and can
differ from it, and from each other, where two logits are within float32 rounding). In an all-greedy
step the rows that want their log-prob take the float32 head; a step with a sampled row or banned
tokens takes it for every row (runner/head.py).

Two screens:
- `Int8GreedyScreen` (csrc/int8_greedy_screen.cpp): x and the head in 8-bit blocks with their scales,
  integer dot products (AVX512-VNNI, AVX-VNNI or AVX2: `kernels.int8_screen_supported()`), a bound per
  token from the blocks' scales; a byte per weight beside the head.
- `GreedyScreen`: the bfloat16 GEMM (csrc/packed_gemm.cpp), a bound of ||x|| * col_bounds[j]
  (csrc/screened_greedy_head.cpp); AVX512-BF16 (`kernels.packed_gemm_bf16_supported()`), two bytes per
  weight. With `cpu_gemm=avx512_bf16` (every GEMM in bfloat16) it makes the head's choice the float32
  one on the same hidden states, which keeps more outputs equal to the float32 model's.
Both keep a reference to the plain float32 head to recompute tokens from (for a tied head that is the
embedding table itself). `fastest_screen` picks one at load by timing (`greedy_screen=auto`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from tritonllm.devices.cpu import kernels as cpu_kernels
from tritonllm.devices.cpu.load_timing import faster

_BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bfloat16 keeps 8 significant bits, rounded to nearest
_FP32_UNIT_ROUNDOFF = 2.0 ** -24
_BLOCK = 32  # the 8-bit screen: values along K per scale
_GROUP = 16  # ... and tokens per zmm of int32 lanes
_RUN_BYTES = 2 << 20  # the head's rows worked on at a time at build (_rows_per_run)


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
        # A run of rows at a time: no float64 copy of the whole head.
        norms = torch.cat([rows.double().norm(dim=1) for rows in self.weight.split(_rows_per_run(self.in_features))])
        norms = norms * error_bound_factor(self.in_features)
        # Rounded up to float32, so no bound comes out smaller than its real value.
        self.col_bounds = _rounded_up(norms)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, hidden] float32 (the final norm applied) -> (ids int64 [rows], tokens recomputed per row)."""
        x = x.contiguous()
        approx = cpu_kernels.packed_gemm_bf16(x, self.packed, None, self.vocab_size, self.in_features)
        return cpu_kernels.screened_greedy_head(x, approx, self.weight, self.col_bounds)


class Int8GreedyScreen:
    """`self(x)` -> (ids, candidates): argmax_j of float32 x @ weight[j], via the 8-bit screen
    (csrc/int8_greedy_screen.cpp: AVX512-VNNI, AVX-VNNI or AVX2). `steps`: x is quantized to 127 steps with a
    VNNI dot product, 63 with plain AVX2's (the default: what this CPU runs fastest); its bound terms are
    packed for them.

    Per token and block of 32 values along K, the weight is packed as d * q with q in -127..127 and
    d = max |w| / 127, with the error terms the bound needs: per block, sum |w| and the residual
    sum |w - d q|. `weight` [vocab, hidden] float32 is kept by reference (not copied):
    the tokens the screen cannot rule out are recomputed from it. It costs a byte per weight beside it.
    """

    def __init__(self, weight: torch.Tensor, steps: int | None = None):
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % _BLOCK:
            raise ValueError(f"Int8GreedyScreen: float32 [vocab, hidden] weight with hidden a multiple of {_BLOCK}, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        self.weight = weight.detach().contiguous()
        self.vocab_size, self.in_features = self.weight.shape
        blocks = self.in_features // _BLOCK
        self.steps = steps or cpu_kernels.int8_screen_steps()
        a, e = int8_bound_factors(self.in_features, self.steps)
        padded = -(-self.vocab_size // (2 * _GROUP)) * (2 * _GROUP)  # whole tiles of 32 tokens
        codes = torch.zeros(padded, self.in_features, dtype=torch.int8)
        d = torch.empty(self.vocab_size, blocks)
        negq = torch.empty(self.vocab_size, blocks, dtype=torch.int32)
        c = torch.empty(self.vocab_size, blocks, dtype=torch.float64)
        # In runs of tokens: each pass's temporaries stay in cache.
        run = _rows_per_run(self.in_features)
        for start in range(0, self.vocab_size, run):
            end = min(start + run, self.vocab_size)
            w = self.weight[start:end].view(end - start, blocks, _BLOCK)
            magnitude = w.abs()
            d[start:end] = magnitude.amax(dim=2) / 127  # the float32 scale the kernel multiplies by
            scale = d[start:end].unsqueeze(2)
            # Any q is right: its residual is measured below.
            q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-127, 127)
            # In float32: its roundings are in int8_bound_factors. The sums in float64.
            residual = (w - scale * q).abs_().sum(dim=2, dtype=torch.float64)
            c[start:end] = magnitude.sum(dim=2, dtype=torch.float64) * a + residual * e
            codes[start:end] = q.view(end - start, self.in_features)
            negq[start:end] = -128 * q.sum(dim=2)
        self.codes = codes.view(padded // _GROUP, _GROUP, self.in_features // 4, 4).permute(0, 2, 1, 3).contiguous()
        self.d = _by_group(d, padded)
        self.negq = _by_group(negq, padded)
        self.c = _by_group(_rounded_up(c), padded)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, hidden] float32 (the final norm applied) -> (ids int64 [rows], tokens recomputed per row)."""
        return cpu_kernels.int8_greedy_screen(x.contiguous(), self.codes, self.d, self.negq, self.c, self.weight,
                                              self.steps)


def int8_bound_factors(in_features: int, steps: int = 127) -> tuple[float, float]:
    """(a, e): per unit of a block's scale s of x, the 8-bit screen's error on a token is at most
    a * sum |w| + e * sum |w - d q| over the block (csrc/int8_greedy_screen.cpp), for x quantized to
    `steps` (127 below; 63 on plain AVX2: s = max / 63, and each 127 that bounds x^ is 63).

    x - s x^ is at most half a step plus the roundings of 127 / max and of x * (127 / max) (4 units of
    float32 rounding on values up to 127, kept with room: 8); the weight's residual meets |x^| <= 127;
    the residual, found in float32, is short of the real one by at most u sum |w| + 2u sum |w - d q|;
    the float32 head's own sum adds at most gamma_K * sum |x| |w| with |x| <= 127 s, and the screen's
    sums over the blocks gamma_(blocks + 2) of 127 s (sum |w| + sum |w - d q|). Everything 1 % more,
    for the float32 rounding of the bound's own sum and of the screen's comparisons.
    """
    u = _FP32_UNIT_ROUNDOFF
    gamma_k = in_features * u / (1 - in_features * u)
    blocks = in_features // _BLOCK
    gamma_b = (blocks + 2) * u / (1 - (blocks + 2) * u)
    a = 0.5 + steps * 8 * u + steps * 2 * u + steps * (1 + u) * gamma_k + steps * gamma_b
    e = steps * (1 + 4 * u) + steps * gamma_b
    return a * 1.01, e * 1.01


def _rows_per_run(in_features: int) -> int:
    """Rows of a float32 [vocab, in_features] head in about _RUN_BYTES."""
    return max(1, _RUN_BYTES // (4 * in_features))


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, never below the value."""
    rounded = values.float()
    return torch.where(rounded.double() < values, torch.nextafter(rounded, torch.tensor(math.inf)), rounded)


def _by_group(per_block: torch.Tensor, padded: int) -> torch.Tensor:
    """[V, blocks] -> [V' / 16, blocks, 16], zeros past V: a block's values for 16 tokens side by side, as one zmm."""
    vocab, blocks = per_block.shape
    out = per_block.new_zeros(padded, blocks)
    out[:vocab] = per_block
    return out.view(padded // _GROUP, _GROUP, blocks).permute(0, 2, 1).contiguous()


def fastest_screen(screens: list[GreedyScreen | Int8GreedyScreen], head: Callable[[torch.Tensor], torch.Tensor],
                   max_rows: int) -> tuple[GreedyScreen | Int8GreedyScreen, int] | None:
    """Of `screens`, the one that finds a step's greedy ids fastest on this CPU, if it beats `head` (the float32
    LM head) with the fused argmax by 5 % at max_rows, and the fewest rows (halving down to 8) from which it
    still does; timed once at load. None where no screen pays.

    Whether one pays depends on the CPU: the 8-bit dot products add twice the float32 FMAs' products on
    every CPU with VNNI (AVX-512 or AVX), a third more with plain AVX2's; the bfloat16 ones do on some (AMD Zen 4 and 5) and not on others (Intel
    Xeons without AMX), while a float32 head on exact 8-bit blocks reads fewer bytes than a bfloat16 copy.
    Many rows favour a screen most, so fewer are tried only once it pays there. Each screen is timed whole,
    its recheck of the tokens it cannot rule out included, on random hidden states.
    """
    def timed(rows: int):
        x = torch.randn(rows, screens[0].in_features)
        return x, (lambda: cpu_kernels.greedy_head(head(x), logprobs=False))  # what a screen stands in for: ids alone

    x, plain = timed(max_rows)
    paying = [screen for screen in screens if faster(lambda: screen(x), plain, 0.95)]
    if not paying:
        return None
    best = paying[0]
    for other in paying[1:]:
        if faster(lambda: other(x), lambda: best(x), 1.0):
            best = other
    rows = max_rows
    while rows // 2 >= 8:
        x, plain = timed(rows // 2)
        if not faster(lambda: best(x), plain, 0.95):
            break
        rows //= 2
    return best, rows

