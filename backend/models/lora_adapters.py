"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), read into the
model's fused layout.

PEFT keeps one A [rank, in] and one B [out, rank] per targeted projection (`q_proj`, `k_proj`, `v_proj`,
`o_proj`, `gate_proj`, `up_proj`, `down_proj`), and adds `scaling * B A x` to its output, scaling being
`lora_alpha / rank` (`lora_alpha / sqrt(rank)` with `use_rslora`). Our Llama layers compute Q, K and V
in one linear and gate and up in another (models/llama.py), so an adapter's parts for one of those are
fused the same way (layers/lora.py `LoraWeights`): their A matrices stacked, and a B whose rows
for each part write only that part's columns, with the scaling (and the family's folded residual scale)
folded in. What this reader cannot serve exactly (DoRA, trained biases, embeddings or the LM head as
targets, per-module rank or alpha patterns, a mixture of experts, tensor parallelism) fails the load,
naming the adapter and the reason.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tritonllm.layers.lora import LoraWeights
from tritonllm.models.mlp import GatedMLP

# PEFT's projection names -> (our fused linear under a layer, which of its parts).
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names it."""


@dataclass
class LoraAdapter:
    """One adapter: its rank and, per fused linear of the model ("layers.3.self_attn.qkv_proj"), its weights."""

    name: str
    rank: int
    weights: dict[str, LoraWeights]


def lora_refusal(model) -> str | None:
    """Why adapters cannot be served on this model (None: they can)."""
    if model.tp.world_size != 1:
        return "tensor parallelism (tensor_parallel_size > 1)"
    if not all(isinstance(layer.mlp, GatedMLP) for layer in model.layers):
        return "a mixture of experts"
    return None


def _parts(model, linear: str) -> list[tuple[int, int]]:
    """(first output column, width) of each part of one of a layer's fused linears."""
    attn = model.layers[0].self_attn
    if linear == "self_attn.qkv_proj":
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        return [(0, q), (q, kv), (q + kv, kv)]
    if linear == "mlp.gate_up_proj":
        width = model.layers[0].mlp.intermediate_size
        return [(0, width), (width, width)]
    out = model.layers[0].self_attn.o_proj.out_features if linear == "self_attn.o_proj" else \
        model.layers[0].mlp.down_proj.out_features
    return [(0, out)]


def read_adapter(name: str, folder: Path, model, max_rank: int) -> LoraAdapter:
    """The adapter in `folder` for `model` (a LlamaForCausalLM, weights loaded): its weights in the model's
    fused layout, in float32 on the CPU. Raises AdapterError naming what cannot be served."""
    folder = Path(folder)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: {folder} must hold adapter_config.json and "
                           "adapter_model.safetensors (PEFT's save_pretrained format)")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"LoRA adapter {name!r}: cannot read {config_file}: {exc}") from None
    refusal = lora_refusal(model)
    if refusal is not None:
        raise AdapterError(f"LoRA adapter {name!r}: adapters are not served with {refusal}")
    for key, why in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)"), ("modules_to_save", "modules_to_save"),
                     ("fan_in_fan_out", "fan_in_fan_out")):
        if cfg.get(key):
            raise AdapterError(f"LoRA adapter {name!r}: {why} is not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {name!r}: trained biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank

    from safetensors.torch import load_file

    tensors = load_file(str(weights_file))
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise AdapterError(f"LoRA adapter {name!r}: weight {key!r} is not one of the supported targets "
                               f"({', '.join(TARGETS)} of the decoder layers)")
        layer, proj, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= len(model.layers):
            raise AdapterError(f"LoRA adapter {name!r}: weight {key!r} names layer {layer}; the model has "
                               f"{len(model.layers)}")
        found.setdefault((layer, proj), {})[which] = tensor.float()

    residual_scale = model.variant.residual_scale  # folded into o_proj and down_proj (models/llama.py)
    order = model.rotary.dim_order  # partial rotary: each Q and K head's dimensions reordered at load
    weights: dict[str, LoraWeights] = {}
    for layer in range(len(model.layers)):
        for linear in LINEARS:
            parts = _parts(model, linear)
            a_list, b_blocks = [], []
            for proj, (target, part) in TARGETS.items():
                if target != linear or (layer, proj) not in found:
                    continue
                pair = found[(layer, proj)]
                if set(pair) != {"A", "B"}:
                    raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {proj} lacks lora_A or lora_B")
                a, b = pair["A"], pair["B"] * scaling
                start, width = parts[part]
                module = model.get_submodule(f"layers.{layer}.{linear}")
                if a.shape[1] != module.in_features or b.shape[0] != width or a.shape[0] != b.shape[1]:
                    raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)} and "
                                       f"B {tuple(b.shape)}, which do not fit the model ({module.in_features} in, "
                                       f"{width} out): an adapter of another base model?")
                if a.shape[0] > max_rank:
                    raise AdapterError(f"LoRA adapter {name!r} has rank {a.shape[0]}, above max_lora_rank {max_rank}")
                if order is not None and linear == "self_attn.qkv_proj" and part < 2:
                    d = model.head_dim
                    b = b.reshape(-1, d, b.shape[1])[:, order].reshape(width, -1)
                if residual_scale is not None and linear in ("self_attn.o_proj", "mlp.down_proj"):
                    b = b * residual_scale
                a_list.append(a)
                b_blocks.append((start, b))
            if not a_list:
                continue
            a = torch.cat(a_list, dim=0).contiguous()  # [sum of the parts' ranks, in]
            out = sum(width for _, width in parts)
            b_full = torch.zeros(a.shape[0], out)
            row, spans = 0, []
            for start, b in b_blocks:
                b_full[row:row + b.shape[1], start:start + b.shape[0]] = b.t()
                spans.append((row, row + b.shape[1], start, start + b.shape[0]))
                row += b.shape[1]
            weights[f"layers.{layer}.{linear}"] = LoraWeights(a, b_full, tuple(spans))
    if not weights:
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights for this model")
    return LoraAdapter(name, rank, weights)
