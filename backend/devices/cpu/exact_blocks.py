"""Float32 weights that are exactly quantized blocks, found so the GEMM can stream them as such.

A GGUF weight dequantises, per block of 32 values along the input dimension, to fl(fl(d * q) + m)
with q in 0..15 and one d and one m per block (Q4_1), or to fl(d * q) with q in -128..127 (Q8_0):
float32 roundings as transformers' GGUF loader computes them. The packaged default model is such a
file: its decoder linears are Q4_1 and its (tied) embedding and LM head Q8_0. A bfloat16 checkpoint
(most published models) loaded as float32 holds bfloat16 values. Kept in those forms, a 32-column
panel at K = 576 takes 13.8 KB (Q4_1), 20.7 KB (Q8_0) or 36.9 KB (bfloat16) instead of 73.7 KB.
`find_blocks` recovers the form from the float32 weight and checks that it gives back every value
bit for bit; where any value does not, the weight stays float32 only. Nothing is rounded: the GEMM
(csrc/exact_block_gemm.cpp, on the kernels' AVX-512 and AVX2 builds) decodes the same float32 values it
would otherwise read.
"""

from __future__ import annotations

import torch

from tritonllm.devices.cpu import kernels as cpu_kernels

BLOCK = 32
_SAMPLE_ROWS = 64  # checked first, so a weight that is not such blocks (most are not) is rejected cheaply
_CHUNK_BYTES = 2 << 20  # rows solved at a time (_solve_by_rows)


Blocks = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]  # q, d (None: bfloat16), m (None: Q8_0, bfloat16)


def find_blocks(weight: torch.Tensor, in_torch: bool = False) -> Blocks | None:
    """weight [N, K] float32 -> (q, d, m) of its Q4_1 blocks (q uint8 [N, K], d and m [N, K / 32]),
    (q, d, None) of its Q8_0 blocks (q int8), or (q, None, None) of its bfloat16 values (q bfloat16),
    equal to the weight bit for bit; None if none of them. The C++ kernels search the 4- and 8-bit
    forms where they are loaded (csrc/find_exact_blocks.cpp, one pass over the weight); `in_torch`,
    or no kernels: the search below in torch ops, the reference the kernel is tested against."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    weight = weight.detach().contiguous()
    in_kernels = not in_torch and cpu_kernels.load()
    for solve, levels in ((_solve_q4, 15), (_solve_q8, 127), (_solve_bf16, None)):  # the most compact form first
        if in_kernels and levels is not None:
            found = cpu_kernels.find_exact_blocks(weight, levels)  # its own check, bit for bit, as _solve's
        elif weight.shape[0] > _SAMPLE_ROWS and solve(weight[:_SAMPLE_ROWS]) is None:
            continue
        else:
            found = _solve_by_rows(solve, weight)
        if found is not None:
            return found
    return None


def _solve_by_rows(solve, weight: torch.Tensor) -> Blocks | None:
    """`solve` over runs of rows of about _CHUNK_BYTES (each block is solved on its own, so the result is
    the same): the dozen passes a solve makes over its rows then read and write temporaries the caches hold."""
    rows = max(1, _CHUNK_BYTES // (weight.shape[1] * weight.element_size()))
    if weight.shape[0] <= rows:
        return solve(weight)
    parts = []
    for start in range(0, weight.shape[0], rows):
        part = solve(weight[start:start + rows])
        if part is None:
            return None
        parts.append(part)
    return tuple(None if parts[0][i] is None else torch.cat([part[i] for part in parts]) for i in range(3))


def _solve_bf16(weight: torch.Tensor) -> Blocks | None:
    """bfloat16: every value survives the round trip to bfloat16 (widening back is exact)."""
    values = weight.to(torch.bfloat16)
    return (values, None, None) if torch.equal(values.float().view(torch.int32), weight.view(torch.int32)) else None


def _solve_q8(weight: torch.Tensor) -> Blocks | None:
    """Q8_0: w = fl(d * q), q in -128..127, d = max |w| / 127 up to its rounding (GGUF stores it as float16)."""
    blocks = _blocks(weight)
    if blocks is None:
        return None
    found = _solve(blocks, None, blocks.abs().amax(-1), 127, torch.int8)
    return None if found is None else (found[0].view(weight.shape), found[1], None)


def _solve_q4(weight: torch.Tensor) -> Blocks | None:
    """Q4_1: w = fl(fl(d * q) + m), q in 0..15, m the block's minimum, d = (max - min) / 15 up to its rounding."""
    blocks = _blocks(weight)
    if blocks is None:
        return None
    m = blocks.amin(-1)
    found = _solve(blocks, m, blocks.amax(-1) - m, 15, torch.uint8)
    return None if found is None else (found[0].view(weight.shape), found[1], m)


def _blocks(weight: torch.Tensor) -> torch.Tensor | None:
    n, k = weight.shape
    blocks = weight.view(n, k // BLOCK, BLOCK)
    # Finite iff its least and greatest values are (both propagate NaN): one reducing pass over the
    # weight, where isfinite(...).all() first writes a mask as large as it.
    return blocks if bool(torch.isfinite(torch.stack(torch.aminmax(blocks))).all()) else None


def _solve(blocks: torch.Tensor, m: torch.Tensor | None, span: torch.Tensor, levels: int,
           q_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q in `q_dtype`, d) with d * q (+ m) == blocks bit for bit, else None. d is span / levels up to its
    own rounding: try its float16 value, that value's float16 neighbours, then the float32 quotient;
    each block keeps the first that rebuilds it (for 4-bit blocks, with every d * q exact). The first
    candidate is tried on every block at once, and solves nearly all of them; the others only on the
    blocks still unsolved, so a model's load pays about one dense pass per weight."""
    shape = span.shape
    flat, span = blocks.reshape(-1, BLOCK), span.reshape(-1)
    m = None if m is None else m.reshape(-1)
    bits = flat.view(torch.int32)
    d_half = (span / levels).to(torch.float16)
    candidates = [(d_half.view(torch.int16) + step).view(torch.float16).float() for step in (0, 1, -1, 2, -2)]
    candidates.append(span / levels)
    d = torch.zeros_like(span)
    zero_span = span == 0  # solved below, not by a scale
    q_range = (-128, 127) if q_dtype == torch.int8 else (0, 15)
    todo = None  # the unsolved blocks' indices; None: every block (the first pass, without gathering)
    for i, cand in enumerate(candidates):
        rows, sub_m, sub_bits = (flat, m, bits) if todo is None else (flat[todo], None if m is None else m[todo], bits[todo])
        if todo is not None:
            cand = cand[todo]
        usable = torch.isfinite(cand) & (cand > 0)
        if todo is None:
            usable &= ~zero_span
        base = rows if sub_m is None else rows - sub_m[:, None]
        cq = (base / torch.where(usable, cand, 1.0)[:, None]).round_().clamp_(*q_range)
        rebuilt = cand[:, None] * cq  # then + m: two roundings, eager torch does not fuse them
        hit = usable
        if sub_m is not None:
            if i == len(candidates) - 1:  # a float16 d times a 4-bit q is always exact; the quotient's may not be
                hit = hit & _exact_products(cand, cq, rebuilt)
            rebuilt = rebuilt + sub_m[:, None]
        hit = hit & (rebuilt.view(torch.int32) == sub_bits).all(-1)
        if todo is None:
            # Unsolved blocks' codes are overwritten below or the weight is rejected; a block of one
            # value got codes 0 (its span, all zeros, over a scale of 1).
            d, q = torch.where(hit, cand, d), cq
            todo = (~(hit | zero_span)).nonzero().squeeze(1)
        else:
            solved_here = todo[hit]
            d[solved_here], q[solved_here] = cand[hit], cq[hit]
            todo = todo[~hit]
        if todo.numel() == 0:
            break
    if todo.numel():
        return None
    # Blocks of zeros (Q8_0: d = 0, q = -1 where the zero is -0.0, as 0 * -1 is) and of one repeated
    # value (Q4_1: q = 0 and d = 0, or -0.0 where m is -0.0, as +0.0 + -0.0 is +0.0).
    if m is None:
        q = torch.where(zero_span[:, None] & torch.signbit(flat), -1.0, q)
    else:
        d = torch.where(zero_span & torch.signbit(m), -0.0, d)
    q = q.to(q_dtype).view(blocks.shape)  # -0.0 codes become 0: the check below sees the integers the GEMM gets
    d, m = d.view(shape), None if m is None else m.view(shape)
    if not _rebuilds(blocks, q, d, m):  # the final word on every special case
        return None
    return q, d


def _rebuilds(blocks: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> bool:
    """Whether the blocks decode to the weight bit for bit, as the GEMM decodes them."""
    rebuilt = d[..., None] * q  # q widened to float32 as it is multiplied: one pass, the same products
    if m is not None:
        inexact = d != d.half().float()  # only these can have a d * q that is not exact
        if bool(inexact.any()) and not bool(_exact_products(d[inexact], q[inexact].float(), rebuilt[inexact]).all()):
            return False
        rebuilt.add_(m[..., None])
    # Bits, not values: -0.0 against +0.0, and NaNs, must differ.
    return torch.equal(rebuilt.view(torch.int32), blocks.view(torch.int32))


def _exact_products(d: torch.Tensor, q: torch.Tensor, products: torch.Tensor) -> torch.Tensor:
    """Per block: whether every float32 d * q (`products`) is exact. The GEMM decodes 4-bit blocks
    in one FMA, round(d * q + m), which is fl(fl(d * q) + m) only then; float16 scales always are."""
    return (products.double() == d.double()[..., None] * q.double()).all(-1)
