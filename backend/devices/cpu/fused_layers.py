"""The model's attention, norms and MLP activation on our C++ kernels (float32 CPU).

Each class here is a subclass of the plain layer that only replaces how it computes, with the same
parameters: `use_fused_layers` turns a loaded model's layers into them in place.
- Attention: rotary + KV write in one pass, then paged attention that reads K/V in place from the
  pool (csrc/paged_decode_attention.cpp): no step copies the contexts. Prompt tokens go through the
  same kernel, each token a query row of its own with its causal mask (`per_token_rows`), so
  nothing is gathered or padded between prompts. The kernel does not cap scores: a layer with
  Gemma 2's soft cap keeps the torch attention after the fused rotary + KV write.
- RMSNorm: the residual add and the norm in one pass.
- Gated MLP: SiLU(gate) * up in one pass (other activations keep the torch ops).
"""

from __future__ import annotations

import torch

from tritonllm.devices.cpu import kernels
from tritonllm.layers.attention import PagedAttention, paged_attention
from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.layers.norm import RMSNorm
from tritonllm.models.mlp import GatedMLP


def kernel_calls(meta: AttentionMetadata, num_tokens: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """The paged_decode_attention calls that cover the step's query rows, as (first row, end row,
    block tables, mask [rows, width]): one per decode group, then one for the prompt chunks (each
    prompt token one query row with its causal mask)."""
    calls = [(g.token_offset, g.token_offset + g.num_tokens, g.block_tables, g.mask.view(g.mask.shape[0], -1))
             for g in meta.decode]
    if meta.prefill is not None:
        calls.append((meta.prefill.token_offset, num_tokens, *meta.prefill.per_token_rows()))
    return calls


def kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """`paged_attention` through the kernel: q [tokens, heads, head_dim] -> [tokens, heads, head_dim]."""
    calls = kernel_calls(meta, len(q))
    if len(calls) == 1:  # most steps: the kernel's result is the whole output, no copy into one
        return kernels.paged_decode_attention(q, k_cache, v_cache, calls[0][2], calls[0][3], scale)
    out = torch.empty_like(q)
    for start, end, tables, mask in calls:
        out[start:end] = kernels.paged_decode_attention(q[start:end], k_cache, v_cache, tables, mask, scale)
    return out


class FusedPagedAttention(PagedAttention):
    def forward(self, qkv, rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        q = kernels.rope_write_kv(qkv, *rope, k_cache, v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads)
        if self.softcap is not None:
            return paged_attention(q, k_cache, v_cache, meta.seqs, self.scale, self.softcap, self.window)
        return kernel_attention(q, k_cache, v_cache, meta, self.scale)


class FusedRMSNorm(RMSNorm):
    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return kernels.add_rms_norm_(residual, x, self.weight, self.eps)


class FusedSiluMLP(GatedMLP):
    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_mul(gate_up)


def use_fused_layers(model: torch.nn.Module) -> None:
    """Turn every attention, RMSNorm and SiLU-gated MLP of `model` into its fused kind, in place.

    The fused classes add no state, so each module keeps its parameters and its place in the model;
    only its class (what its forward runs) changes."""
    for module in model.modules():
        if type(module) is PagedAttention:
            module.__class__ = FusedPagedAttention
        elif type(module) is RMSNorm:
            module.__class__ = FusedRMSNorm
        elif type(module) is GatedMLP and module.activation == "silu":
            module.__class__ = FusedSiluMLP
