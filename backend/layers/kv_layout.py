"""How a layer's K and V pools are laid out, and the operations that depend on it.

The torch reference attention and our CPU kernels gather each KV head's blocks for a batch, so their
pools are head-major: [kv_heads, blocks, block_size, head_dim]. The accelerators' paged-attention
kernels (FlashInfer's NHD layout, torch_npu's paged attention) read each token's heads together, so
theirs are token-major: [blocks, block_size, kv_heads, head_dim]. A device backend says which it
needs (`DeviceBackend.kv_layout`); a slot is block * block_size + offset in both.
"""

from __future__ import annotations

import torch

from tritonllm.layers.fp8 import is_fp8, to_fp8_saturated

HEAD_MAJOR = "head_major"
TOKEN_MAJOR = "token_major"


def pool_shape(layout: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    if layout == HEAD_MAJOR:
        return kv_heads, num_blocks, block_size, head_dim
    if layout == TOKEN_MAJOR:
        return num_blocks, block_size, kv_heads, head_dim
    raise ValueError(f"unknown KV layout {layout!r}")


def by_slot(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The pool as one row per slot: [slots, kv_heads, head_dim] (token-major), or [kv_heads, slots,
    head_dim] (head-major, each head's slots in a row)."""
    if layout == HEAD_MAJOR:
        return cache.view(cache.shape[0], -1, cache.shape[-1])
    return cache.view(-1, cache.shape[-2], cache.shape[-1])


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, layout: str = HEAD_MAJOR) -> None:
    """Store the step's K and V ([tokens, kv_heads, head_dim]) at their slots, rounded to the pool's
    dtype (`kv_cache_dtype`; FP8 saturates at its largest value, layers/fp8.py)."""
    k, v = _stored(k, k_cache.dtype), _stored(v, v_cache.dtype)
    k_cache, v_cache = _rows_of(k_cache), _rows_of(v_cache)
    if layout == HEAD_MAJOR:
        by_slot(k_cache, layout).index_copy_(1, slot_mapping, k.transpose(0, 1))
        by_slot(v_cache, layout).index_copy_(1, slot_mapping, v.transpose(0, 1))
    else:
        by_slot(k_cache, layout).index_copy_(0, slot_mapping, k)
        by_slot(v_cache, layout).index_copy_(0, slot_mapping, v)


def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as the pool stores it (FP8 as its bytes: torch's index_copy_ has no FP8 kernels on every device)."""
    if is_fp8(dtype):
        return to_fp8_saturated(t, dtype).view(torch.uint8)
    return t.to(dtype)


def _rows_of(cache: torch.Tensor) -> torch.Tensor:
    """The pool itself, or an FP8 pool's bytes (copies move them as they are)."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def copy_slots(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, layout: str = HEAD_MAJOR) -> None:
    """cache[dst] = cache[src], slot by slot; every source is read before any destination is written."""
    rows = by_slot(_rows_of(cache), layout)
    if layout == HEAD_MAJOR:
        rows[:, dst] = rows[:, src]
    else:
        rows[dst] = rows[src]
