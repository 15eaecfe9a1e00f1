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
gather every chunk's blocks in one copy per layer, back to back, then each chunk is one SDPA call over
its own keys: nothing is padded to the step's longest chunk, and a chunk that starts its sequence
takes SDPA's causal mask, which skips the masked half, rather than a mask tensor (a prefix, a window
or pruned blocks make one, planned once per step). Grouped-query attention folds the query heads
that share a KV head into the decodes' query axis and is SDPA's `enable_gqa` for chunks, so K/V are
never repeated per query head.

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
    """Decodes attended together, padded to the group's widest context."""

    rows: slice  # the group's rows of the step's flat token axis
    tables: torch.Tensor  # [batch, max_blocks] int64 (pruned and padding entries point at block 0)
    mask: torch.Tensor  # [batch, 1, 1, width] bool: True = attend
    bias: torch.Tensor | None = None  # the mask as 0 / -inf [batch, 1, width], made once per step

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        if self.bias is None or self.bias.dtype != dtype:
            keep = self.mask[:, 0]
            self.bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
        return self.bias


def _group(seqs: SequenceBatch, first: int, end: int, block_size: int, window: int | None) -> _Group:
    """Decodes [first, end) of the step as one group, their masks computed from their lengths."""
    device = seqs.block_table.device
    lens = seqs.seq_lens_host[first:end]
    max_blocks = max(-(-n // block_size) for n in lens)
    tables = seqs.block_table[first:end, :max_blocks].long()
    q_pos = seqs.seq_lens[first:end].long() - 1
    key_pos = torch.arange(max_blocks * block_size, device=device)
    mask = key_pos[None, :] <= q_pos[:, None]
    mask &= (tables >= 0).repeat_interleave(block_size, dim=1)  # blocks a pruned context gave back
    if window is not None:  # a sliding layer's query at p sees keys p - window < k <= p
        mask &= key_pos[None, :] > q_pos[:, None] - window
    return _Group(slice(first, end), tables.clamp(min=0), mask[:, None, None])


@dataclass
class _Chunk:
    """One prompt chunk: its query rows, its keys in the step's gathered K/V, and what its queries see."""

    rows: slice  # its rows of the step's flat token axis
    keys: slice  # its context's keys in the gathered [kv_heads, keys, head_dim]
    # [q_len, context] bool, True = attend; None: the chunk starts the sequence and sees its whole causal
    # past, which SDPA's own causal mask (top-left aligned) gives without a mask to read.
    mask: torch.Tensor | None


@dataclass
class _Chunks:
    """The step's prompt chunks: every chunk's blocks back to back, gathered once per layer."""

    flat_tables: torch.Tensor  # [blocks] int64 (pruned entries point at block 0)
    chunks: list[_Chunk]


def _chunks(seqs: SequenceBatch, block_size: int, window: int | None) -> _Chunks:
    """The prompt chunks (the sequences after the decodes), planned from the host's lengths and tables."""
    device = seqs.block_table.device
    starts, lens = seqs.query_start_loc_host, seqs.seq_lens_host
    tables, chunks, offset = [], [], 0
    for i in range(seqs.num_decodes, len(lens)):
        context, q_len = lens[i], starts[i + 1] - starts[i]
        num_blocks = -(-context // block_size)
        table = np.asarray(seqs.block_table_host[i, :num_blocks], dtype=np.int64)
        pruned = bool((table < 0).any())
        mask = None
        if q_len < context or pruned or (window is not None and window < context):
            key_pos = torch.arange(context, device=device)
            q_pos = torch.arange(context - q_len, context, device=device)[:, None]
            mask = key_pos <= q_pos
            if window is not None:  # a sliding layer's query at p sees keys p - window < k <= p
                mask &= key_pos > q_pos - window
            if pruned:  # blocks a pruned context gave back
                kept = torch.from_numpy(table >= 0).to(device).repeat_interleave(block_size)[:context]
                mask &= kept
        tables.append(np.maximum(table, 0))
        chunks.append(_Chunk(slice(starts[i], starts[i + 1]), slice(offset, offset + context), mask))
        offset += num_blocks * block_size
    flat = torch.from_numpy(np.concatenate(tables)).to(device, non_blocking=True)
    return _Chunks(flat, chunks)


def _plan(seqs: SequenceBatch, block_size: int, window: int | None) -> tuple[list[_Group], _Chunks | None]:
    """The step's decode groups and prompt chunks for layers of this `window`, made by the first such layer,
    kept for the rest."""
    if window not in seqs.plans:
        decode_blocks = [-(-n // block_size) for n in seqs.seq_lens_host[:seqs.num_decodes]]
        groups = [_group(seqs, a, b, block_size, window) for a, b in decode_groups(decode_blocks)]
        chunks = _chunks(seqs, block_size, window) if len(seqs.seq_lens_host) > seqs.num_decodes else None
        seqs.plans[window] = groups, chunks
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


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, softcap: float | None = None) -> torch.Tensor:
    """One prompt chunk. q: [q_len, heads, head_dim], k and v: [kv_heads, context, head_dim] ->
    [q_len, heads, head_dim]. Its own SDPA call: nothing padded, and the causal half skipped where the
    chunk starts its sequence."""
    num_heads, kv_heads = q.shape[1], k.shape[0]
    q = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d] (a strided view; SDPA reads it in place)
    k, v = k.unsqueeze(0), v.unsqueeze(0)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=num_heads != kv_heads)
    else:  # SDPA cannot cap the scores: the same three steps written out
        per_kv = num_heads // kv_heads
        k, v = k.repeat_interleave(per_kv, dim=1), v.repeat_interleave(per_kv, dim=1)
        scores = _soft_cap(torch.matmul(q, k.transpose(-1, -2)).mul_(scale), softcap)
        if mask is None:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril_()
        scores.masked_fill_(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: SequenceBatch,
                    scale: float, softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim] (K/V already written) -> [tokens, heads, head_dim].

    `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2). `window`: each
    query sees only its last `window` positions (a sliding layer)."""
    out = torch.empty_like(q)
    groups, chunks = _plan(seqs, k_cache.shape[2], window)
    for g in groups:
        out[g.rows] = _decode_group(q[g.rows], k_cache, v_cache, g, scale, softcap)
    if chunks is not None:
        head_dim = k_cache.shape[-1]
        k = _gather(k_cache, chunks.flat_tables).view(k_cache.shape[0], -1, head_dim).to(q.dtype)
        v = _gather(v_cache, chunks.flat_tables).view(v_cache.shape[0], -1, head_dim).to(q.dtype)
        for c in chunks.chunks:
            out[c.rows] = _attend_chunk(q[c.rows], k[:, c.keys], v[:, c.keys], c.mask, scale, softcap)
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
