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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torch import nn

from tritonllm.layers.rotary import apply_rotary


@dataclass
class AttentionGroup:
    """Sequences attended together: queries padded to [batch, max_q], keys to the table width."""

    block_tables: torch.Tensor  # [batch, max_blocks] int64 (pruned/padding entries point at block 0)
    mask: torch.Tensor  # [batch, 1, max_q, max_blocks * block_size] bool: True = attend
    query_index: torch.Tensor | None  # [batch, max_q] rows of the flat token axis (None: decode, one each)
    output_index: torch.Tensor | None  # flat rows of the [batch * max_q] result that are real tokens
    token_offset: int  # first flat token row of this group
    num_tokens: int
    bias: torch.Tensor | None = None  # decode: mask as 0 / -inf [batch, 1, width], made once per step
    token_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # per_token_rows(), made once per step

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive bias for the decode GEMMs, built by the first layer, reused by the rest."""
        if self.bias is None or self.bias.dtype != dtype:
            keep = self.mask[:, 0]  # [batch, 1, width]
            self.bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
        return self.bias

    def per_token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each real query token as a row of its own: its sequence's block table [tokens, max_blocks]
        and its causal mask [tokens, width]. Built by the first layer, reused by the rest."""
        if self.token_rows is None:
            width = self.mask.shape[-1]
            if self.query_index is None:  # one sequence
                tables = self.block_tables.expand(self.num_tokens, -1)
                mask = self.mask[0, 0, :self.num_tokens]
            else:  # output_index: the real rows of the padded [batch * max_q] query axis
                seq = torch.div(self.output_index, self.mask.shape[2], rounding_mode="floor")
                tables = self.block_tables[seq]
                mask = self.mask.view(-1, width)[self.output_index]
            self.token_rows = (tables.contiguous(), mask.contiguous())
        return self.token_rows


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once by the model runner, shared by layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V go in the pool
    decode: list[AttentionGroup]  # decodes, split by context length so short ones are not padded to long ones
    prefill: AttentionGroup | None
    # (cos, sin), each [num_tokens, 1, head_dim]: looked up once per step by the model, not per layer.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # For a model's sliding-window layers: the same step, each group's mask limited to the window (and,
    # where their K/V have a pool of their own, that pool's slots and block tables: scheduling/window_pool.py).
    sliding: "AttentionMetadata | None" = None
    # (cos, sin) as `rope`, for sliding layers that rotate by frequencies of their own (Gemma 3).
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache: [kv_heads, num_blocks, block_size, head_dim]; k: [tokens, kv_heads, head_dim].

    K and V are rounded to the pool's dtype (`kv_cache_dtype`) as they are stored."""
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


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
    into the paged pool, then attention over each sequence's blocks.

    `softcap`: Gemma 2's capped scores (None: plain softmax attention).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.softcap = scale, softcap

    def forward(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """qkv [tokens, heads + 2 kv_heads, head_dim] -> [tokens, heads, head_dim]."""
        k_cache, v_cache = kv_cache
        q_end, k_end = self.num_heads, self.num_heads + self.num_kv_heads
        qk = apply_rotary(qkv[:, :k_end], *rope)
        write_kv(k_cache, v_cache, qk[:, q_end:], qkv[:, k_end:], meta.slot_mapping)
        return paged_attention(qk[:, :q_end], k_cache, v_cache, meta, self.scale, self.softcap)
