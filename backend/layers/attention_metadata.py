"""What attention needs for one step, built once by the model runner and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tritonllm.layers.lora import LoraBatch


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
    # (the torch reference's groups and masks by window; the CPU kernel's rows, devices/cpu/attention_rows.py).
    plans: dict = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once by the model runner, shared by layers.

    The step's sequences as lengths and block tables (`seqs`): each attention implementation derives
    what its queries see from them, on the device (a sliding layer applies its window itself)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V go in the pool
    seqs: SequenceBatch
    # (cos, sin), each [num_tokens, 1, head_dim]: looked up once per step by the model, not per layer.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # For a model's sliding-window layers whose K/V have a pool of their own (scheduling/window_pool.py):
    # the same step with that pool's slots and block tables (None: every layer reads the one pool).
    sliding: "AttentionMetadata | None" = None
    # (cos, sin) as `rope`, for sliding layers that rotate by frequencies of their own (Gemma 3).
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # Multi-LoRA: which rows use which adapter slot (layers/lora.py); None: every row is the base model's.
    # Not attention's, but the step's one context object is where the layers find it.
    lora: "LoraBatch | None" = None
