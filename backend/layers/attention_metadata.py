"""What attention needs for one step, built once by the model runner and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionGroup:
    """Sequences attended together, the form our CPU kernels read (devices/cpu/fused_layers.py):
    queries padded to [batch, max_q], keys to the table width, what each query sees as a mask."""

    block_tables: torch.Tensor  # [batch, max_blocks] int64 (pruned/padding entries point at block 0)
    mask: torch.Tensor  # [batch, 1, max_q, max_blocks * block_size] bool: True = attend
    query_index: torch.Tensor | None  # [batch, max_q] rows of the flat token axis (None: decode, one each)
    output_index: torch.Tensor | None  # flat rows of the [batch * max_q] result that are real tokens
    token_offset: int  # first flat token row of this group
    num_tokens: int
    token_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # per_token_rows(), made once per step

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
    """The step's sequences as lengths and block tables: decodes first, one token each, then the prompt
    chunks. Block-table entries of -1 are blocks a sequence gave back (behind a sliding window, or
    pruned by kv_window)."""

    query_start_loc: torch.Tensor  # [n + 1] int32: sequence i's tokens are rows [q[i], q[i + 1])
    seq_lens: torch.Tensor  # [n] int32: its context after this step's tokens
    block_table: torch.Tensor  # [n, max_blocks] int32 (padding entries 0)
    num_decodes: int
    # The same on the host, for kernels that plan or size their work there.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    block_table_host: np.ndarray
    # What an attention implementation derives from the above once per step, for all layers alike
    # (the torch reference's groups and masks, by window).
    plans: dict = field(default_factory=dict)

    @property
    def max_query_len(self) -> int:
        return max(b - a for a, b in zip(self.query_start_loc_host, self.query_start_loc_host[1:]))


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once by the model runner, shared by layers.

    The step's sequences as lengths and block tables (`seqs`), and, where the device backend's kernels
    read them (our CPU kernels), also as `decode` and `prefill` groups with masks."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V go in the pool
    seqs: SequenceBatch
    decode: list[AttentionGroup] = field(default_factory=list)
    prefill: AttentionGroup | None = None
    # (cos, sin), each [num_tokens, 1, head_dim]: looked up once per step by the model, not per layer.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # For a model's sliding-window layers: the same step with that pool's slots and block tables where
    # their K/V have a pool of their own (scheduling/window_pool.py), and the groups' masks limited to
    # the window. Kernels that take lengths apply the window themselves.
    sliding: "AttentionMetadata | None" = None
    # (cos, sin) as `rope`, for sliding layers that rotate by frequencies of their own (Gemma 3).
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
