"""Attention over the paged KV cache, in torch ops that run on any device.

The step's tokens are flattened (no padding between sequences): decode tokens first, then the
prompt chunks. New K/V are written into the block pool through `slot_mapping`; each group then
attends over its sequences' block tables. Grouped-query attention folds the query heads that share
a KV head into the query-length axis, so K/V are never repeated per query head.

The pool is head-major, [kv_heads, num_blocks, block_size, head_dim] per layer: gathering one KV
head's blocks for a batch gives a contiguous [batch, context, head_dim] matrix that batched GEMMs
read as they are. Decodes (one query per sequence) use exactly that: per KV head, one gather of K
and V, then QK^T, softmax and PV as two batched GEMMs; SDPA's fixed cost per (sequence, head) is
not amortised by a single query row. Prompt chunks use SDPA (many query rows per sequence).

`PagedAttention` is the layer a model holds; a device backend may replace it with a subclass that
runs the same computation through its own kernels (devices/).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.layers.attention_metadata import AttentionGroup, AttentionMetadata
from tritonllm.layers.kv_layout import write_kv
from tritonllm.layers.rotary import apply_rotary


def _gather(cache: torch.Tensor, flat_tables: torch.Tensor) -> torch.Tensor:
    """Whole blocks of every KV head: [kv_heads, len(flat_tables), block_size * head_dim].

    index_select on a [.., num_blocks, block_bytes] view is a plain row copy, several times faster
    on CPU than advanced indexing of the 4-D pool.
    """
    return torch.index_select(cache.view(cache.shape[0], cache.shape[1], -1), 1, flat_tables)


def _soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap), in place (Gemma 2's attention logit soft-capping), before the mask."""
    return scores.div_(cap).tanh_().mul_(cap)


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup,
                  scale: float, softcap: float | None = None) -> torch.Tensor:
    """One query per sequence. q: [batch, heads, head_dim] -> [batch, heads, head_dim]."""
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    per_kv = num_heads // kv_heads
    width = group.block_tables.shape[1] * k_cache.shape[2]
    flat_tables = group.block_tables.reshape(-1)
    bias = group.additive_mask(q.dtype).expand(batch, per_kv, width)
    q = q.view(batch, kv_heads, per_kv, head_dim)
    out = q.new_empty(kv_heads, batch, per_kv, head_dim)  # each head's result written in place
    for h in range(kv_heads):
        k = torch.index_select(k_cache[h].view(k_cache.shape[1], -1), 0, flat_tables).view(batch, width, head_dim)
        v = torch.index_select(v_cache[h].view(v_cache.shape[1], -1), 0, flat_tables).view(batch, width, head_dim)
        k, v = k.to(q.dtype), v.to(q.dtype)  # a no-op unless kv_cache_dtype differs from the model's
        if softcap is None:
            scores = torch.baddbmm(bias, q[:, h], k.transpose(1, 2), alpha=scale)  # [batch, per_kv, width]
        else:
            scores = _soft_cap(torch.bmm(q[:, h], k.transpose(1, 2)).mul_(scale), softcap).add_(bias)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        torch.bmm(probs, v, out=out[h])
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup,
                  scale: float, softcap: float | None = None) -> torch.Tensor:
    """Prompt chunks. q: [batch, max_q, heads, head_dim] -> [batch, max_q, heads, head_dim]."""
    batch, max_q, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    per_kv = num_heads // kv_heads
    width = group.block_tables.shape[1] * k_cache.shape[2]
    flat_tables = group.block_tables.reshape(-1)
    # -> [batch, kv_heads, width, d] (a strided view; SDPA reads it in place)
    k = _gather(k_cache, flat_tables).to(q.dtype).view(kv_heads, batch, width, head_dim).transpose(0, 1)
    v = _gather(v_cache, flat_tables).to(q.dtype).view(kv_heads, batch, width, head_dim).transpose(0, 1)
    # [batch, max_q, kv_heads, per_kv, d] -> [batch, kv_heads, max_q * per_kv, d]
    q = q.view(batch, max_q, kv_heads, per_kv, head_dim).permute(0, 2, 1, 3, 4).reshape(
        batch, kv_heads, max_q * per_kv, head_dim)
    mask = group.mask
    if max_q > 1 and per_kv > 1:
        mask = mask.repeat_interleave(per_kv, dim=2)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:  # SDPA cannot cap the scores: the same three steps written out
        scores = _soft_cap(torch.matmul(q, k.transpose(-1, -2)).mul_(scale), softcap).masked_fill_(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)
    return out.view(batch, kv_heads, max_q, per_kv, head_dim).permute(0, 2, 1, 3, 4).reshape(
        batch, max_q, num_heads, head_dim)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, softcap: float | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim] (K/V already written) -> [tokens, heads, head_dim].

    `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2)."""
    out = torch.empty_like(q)
    for g in meta.decode:
        rows = slice(g.token_offset, g.token_offset + g.num_tokens)
        out[rows] = _decode_group(q[rows], k_cache, v_cache, g, scale, softcap)
    if meta.prefill is not None:
        g = meta.prefill
        if g.query_index is None:  # a single prompt chunk: no padding needed
            q_pre = q[g.token_offset:g.token_offset + g.num_tokens].unsqueeze(0)
            out[g.token_offset:] = _attend_group(q_pre, k_cache, v_cache, g, scale, softcap).squeeze(0)
        else:
            q_pre = q[g.query_index]
            res = _attend_group(q_pre, k_cache, v_cache, g, scale, softcap)
            out[g.token_offset:] = res.reshape(-1, *res.shape[2:])[g.output_index]
    return out


class PagedAttention(nn.Module):
    """One layer's attention after its QKV projection: rotary embedding on Q and K, K and V written
    into the paged pool, then attention over each sequence's blocks. This is the torch reference, on a
    head-major pool; a device backend may turn it into a subclass that does the same through its own
    kernels (devices/).

    `window`: a sliding-window layer's window (None: it attends to the whole context). The reference
    reads it from the step's masks (`AttentionMetadata.sliding`); kernels that take lengths apply it
    themselves. `softcap`: Gemma 2's capped scores (None: plain softmax attention).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, softcap: float | None = None,
                 window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.softcap, self.window = scale, softcap, window

    def forward(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """qkv [tokens, heads + 2 kv_heads, head_dim] -> [tokens, heads, head_dim]."""
        k_cache, v_cache = kv_cache
        q_end, k_end = self.num_heads, self.num_heads + self.num_kv_heads
        qk = apply_rotary(qkv[:, :k_end], *rope)
        write_kv(k_cache, v_cache, qk[:, q_end:], qkv[:, k_end:], meta.slot_mapping)
        return paged_attention(qk[:, :q_end], k_cache, v_cache, meta, self.scale, self.softcap)
