"""Paged attention through our C++ kernel (csrc/paged_decode_attention.cpp), K/V read in place from the
pool: no step copies the contexts. Prompt tokens go through the same kernel, each token a query row
of its own, so nothing is gathered or padded between prompts.
"""

from __future__ import annotations

import torch

from tritonllm.devices.cpu import kernels
from tritonllm.devices.cpu.attention_rows import attention_rows
from tritonllm.layers.attention_metadata import SequenceBatch


def kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: SequenceBatch,
                     scale: float, window: int | None = None) -> torch.Tensor:
    """`paged_attention` through the kernel, every row of the step in one call: q [tokens, heads, head_dim]
    -> [tokens, heads, head_dim]. Each row reads its sequence's blocks in `seqs.block_table` up to its
    position (within its last `window` positions for a sliding layer: attention_rows.py)."""
    row_seq, row_end, row_start = attention_rows(seqs, window)
    return kernels.paged_decode_attention(q, k_cache, v_cache, seqs.block_table, row_seq, row_end, row_start, scale)
