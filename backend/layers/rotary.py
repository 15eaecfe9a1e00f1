"""Rotary position embedding with the model's own theta and scaling (inv_freq from transformers).

A partial rotary embedding (Phi-4-mini's `partial_rotary_factor`: the first `rotary_dim` of each
head's dimensions turn, the rest pass) runs on the full-width path with no op of its own: the loader
reorders each query and key head's dimensions (`rotary_dim_order`) so that the pairs transformers turns
together, (i, i + rotary_dim / 2), sit where the rotate-half convention pairs (j, j + head_dim / 2),
and the table gives the passing pairs cos 1 and sin 0, which leave them exactly as they are. Query
and key heads reordered alike keep every score; the KV pool holds the reordered keys.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_by_layer_type(hf_config) -> bool:
    """Whether the model's sliding and full attention layers rotate by frequencies of their own (Gemma 3:
    `rope_parameters` keyed by layer type)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return "sliding_attention" in params or "full_attention" in params


def partial_rotary_factor(hf_config) -> float:
    """The share of each head's dimensions that turn (transformers 5 keeps it in rope_parameters)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return 1.0 if factor is None else float(factor)


def rotary_dim_order(head_dim: int, rotary_dim: int) -> torch.Tensor | None:
    """The order of a head's dimensions that puts a partial rotary embedding's pairs in rotate-half
    places (new[j] = old[order[j]]); None when every dimension turns."""
    if rotary_dim == head_dim:
        return None
    half, passing = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(half)) + list(range(rotary_dim, rotary_dim + passing))
    second = list(range(half, rotary_dim)) + list(range(rotary_dim + passing, head_dim))
    return torch.tensor(first + second)


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
    dim = int(head_dim * partial_rotary_factor(hf_config))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table over all positions; applied to q and k heads in one op.

    `dim_order`: with a partial rotary embedding, the order the loader puts each query and key head's
    dimensions in (module docstring); None when every dimension turns.
    """

    def __init__(self, hf_config, head_dim: int, max_position: int, layer_type: str | None = None):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config, head_dim, layer_type)
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(positions, inv_freq)
        passing = head_dim // 2 - freqs.shape[1]  # pairs a partial rotary embedding leaves unturned
        cos = torch.cat((freqs.cos() * scaling, torch.ones(max_position, passing)), dim=-1)
        sin = torch.cat((freqs.sin() * scaling, torch.zeros(max_position, passing)), dim=-1)
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((sin, sin), dim=-1), persistent=False)
        self.dim_order = rotary_dim_order(head_dim, 2 * freqs.shape[1])

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions: [tokens, 1, head_dim], shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] -> rotated copy (rotate-half convention)."""
    # x * cos + rotate_half(x) * sin, with the rotated halves read in place rather than built by a cat;
    # each product rounded before its add, as transformers computes it (addcmul_ would fuse them).
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out
