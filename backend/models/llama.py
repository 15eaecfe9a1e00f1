"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) with fused QKV and gate/up projections.

One GEMM computes Q, K and V together and one computes gate and up together; the results are
split by views. The forward takes the step's flattened tokens; attention reads the paged KV pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import AttentionMetadata, paged_attention, write_kv
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class LlamaAttention(nn.Module):
    def __init__(self, cfg, head_dim: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, cfg.hidden_size, bias=False)
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = self.rotary.apply(qkv[:, :self.num_heads + self.num_kv_heads], meta.rope_cos, meta.rope_sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, head_dim: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, head_dim, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions, hidden, kv_cache, meta):
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states; `compute_logits` applies the LM head to chosen rows."""

    def __init__(self, cfg, max_position: int):
        super().__init__()
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {cfg.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        self.config = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = RotaryEmbedding(cfg, self.head_dim, max_position)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.head_dim, self.rotary)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
        hidden = self.embed_tokens(input_ids)
        meta.rope_cos, meta.rope_sin = self.rotary.lookup(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, meta)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def load_hf_state_dict(self, tensors) -> None:
        """Copy Hugging Face weights (name -> tensor getter) into the fused layout."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            param = own[name]
            if param.shape != value.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
            param.data.copy_(value)
            loaded.add(name)

        get = tensors.__getitem__
        put("embed_tokens.weight", get("model.embed_tokens.weight"))
        put("norm.weight", get("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", get("lm_head.weight"))
        for i in range(self.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            put(dst + "input_layernorm.weight", get(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight", get(src + "post_attention_layernorm.weight"))
            attn = src + "self_attn."
            put(dst + "self_attn.qkv_proj.weight",
                torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"], dim=0))
            if self.layers[i].self_attn.qkv_proj.bias is not None:
                put(dst + "self_attn.qkv_proj.bias", torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"], dim=0))
            put(dst + "self_attn.o_proj.weight", get(attn + "o_proj.weight"))
            mlp = src + "mlp."
            put(dst + "mlp.gate_up_proj.weight",
                torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")], dim=0))
            put(dst + "mlp.down_proj.weight", get(mlp + "down_proj.weight"))
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")
