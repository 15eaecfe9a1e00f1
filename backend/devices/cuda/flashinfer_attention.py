"""Paged attention on NVIDIA GPUs through FlashInfer (PyPI `flashinfer-python`).

The pools are token-major ([blocks, block_size, kv_heads, head_dim], FlashInfer's NHD layout). Each
step is planned once, on the host, from its lengths and block tables (`SequenceBatch`): one wrapper
per kind of layer (window, soft cap, scale, head counts), planned before the forward and run by every
layer of that kind. A batch-prefill wrapper takes the whole step, decodes (one query each) and
prompt chunks together, causal within each sequence.

What the planning arrays mean is FlashInfer's documentation (docs/tutorials/kv_layout.rst, "Page Table
Layout"; the wrappers' `plan` docstrings); tests/flashinfer_reference.py is a CPU reference of exactly
that, which the contract tests run these plans through (tests/test_flashinfer_contract.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.attention_metadata import AttentionMetadata, SequenceBatch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace, shared by the wrappers (they run one at a time)


@dataclass(frozen=True)
class LayerKind:
    """What a plan depends on besides the step: layers alike share one."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    softcap: float | None
    window: int | None

    @classmethod
    def of(cls, layer: PagedAttention) -> "LayerKind":
        return cls(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale, layer.softcap, layer.window)


def paged_kv_csr(seqs: SequenceBatch, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's page table: per-sequence page counts as offsets (indptr), the pages one sequence
    after another (indices), and how many tokens each sequence's last page holds."""
    lens = np.asarray(seqs.seq_lens_host, dtype=np.int64)
    pages = -(-lens // block_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    # A block given back (-1) lies behind the layer's window, which the kernel does not read.
    indices = np.concatenate([seqs.block_table_host[i, :n] for i, n in enumerate(pages)]).clip(min=0).astype(np.int32)
    return indptr, indices, (lens - (pages - 1) * block_size).astype(np.int32)


class FlashInferPlans:
    """One FlashInfer wrapper per kind of layer, planned for each step by `plan`."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 block_size: int, flashinfer=None):
        """`flashinfer`: the module whose wrappers plan and run attention: FlashInfer's own unless another
        with the same documented interface is given (the contract tests give a CPU reference of it)."""
        if flashinfer is None:
            import flashinfer

        self.flashinfer = flashinfer
        self.device, self.dtype, self.kv_dtype, self.block_size = device, dtype, kv_dtype, block_size
        self.workspace = workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        kinds = {LayerKind.of(m) for m in model.modules() if isinstance(m, PagedAttention)}
        self.wrappers = {kind: flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD") for kind in kinds}
        self.active: dict | None = None  # while a decode graph is captured: its wrappers (graphs.py)

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan every kind's wrapper for this step; a sliding kind on the sliding layers' own pool's tables."""
        for kind, wrapper in self.wrappers.items():
            seqs = meta.sliding.seqs if kind.window is not None and meta.sliding is not None else meta.seqs
            indptr, indices, last_page_len = paged_kv_csr(seqs, self.block_size)
            wrapper.plan(torch.tensor(seqs.query_start_loc_host, dtype=torch.int32), torch.from_numpy(indptr),
                         torch.from_numpy(indices).to(self.device), torch.from_numpy(last_page_len),
                         kind.num_heads, kind.num_kv_heads, kind.head_dim, self.block_size, causal=True,
                         window_left=-1 if kind.window is None else kind.window - 1,
                         logits_soft_cap=kind.softcap, sm_scale=kind.scale, q_data_type=self.dtype,
                         kv_data_type=self.kv_dtype)
