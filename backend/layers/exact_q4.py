"""Float32 weights that are exactly 4-bit blocks, found so the GEMM can stream them as such.

A GGUF Q4_1 weight dequantises, per block of 32 values along the input dimension, to
fl(fl(d * q) + m) with q in 0..15 and one d and one m per block (two float32 roundings, as
transformers' GGUF loader computes it). The packaged default model is such a file, so every
float32 linear of it is exactly 4-bit: kept as q, d and m it takes 13.8 KB per 32-column panel
instead of 73.7 KB. `find_q4_blocks` recovers q, d and m from the float32 weight and checks that
they give back every value bit for bit; where any block does not, the weight is not 4-bit and
stays float32 only. Nothing is rounded: the GEMM decodes the same float32 values it would read.
"""

from __future__ import annotations

import torch

BLOCK = 32
_SAMPLE_ROWS = 64  # checked first, so a weight that is not 4-bit (most are not) is rejected cheaply


def find_q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """weight [N, K] float32 -> (q uint8 [N, K], d [N, K / 32], m [N, K / 32]) with
    weight == fl(fl(d * q) + m) bit for bit per block of 32 along K; None if no such blocks exist."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    weight = weight.detach().contiguous()
    if weight.shape[0] > _SAMPLE_ROWS and _solve(weight[:_SAMPLE_ROWS]) is None:
        return None
    return _solve(weight)


def _solve(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    n, k = weight.shape
    blocks = weight.view(n, k // BLOCK, BLOCK)
    if not torch.isfinite(blocks).all():
        return None
    m = blocks.amin(-1)
    span = blocks.amax(-1) - m
    # d is span / 15 up to its own rounding: GGUF stores it as float16, so try that value and its
    # float16 neighbours, then float32's own quotient. Blocks whose values are all equal take d = 0.
    d_half = (span / 15).to(torch.float16)
    candidates = [(d_half.view(torch.int16) + step).view(torch.float16).float() for step in (0, 1, -1, 2, -2)]
    candidates.append(span / 15)
    d = torch.zeros_like(m)
    q = torch.zeros(blocks.shape, dtype=torch.uint8)
    solved = span == 0
    bits = blocks.view(torch.int32)
    for cand in candidates:
        todo = ~solved
        if not todo.any():
            break
        cd, cm, cb = cand[todo], m[todo], blocks[todo]
        usable = torch.isfinite(cd) & (cd > 0)
        cq = ((cb - cm[:, None]) / torch.where(usable, cd, 1.0)[:, None]).round_().clamp_(0, 15)
        rebuilt = cd[:, None] * cq + cm[:, None]  # two roundings: eager torch does not fuse them
        exact = usable & (rebuilt.view(torch.int32) == bits[todo]).all(-1)
        rows = todo.nonzero(as_tuple=True)
        hit = tuple(r[exact] for r in rows)
        d[hit] = cd[exact]
        q[hit] = cq[exact].to(torch.uint8)
        solved[hit] = True
    if not solved.all():
        return None
    # A block of equal values is m with q = d = 0: 0 * 0 + m gives m back unless m is -0.0.
    flat = solved & (span == 0)
    if (m[flat].view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any():
        return None
    return q.view(n, k), d, m
