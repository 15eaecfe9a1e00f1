"""Rotary position embedding with the model's own theta and scaling (inv_freq from transformers)."""

from __future__ import annotations

import torch
from torch import nn


def rope_by_layer_type(hf_config) -> bool:
    """Whether the model's sliding and full attention layers rotate by frequencies of their own (Gemma 3:
    `rope_parameters` keyed by layer type)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return "sliding_attention" in params or "full_attention" in params


def rope_inv_freq(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling exactly as transformers computes them (for the layers of
    `layer_type`, when the config keys them by layer type)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if layer_type is not None:
            return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", layer_type=layer_type)
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table over all positions; applied to q and k heads in one op."""

    def __init__(self, hf_config, head_dim: int, max_position: int, layer_type: str | None = None):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config, head_dim, layer_type)
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions: [tokens, 1, head_dim], shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] -> rotated copy (rotate-half convention)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
