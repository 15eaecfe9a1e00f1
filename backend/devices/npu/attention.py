"""Paged attention on Ascend NPUs through torch_npu's fused operators.

The pools are token-major ([blocks, block_size, kv_heads, head_dim]), as torch_npu's paged attention
reads them. K and V are written with its reshape-and-cache operator; attention over the whole step
(decodes and prompt chunks, causal within each sequence) is one fused infer attention score call on
the step's lengths and block tables, in its packed-token layout (TND).
"""

from __future__ import annotations

import torch

from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.layers.rotary import apply_rotary

# The operator takes causal attention as a fixed-size upper-triangular mask (its sparse mode 3).
CAUSAL_MASK_SIZE = 2048


def causal_mask(device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)


class NpuAttention(PagedAttention):
    """`PagedAttention` on torch_npu; `mask` (causal_mask) is set by the Ascend backend."""

    mask: torch.Tensor

    def forward(self, qkv, rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        import torch_npu

        k_cache, v_cache = kv_cache
        q_end, k_end = self.num_heads, self.num_heads + self.num_kv_heads
        qk = apply_rotary(qkv[:, :k_end], *rope)
        torch_npu._npu_reshape_and_cache(key=qk[:, q_end:].contiguous(), value=qkv[:, k_end:].contiguous(),
                                         key_cache=k_cache, value_cache=v_cache,
                                         slot_indices=meta.slot_mapping.to(torch.int32))
        seqs = meta.seqs
        if "npu_block_table" not in seqs.plans:  # blocks given back (-1) lie behind the window it does not read
            seqs.plans["npu_block_table"] = seqs.block_table.clamp(min=0)
        num_blocks, block_size = k_cache.shape[:2]
        out, _ = torch_npu.npu_fused_infer_attention_score(
            qk[:, :q_end].contiguous(), k_cache.view(num_blocks, block_size, -1),
            v_cache.view(num_blocks, block_size, -1), atten_mask=self.mask, block_table=seqs.plans["npu_block_table"],
            input_layout="TND", block_size=block_size, actual_seq_lengths=seqs.query_start_loc_host[1:],
            actual_seq_lengths_kv=seqs.seq_lens_host, num_key_value_heads=self.num_kv_heads,
            num_heads=self.num_heads, scale=self.scale, sparse_mode=3)
        return out
