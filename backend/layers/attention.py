"""Attention over the paged KV cache, in torch ops that run on any device: the reference.

A step's sequences arrive as lengths and block tables (`SequenceBatch`): decodes first, one token
each, then the prompt chunks, their tokens flattened with no padding between them. New K/V are
written into the block pool through `slot_mapping`; each sequence's queries then attend over the
blocks of its table. What a query may see (its causal past, within its window for a sliding layer,
not the blocks a pruned context gave back) is derived here, on the device, from the lengths, once
per step for all layers; nothing the size of the context is built on the host.

The pool is head-major, [kv_heads, num_blocks, block_size, head_dim] per layer: gathering one KV
head's blocks for a batch gives a contiguous [batch, context, head_dim] matrix that batched GEMMs
read as they are. Decodes (one query per sequence) use exactly that, in groups of similar length
(`decode_groups`): per KV head, one gather of K and V, then QK^T, softmax and PV as two batched
GEMMs; SDPA's fixed cost per (sequence, head) is not amortised by a single query row. Prompt chunks
use SDPA over their gathered blocks. Grouped-query attention folds the query heads that share a KV
head into the query axis, so K/V are never repeated per query head.

`PagedAttention` is the layer a model holds; it calls the model's ops (layers/ops.py), whose torch
reference is `paged_attention` here and whose device implementations live in devices/.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.layers.attention_metadata import AttentionMetadata, SequenceBatch

# Decodes are split into up to this many groups by context length: each group is padded to its
# longest context, so mixed lengths gather less K/V in several groups. A group costs a fixed
# GROUP_COST_BLOCKS (a few small ops per KV head and layer) on top of the blocks it gathers.
MAX_DECODE_GROUPS = 4
GROUP_COST_BLOCKS = 64


def decode_groups(blocks: list[int], max_groups: int = MAX_DECODE_GROUPS) -> list[tuple[int, int]]:
    """Cut decodes, sorted by their contexts' block counts `blocks`, into up to `max_groups` runs
    [start, end) that gather the fewest blocks in all: dynamic programming over the sorted counts
    (64 sequences x 4 groups: microseconds)."""
    if not blocks:
        return []
    n = len(blocks)
    inf = float("inf")
    # best[k][j]: least cost of the first j sequences in k groups; cut[k][j]: where the last group starts
    best = [[inf] * (n + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0
    for k in range(1, max_groups + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                cost = best[k - 1][i] + (j - i) * blocks[j - 1] + GROUP_COST_BLOCKS
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    k = min(range(1, max_groups + 1), key=lambda g: best[g][n])
    bounds, j = [], n
    while k > 0:
        i = cut[k][j]
        bounds.append((i, j))
        j, k = i, k - 1
    return list(reversed(bounds))


@dataclass
class _Group:
    """Sequences attended together, padded to the group's widest context and longest chunk."""

    rows: slice  # the group's rows of the step's flat token axis
    tables: torch.Tensor  # [batch, max_blocks] int64 (pruned and padding entries point at block 0)
    mask: torch.Tensor  # [batch, 1, max_q, width] bool: True = attend
    query_index: torch.Tensor | None = None  # [batch, max_q] flat rows (chunks of several sequences)
    output_index: torch.Tensor | None = None  # the real rows of the padded [batch * max_q] result
    bias: torch.Tensor | None = None  # decodes: the mask as 0 / -inf [batch, 1, width], made once per step

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        if self.bias is None or self.bias.dtype != dtype:
            keep = self.mask[:, 0]
            self.bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
        return self.bias


def _group(seqs: SequenceBatch, first: int, end: int, block_size: int, window: int | None) -> _Group:
    """Sequences [first, end) of the step as one group, their masks computed from their lengths."""
    device = seqs.block_table.device
    starts, lens = seqs.query_start_loc_host[first:end + 1], seqs.seq_lens_host[first:end]
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    max_blocks, max_q = max(-(-n // block_size) for n in lens), max(q_lens)
    tables = seqs.block_table[first:end, :max_blocks].long()
    q_lens_t = torch.tensor(q_lens, device=device)
    q_pos = (seqs.seq_lens[first:end].long() - q_lens_t)[:, None] + torch.arange(max_q, device=device)
    key_pos = torch.arange(max_blocks * block_size, device=device)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    mask &= (tables >= 0).repeat_interleave(block_size, dim=1)[:, None, :]  # blocks a pruned context gave back
    if window is not None:  # a sliding layer's query at p sees keys p - window < k <= p
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
    group = _Group(slice(starts[0], starts[-1]), tables.clamp(min=0), mask[:, None])
    if len(q_lens) > 1 and max_q > 1:
        j = torch.arange(max_q, device=device)[None, :]
        real = j < q_lens_t[:, None]
        group.query_index = torch.tensor(starts[:-1], device=device)[:, None] + torch.minimum(j, q_lens_t[:, None] - 1)
        group.output_index = torch.from_numpy(np.concatenate(
            [i * max_q + np.arange(n) for i, n in enumerate(q_lens)])).to(device, non_blocking=True)
        mask &= real[:, :, None]
        mask[:, :, 0] |= ~real  # padding rows attend somewhere: no NaN from an empty softmax
    return group


def _groups(seqs: SequenceBatch, block_size: int, window: int | None) -> list[_Group]:
    """The step's groups for layers of this `window`, made by the first such layer, kept for the rest."""
    if window not in seqs.plans:
        decode_blocks = [-(-n // block_size) for n in seqs.seq_lens_host[:seqs.num_decodes]]
        groups = [_group(seqs, a, b, block_size, window) for a, b in decode_groups(decode_blocks)]
        if len(seqs.seq_lens_host) > seqs.num_decodes:
            groups.append(_group(seqs, seqs.num_decodes, len(seqs.seq_lens_host), block_size, window))
        seqs.plans[window] = groups
    return seqs.plans[window]


def _gather(cache: torch.Tensor, flat_tables: torch.Tensor) -> torch.Tensor:
    """Whole blocks of every KV head: [kv_heads, len(flat_tables), block_size * head_dim].

    index_select on a [.., num_blocks, block_bytes] view is a plain row copy, several times faster
    on CPU than advanced indexing of the 4-D pool.
    """
    return torch.index_select(cache.view(cache.shape[0], cache.shape[1], -1), 1, flat_tables)


def _soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap), in place (Gemma 2's attention logit soft-capping), before the mask."""
    return scores.div_(cap).tanh_().mul_(cap)


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group,
                  scale: float, softcap: float | None = None) -> torch.Tensor:
    """One query per sequence. q: [batch, heads, head_dim] -> [batch, heads, head_dim]."""
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    per_kv = num_heads // kv_heads
    width = group.tables.shape[1] * k_cache.shape[2]
    flat_tables = group.tables.reshape(-1)
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


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group,
                  scale: float, softcap: float | None = None) -> torch.Tensor:
    """Prompt chunks. q: [batch, max_q, heads, head_dim] -> [batch, max_q, heads, head_dim]."""
    batch, max_q, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    per_kv = num_heads // kv_heads
    width = group.tables.shape[1] * k_cache.shape[2]
    flat_tables = group.tables.reshape(-1)
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


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: SequenceBatch,
                    scale: float, softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim] (K/V already written) -> [tokens, heads, head_dim].

    `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2). `window`: each
    query sees only its last `window` positions (a sliding layer)."""
    out = torch.empty_like(q)
    for g in _groups(seqs, k_cache.shape[2], window):
        if g.query_index is None and g.mask.shape[2] == 1:  # decodes
            out[g.rows] = _decode_group(q[g.rows], k_cache, v_cache, g, scale, softcap)
        elif g.query_index is None:  # a single prompt chunk: no padding needed
            out[g.rows] = _attend_group(q[g.rows].unsqueeze(0), k_cache, v_cache, g, scale, softcap).squeeze(0)
        else:
            res = _attend_group(q[g.query_index], k_cache, v_cache, g, scale, softcap)
            out[g.rows] = res.reshape(-1, *res.shape[2:])[g.output_index]
    return out


class PagedAttention(nn.Module):
    """One layer's attention after its QKV projection: `ops.rotary_write_kv` (rotary embedding on Q and
    K, K and V written into the paged pool), then `ops.attention` over each sequence's blocks. The
    model's ops (layers/ops.py) say which implementation runs: `paged_attention` above is the torch
    reference's.

    `window`: a sliding-window layer's window (None: it attends to the whole context). `softcap`:
    Gemma 2's capped scores (None: plain softmax attention).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ops,
                 softcap: float | None = None, window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.softcap, self.window = scale, softcap, window
        self.ops = ops

    def forward(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """qkv [tokens, heads + 2 kv_heads, head_dim] -> [tokens, heads, head_dim]."""
        q = self.ops.rotary_write_kv(self, qkv, rope, kv_cache, meta.slot_mapping)
        return self.ops.attention(self, q, kv_cache, meta)
