"""What attention needs for one step, built once by the model runner and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


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
class SequenceBatch:
    """The step's sequences as lengths and block tables, the form the accelerators' paged-attention
    kernels take (no masks): decodes first, one token each, then the prompt chunks."""

    query_start_loc: torch.Tensor  # [n + 1] int32: sequence i's tokens are rows [q[i], q[i + 1])
    seq_lens: torch.Tensor  # [n] int32: its context after this step's tokens
    block_table: torch.Tensor  # [n, max_blocks] int32 (padding entries 0)
    num_decodes: int
    # The same on the host, for kernels that plan or size their work there.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    block_table_host: np.ndarray

    @property
    def max_query_len(self) -> int:
        return max(b - a for a, b in zip(self.query_start_loc_host, self.query_start_loc_host[1:]))


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once by the model runner, shared by layers.

    A step carries its sequences in the form its device backend's attention reads: `decode` and
    `prefill` groups with masks (the torch reference, the CPU kernels), or `seqs` (lengths and block
    tables: the accelerators' kernels)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V go in the pool
    decode: list[AttentionGroup] = field(default_factory=list)  # decodes, split by context length
    prefill: AttentionGroup | None = None
    seqs: SequenceBatch | None = None
    # (cos, sin), each [num_tokens, 1, head_dim]: looked up once per step by the model, not per layer.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # For a model's sliding-window layers: the same step, each group's mask limited to the window (and,
    # where their K/V have a pool of their own, that pool's slots and block tables: scheduling/window_pool.py).
    # With `seqs`, the kernels apply the window themselves; this then only carries that pool's slots and tables.
    sliding: "AttentionMetadata | None" = None
    # (cos, sin) as `rope`, for sliding layers that rotate by frequencies of their own (Gemma 3).
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
