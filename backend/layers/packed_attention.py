"""Bidirectional attention over packed texts (no KV cache), with bounded padding.

Texts arrive back to back on one token axis, sorted by length. They are split into groups of
similar length (a group's padding is at most `MAX_PADDING` of its real tokens); each group is one
`scaled_dot_product_attention` call over [texts, max_len], with a key mask only when its lengths
differ. Padding a whole mixed batch to its longest text would spend much of its time on padded
attention; grouping removes nearly all of that for a few extra kernel calls per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_PADDING = 0.2  # padded slots / real tokens allowed in one group


@dataclass
class LengthGroup:
    """Texts [first text .. ] occupying token rows [start, end) of the packed axis."""

    start: int
    end: int
    num_texts: int
    max_len: int
    pad_index: torch.Tensor | None  # [num_texts, max_len] rows within the group (padding -> 0); None: equal lengths
    unpad_index: torch.Tensor | None  # [end - start] rows of the flattened [num_texts * max_len] output
    key_mask: torch.Tensor | None  # [num_texts, 1, 1, max_len] bool, True = real token

    def to(self, device: torch.device, non_blocking: bool = False) -> "LengthGroup":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return LengthGroup(self.start, self.end, self.num_texts, self.max_len, move(self.pad_index),
                              move(self.unpad_index), move(self.key_mask))

    def pin_memory(self) -> "LengthGroup":
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return LengthGroup(self.start, self.end, self.num_texts, self.max_len, pin(self.pad_index),
                              pin(self.unpad_index), pin(self.key_mask))


def group_lengths(lens: list[int], max_padding: float = MAX_PADDING) -> list[tuple[int, int]]:
    """Split ascending lengths into [first, last) text ranges whose padding stays within bounds."""
    groups, first, total = [], 0, 0
    for i, n in enumerate(lens):
        if i > first and (i + 1 - first) * n - (total + n) > max_padding * (total + n):
            groups.append((first, i))
            first, total = i, 0
        total += n
    groups.append((first, len(lens)))
    return groups


def make_groups(lens: list[int]) -> list[LengthGroup]:
    """Attention groups for texts of these lengths (ascending), as host tensors."""
    if any(a > b for a, b in zip(lens, lens[1:])):
        raise ValueError("texts must be sorted by length (ascending)")
    groups, start = [], 0
    for first, last in group_lengths(lens):
        glens = lens[first:last]
        num, max_len, num_tokens = last - first, glens[-1], sum(glens)
        pad_index = unpad_index = key_mask = None
        if glens[0] != max_len:
            lens_t = torch.tensor(glens, dtype=torch.int64)
            starts = torch.cumsum(lens_t, 0) - lens_t
            slot = torch.arange(max_len, dtype=torch.int64)
            real = slot.unsqueeze(0) < lens_t.unsqueeze(1)  # [num, max_len]
            pad_index = torch.where(real, starts.unsqueeze(1) + slot, torch.zeros((), dtype=torch.int64))
            unpad_index = torch.nonzero(real.view(-1)).view(-1)  # row-major: text by text, in token order
            key_mask = real.view(num, 1, 1, max_len)
        groups.append(LengthGroup(start, start + num_tokens, num, max_len, pad_index, unpad_index, key_mask))
        start += num_tokens
    return groups


def packed_attention(qkv: torch.Tensor, groups: list[LengthGroup], num_heads: int, head_dim: int) -> torch.Tensor:
    """qkv: [tokens, 3 * heads * head_dim] (Q, K, V blocks) -> [tokens, heads * head_dim]."""
    outs = []
    for g in groups:
        rows = qkv[g.start:g.end]
        if g.pad_index is not None:
            rows = rows[g.pad_index]  # [num_texts, max_len, 3 * hidden]
        rows = rows.view(g.num_texts, g.max_len, 3, num_heads, head_dim)
        q, k, v = (rows[:, :, i].transpose(1, 2) for i in range(3))  # [texts, heads, max_len, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.key_mask)
        out = out.transpose(1, 2).reshape(g.num_texts * g.max_len, num_heads * head_dim)
        outs.append(out if g.unpad_index is None else out[g.unpad_index])
    return outs[0] if len(outs) == 1 else torch.cat(outs)
