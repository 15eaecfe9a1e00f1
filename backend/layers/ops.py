"""The ops a model's layers call, and their torch reference.

A model is built with one `LayerOps` (models/loader.py `load_model(..., ops)`), handed down to every
layer that computes: `Linear` calls `ops.linear`, `RMSNorm` calls `ops.rms_norm` / `ops.add_rms_norm`,
the gated MLP `ops.act_and_mul`, attention `ops.rotary_write_kv` then `ops.attention`, and the model's
layer loop `ops.decoder_stack` where a device runs the whole stack as one call. This class is the
torch reference, which any device runs; a device backend hands the model a subclass that overrides
the ops it runs through kernels of its own (devices/cpu/ops.py, devices/cuda/ops.py,
devices/npu/ops.py). So what runs is: the model's code, calling these ops, each implemented in the
one ops class its device backend chose. `plan()` names each op's implementation for the load log.

Ops whose implementation keeps weights in a layout of its own prepare them once after load
(`prepare_linear`, called by the device backend's `prepare`); the layer then holds that layout
(`Linear.packed`) instead of its plain weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tritonllm.layers.attention import paged_attention
from tritonllm.layers.activations import ACTIVATIONS
from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.layers.kv_layout import HEAD_MAJOR, write_kv
from tritonllm.layers.lora import LoraBatch, add_lora_delta
from tritonllm.layers.rotary import apply_rotary

if TYPE_CHECKING:
    from tritonllm.layers.attention import PagedAttention
    from tritonllm.layers.linear import Linear

# The declared ops, in the order the plan line names them.
# The LM head is a `Linear` too (its own entry, where its weight is prepared apart); `greedy_head` is the
# device's token choice (devices/head.py), which the backend adds to the plan; `all_reduce`, tensor
# parallelism's sum across ranks (parallel/shard.py), is named by a backend that chooses it.
OPS = ("linear", "lora_delta", "rms_norm", "add_rms_norm", "act_and_mul", "rotary_write_kv", "attention",
       "decoder_stack", "lm_head", "greedy_head", "all_reduce")


class LayerOps:
    """The torch reference of every op: plain torch functions on a head-major KV pool."""

    name = "torch"
    # How this ops set's attention reads the KV pools (layers/kv_layout.py): the runner allocates them so.
    kv_layout = HEAD_MAJOR
    # The whole decoder stack as one call, where a device has one (devices/cpu/decoder_stack.py): an
    # object whose `run(hidden, kv_caches, meta)` returns the final residual stream, or None for a step
    # it does not take (the layers then run one by one). Set by the device backend's `prepare`.
    decoder_stack = None
    # Mixtures of experts run every expert over every token (models/moe.py), so that no count of rows per
    # expert has to reach the host: what an accelerator's step wants, not a CPU's.
    dense_routing = False

    def linear(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if layer.packed is not None:  # a quantized weight (layers/fp8.py) computes its own product
            return layer.packed(x, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def lora_delta(self, layer: "Linear", x: torch.Tensor, y: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """y += each row's adapter delta of `layer` (layers/lora.py: grouped shrink, then expand), in place."""
        return add_lora_delta(y, x, layer.lora, batch)

    def prepare_linear(self, layer: "Linear") -> None:
        """Once after load: the layer's weight into this implementation's own layout (nothing here; a
        device's layout is for a plain weight, and leaves a layer that holds a quantized one as it is)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm in float32 whatever the activation dtype, as the reference models compute it."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place), then the RMSNorm of it."""
        return self.rms_norm(residual.add_(x), weight, eps)

    def act_and_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """[tokens, 2 * width] (gate columns, then up) -> act(gate) * up, [tokens, width]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return ACTIVATIONS[activation](gate) * up

    def rotary_write_kv(self, layer: "PagedAttention", qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                        kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor) -> torch.Tensor:
        """qkv [tokens, heads + 2 kv_heads, head_dim]: rotate Q and K, write K and V into the pool at their
        slots; returns the rotated queries [tokens, heads, head_dim]."""
        q_end, k_end = layer.num_heads, layer.num_heads + layer.num_kv_heads
        qk = apply_rotary(qkv[:, :k_end], *rope)
        write_kv(*kv_cache, qk[:, q_end:], qkv[:, k_end:], slot_mapping, self.kv_layout)
        return qk[:, :q_end]

    def attention(self, layer: "PagedAttention", q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  meta: AttentionMetadata) -> torch.Tensor:
        """q [tokens, heads, head_dim] over each sequence's blocks (K/V already written) -> the same shape."""
        return paged_attention(q, *kv_cache, meta.seqs, layer.scale, layer.softcap, layer.window)

    def plan(self) -> dict[str, str]:
        """Each op's implementation in this ops set, and why where it fell back (for the load log)."""
        return {"linear": "torch", "lora_delta": "torch", "rms_norm": "torch", "add_rms_norm": "torch", "act_and_mul": "torch",
                "rotary_write_kv": "torch", "attention": "torch", "decoder_stack": "off (layer by layer)",
                "lm_head": "torch"}


def describe_plan(plan: dict[str, str]) -> str:
    """The plan as one log line: `op=implementation` in OPS order."""
    return ", ".join(f"{op}={plan[op]}" for op in OPS if op in plan)
