"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, Phi-4-mini, Granite, Gemma, Gemma 2,
Gemma 3 text, OLMo 2, OLMo 3, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) with
fused QKV and gate/up projections.

One GEMM computes Q, K and V together and one computes gate and up together; the results are split
by views (Phi-3 checkpoints hold them fused already). The forward takes the step's flattened tokens;
attention reads the paged KV pool. Qwen3 adds an RMSNorm over each query and key head before the
rotary embedding (`q_norm`, `k_norm`). Granite and Gemma change the computation by a few numbers
(`FamilyVariant`; how each family differs is read from its config in models/families.py), most of
them folded into the weights at load; Gemma 2 also caps attention scores and logits, and norms each
attention and MLP output before its residual add; Gemma 3 keeps that layer without the caps, adds
Qwen3's head norms, and its sliding layers rotate by frequencies of their own (`local_rotary`). OLMo
2 norms the attention's and MLP's outputs instead of their inputs, and the whole query and key
projections rather than each head (OLMo 3 adds sliding layers). Mixtral, Qwen2-MoE, Qwen3-MoE and
OLMoE put a mixture of experts in place of the MLP (models/moe.py). Phi-4-mini turns only part of
each head: the loader reorders each query and key head's dimensions so the full-width rotary leaves
the rest as they are (layers/rotary.py).

Sliding-window layers (Mistral's, Phi-3's, Gemma 2's and 3's, Qwen's past max_window_layers)
attend to each query's last `sliding_window` positions through a mask of their own
(`AttentionMetadata.sliding`); when every layer slides, the scheduler frees the blocks behind the
window (`kv_release_window`). Rotary frequencies that switch once a sequence outgrows the original
context (`longrope`) are not computed: the engine caps `max_model_len` there (`exact_context_limit`),
so within it the outputs are the model's own.
"""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.layers.linear import Linear
from tritonllm.layers.norm import RMSNorm
from tritonllm.layers.ops import LayerOps
from tritonllm.layers.rotary import RotaryEmbedding, rope_by_layer_type
from tritonllm.models.families import (HEAD_NORM_MODEL_TYPES, PROJECTION_NORM_MODEL_TYPES, FamilyVariant, MoeSpec,
                                       attention_window, check_supported, kv_release_window, sliding_layers,
                                       window_pool_layers)
from tritonllm.models.mlp import GatedMLP
from tritonllm.models.moe import SparseMoeMLP
from tritonllm.parallel.shard import SINGLE, TPShard


class LlamaAttention(nn.Module):
    """This rank's KV-head groups: column-parallel QKV, row-parallel output projection + all-reduce."""

    def __init__(self, cfg, head_dim: int, tp: TPShard, ops: LayerOps, scale: float | None = None,
                 softcap: float | None = None, window: int | None = None, local_rope: bool = False):
        super().__init__()
        kv_start, kv_end = tp.split(cfg.num_key_value_heads)
        per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
        self.num_kv_heads = kv_end - kv_start
        self.num_heads = self.num_kv_heads * per_kv
        self.head_dim = head_dim
        self.tp = tp
        self.sliding = window is not None  # attends to the last `window` positions (meta.sliding)
        self.local_rope = local_rope  # rotates by the sliding layers' own frequencies (meta.local_rope)
        bias = bool(getattr(cfg, "attention_bias", False) or getattr(cfg, "qkv_bias", False)) or cfg.model_type == "qwen2"
        self.qkv_proj = Linear(cfg.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias, ops)
        self.o_proj = Linear(self.num_heads * head_dim, cfg.hidden_size, False, ops)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim,
                                   head_dim ** -0.5 if scale is None else scale, ops, softcap, window)
        # Qwen3 and Gemma 3 norm each query and key head; OLMo 2 and 3 the whole projections, of which this
        # rank holds its heads' part (`_projection_norm` takes the statistic over every rank's).
        self.projection_norms = cfg.model_type in PROJECTION_NORM_MODEL_TYPES
        if cfg.model_type in HEAD_NORM_MODEL_TYPES:
            self.q_norm, self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, ops), RMSNorm(head_dim, cfg.rms_norm_eps, ops)
        elif self.projection_norms:
            self.q_norm = RMSNorm(self.num_heads * head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.num_kv_heads * head_dim, cfg.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None
        self.projection_widths = (cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        # meta.lora: the step's adapter rows (layers/lora.py), whose deltas the linears add; None: base only.
        qkv = self.qkv_proj(x, meta.lora).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # in place: the attention reads the normed heads from qkv
            q_end, k_end = self.num_heads, self.num_heads + self.num_kv_heads
            if self.projection_norms:
                qkv[:, :q_end] = self._projection_norm(qkv[:, :q_end], self.q_norm, self.projection_widths[0])
                qkv[:, q_end:k_end] = self._projection_norm(qkv[:, q_end:k_end], self.k_norm, self.projection_widths[1])
            else:
                qkv[:, :q_end] = self.q_norm(qkv[:, :q_end])
                qkv[:, q_end:k_end] = self.k_norm(qkv[:, q_end:k_end])
        rope = meta.local_rope if self.local_rope else meta.rope
        # A sliding layer whose K/V have a pool of their own reads that pool's slots and block tables; its
        # window itself is the attention layer's (`PagedAttention.window`), applied by every implementation.
        layer_meta = meta.sliding if self.sliding and meta.sliding is not None else meta
        out = self.attn(qkv, rope, kv_cache, layer_meta)
        return self.tp.all_reduce(self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim), meta.lora))

    def _projection_norm(self, heads: torch.Tensor, norm: RMSNorm, width: int) -> torch.Tensor:
        """OLMo's RMSNorm over a whole projection ([tokens, this rank's heads, head_dim]) of `width` values
        across all ranks: the squares summed over every rank's heads, in float32 as transformers does."""
        flat = heads.reshape(heads.shape[0], -1).float()
        sum_sq = self.tp.all_reduce(flat.pow(2).sum(-1, keepdim=True))
        return (norm.weight * (flat * torch.rsqrt(sum_sq / width + norm.eps))).to(heads.dtype).view_as(heads)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, head_dim: int, tp: TPShard, variant: FamilyVariant, ops: LayerOps,
                 window: int | None = None, local_rope: bool = False, moe: MoeSpec | None = None):
        super().__init__()
        # OLMo 2 and 3 norm neither the attention's input nor the MLP's: those two are None there.
        pre = variant.input_norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops) if pre else None
        self.self_attn = LlamaAttention(cfg, head_dim, tp, ops, variant.attention_scale, variant.attention_softcap,
                                        window, local_rope)
        # The norm between the attention's residual add and the MLP (Gemma 2 calls it pre_feedforward_layernorm).
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops) if pre else None
        self.mlp = GatedMLP(cfg, tp, ops) if moe is None else SparseMoeMLP(cfg, tp, moe, ops)
        # Gemma 2 and 3, OLMo 2 and 3: norms of the attention's and the MLP's outputs (their
        # post_attention_ and post_feedforward_layernorm).
        post = variant.output_norms
        self.attn_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops) if post else None
        self.mlp_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops) if post else None

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """`residual` is the stream so far, `hidden` the previous layer's MLP output to add to it
        (None before the first layer): each add is folded into the norm that follows it.
        Returns this layer's MLP output and the residual stream (updated in place)."""
        if residual is None:
            residual = hidden
            hidden = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        else:
            hidden = _add_and_norm(self.input_layernorm, residual, hidden)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        if self.attn_output_norm is not None:
            hidden = self.attn_output_norm(hidden)
        hidden = _add_and_norm(self.post_attention_layernorm, residual, hidden)
        # Adapters target the dense MLP only (models/lora_adapters.py refuses a mixture of experts).
        hidden = self.mlp(hidden) if meta.lora is None else self.mlp(hidden, meta.lora)
        if self.mlp_output_norm is not None:
            hidden = self.mlp_output_norm(hidden)
        return hidden, residual


def _add_and_norm(norm: RMSNorm | None, residual: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """residual += hidden, then `norm` of it; without a norm (OLMo) the stream itself, which the
    attention or MLP reads before the next add changes it in place."""
    if norm is None:
        return residual.add_(hidden)
    return norm.add_and_norm(residual, hidden)


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states; `compute_logits` applies the LM head to chosen rows.

    `ops` (layers/ops.py): the implementation of every op the layers call, chosen by the device backend
    (devices/) and handed to each layer here; the torch reference by default.

    With a tensor-parallel shard, embeddings, norms and the LM head are replicated: after each
    layer's all-reduces every rank holds the same hidden states, and only the scheduler rank
    computes logits.
    """

    def __init__(self, cfg, max_position: int, tp: TPShard = SINGLE, ops: LayerOps | None = None):
        super().__init__()
        check_supported(cfg)
        self.config = cfg
        self.tp = tp
        self.ops = ops = ops or LayerOps()
        self.variant = FamilyVariant.of(cfg)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        by_type = rope_by_layer_type(cfg)  # Gemma 3: the sliding layers' frequencies apart
        self.rotary = RotaryEmbedding(cfg, self.head_dim, max_position, "full_attention" if by_type else None)
        self.local_rotary = RotaryEmbedding(cfg, self.head_dim, max_position, "sliding_attention") if by_type else None
        # Left uninitialised: the checkpoint's table replaces it, so a random draw over it would be wasted at
        # each load. (nn.utils.skip_init would do the same through the meta device, which imports torch._dynamo.)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        # A window no shorter than the longest sequence never limits anything: no sliding masks then.
        sliding = sliding_layers(cfg)
        self.attention_window = attention_window(cfg, max_position)
        self.kv_release_window = kv_release_window(cfg, max_position)  # the scheduler frees blocks behind it
        self.window_pool_layers = window_pool_layers(cfg, max_position)  # sliding layers with a pool of their own
        moe = MoeSpec.of(cfg)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.head_dim, tp, self.variant, ops, self.attention_window if sliding[i] else None,
                              local_rope=by_type and sliding[i], moe=moe if moe and moe.in_layer(cfg, i) else None)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # Tied embeddings: the head reads the embedding table (the device's ops may keep a copy in their layout).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, ops,
                              tied=self.embed_tokens if self.tie_word_embeddings else None)
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (all of them without tensor parallelism)."""
        return self.layers[0].self_attn.num_kv_heads

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
        """The step's flat tokens -> their final hidden states (before the final norm)."""
        hidden = self.embed_tokens(input_ids)
        if self.variant.embedding_scale is not None:
            hidden.mul_(self.variant.embedding_scale)
        meta.rope = self.rotary.lookup(positions, hidden.dtype)
        if self.local_rotary is not None:
            meta.local_rope = self.local_rotary.lookup(positions, hidden.dtype)
        return self.run_layers(hidden, positions, kv_caches, meta)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """The decoder layers over the embedded tokens: as one call where the ops have a whole-stack
        implementation that takes this step (`ops.decoder_stack`: the same ops in the same order, e.g.
        devices/cpu/decoder_stack.py), else layer by layer."""
        if self.ops.decoder_stack is not None:
            out = self.ops.decoder_stack.run(hidden, kv_caches, meta)
            if out is not None:
                return out
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        return residual.add_(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        cap = self.variant.logits_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)  # monotonic: greedy ids stay

    def load_hf_state_dict(self, tensors) -> None:
        """Copy Hugging Face weights into the fused layout, keeping only this rank's shard.

        `tensors` maps a name to its tensor and offers `rows(name, start, end)` / `cols(...)`
        slices, so a rank reads only its own part of each sharded weight.
        """
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            param = own[name]
            if param.shape != value.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
            param.data.copy_(value)
            loaded.add(name)

        cfg, d, tp = self.config, self.head_dim, self.tp
        kv_start, kv_end = tp.split(cfg.num_key_value_heads)
        per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
        q_rows = (kv_start * per_kv * d, kv_end * per_kv * d)  # this rank's query heads
        kv_rows = (kv_start * d, kv_end * d)
        get = tensors.__getitem__

        def qkv_part(attn: str, kind: str) -> torch.Tensor:
            """This rank's Q, K and V rows, from q/k/v_proj or from a fused qkv_proj (Phi-3)."""
            fused = f"{attn}qkv_proj.{kind}"
            if fused in tensors:
                k_at, v_at = cfg.num_attention_heads * d, (cfg.num_attention_heads + cfg.num_key_value_heads) * d
                spans = (q_rows, (k_at + kv_rows[0], k_at + kv_rows[1]), (v_at + kv_rows[0], v_at + kv_rows[1]))
                return torch.cat([tensors.rows(fused, *span) for span in spans], dim=0)
            spans = {"q": q_rows, "k": kv_rows, "v": kv_rows}
            return torch.cat([tensors.rows(f"{attn}{p}_proj.{kind}", *spans[p]) for p in "qkv"], dim=0)

        def gated(dst_prefix: str, src_prefix: str, names: tuple[str, str, str], size: int) -> None:
            """A gated MLP's gate and up rows (fused) and down columns, this rank's part of `size`."""
            gate, up, down = names
            rows = tp.split(size)
            put(dst_prefix + "gate_up_proj.weight", torch.cat([tensors.rows(f"{src_prefix}{gate}.weight", *rows),
                                                               tensors.rows(f"{src_prefix}{up}.weight", *rows)]))
            put(dst_prefix + "down_proj.weight", tensors.cols(f"{src_prefix}{down}.weight", *rows))

        order = self.rotary.dim_order  # a partial rotary embedding: each query and key head's dimensions reordered

        def rotary_ordered(qkv: torch.Tensor) -> torch.Tensor:
            if order is None:
                return qkv
            qk = (q_rows[1] - q_rows[0]) + (kv_rows[1] - kv_rows[0])
            heads = qkv[:qk].reshape(-1, d, *qkv.shape[1:])[:, order]
            return torch.cat([heads.reshape(qk, *qkv.shape[1:]), qkv[qk:]])
        put("embed_tokens.weight", get("model.embed_tokens.weight"))
        put("norm.weight", get("model.norm.weight"))
        if not self.tie_word_embeddings:
            put("lm_head.weight", get("lm_head.weight"))
        for i in range(self.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            if self.variant.input_norms:
                put(dst + "input_layernorm.weight", get(src + "input_layernorm.weight"))
            if self.variant.output_norms:  # Gemma's and OLMo's names for the output norms (and Gemma's pre-MLP one)
                put(dst + "attn_output_norm.weight", get(src + "post_attention_layernorm.weight"))
                put(dst + "mlp_output_norm.weight", get(src + "post_feedforward_layernorm.weight"))
                if self.variant.input_norms:
                    put(dst + "post_attention_layernorm.weight", get(src + "pre_feedforward_layernorm.weight"))
            else:
                put(dst + "post_attention_layernorm.weight", get(src + "post_attention_layernorm.weight"))
            attn = src + "self_attn."
            put(dst + "self_attn.qkv_proj.weight", rotary_ordered(qkv_part(attn, "weight")))
            if self.layers[i].self_attn.qkv_proj.bias is not None:
                put(dst + "self_attn.qkv_proj.bias", rotary_ordered(qkv_part(attn, "bias")))
            put(dst + "self_attn.o_proj.weight", tensors.cols(attn + "o_proj.weight", *q_rows))
            if self.layers[i].self_attn.projection_norms:  # over whole projections: this rank's heads' part
                put(dst + "self_attn.q_norm.weight", tensors.rows(attn + "q_norm.weight", *q_rows))
                put(dst + "self_attn.k_norm.weight", tensors.rows(attn + "k_norm.weight", *kv_rows))
            elif self.layers[i].self_attn.q_norm is not None:  # per head: every rank holds the whole weight
                for norm in ("q_norm", "k_norm"):
                    weight = get(f"{attn}{norm}.weight")
                    put(f"{dst}self_attn.{norm}.weight", weight if order is None else weight[order])
            mlp = self.layers[i].mlp
            if isinstance(mlp, SparseMoeMLP):
                block, gate, up, down = mlp.spec.checkpoint_names
                put(dst + "mlp.gate.weight", get(f"{src}{block}.gate.weight"))
                for e in range(mlp.spec.num_experts):
                    gated(f"{dst}mlp.experts.{e}.", f"{src}{block}.experts.{e}.", (gate, up, down), mlp.spec.expert_size)
                if mlp.shared_expert is not None:  # Qwen2-MoE
                    gated(dst + "mlp.shared_expert.", f"{src}{block}.shared_expert.", ("gate_proj", "up_proj", "down_proj"),
                          mlp.spec.shared_expert_size)
                    put(dst + "mlp.shared_expert_gate.weight", get(f"{src}{block}.shared_expert_gate.weight"))
            elif src + "mlp.gate_up_proj.weight" in tensors:  # fused in the checkpoint (Phi-3): gate rows, then up rows
                fused, size = src + "mlp.gate_up_proj.weight", cfg.intermediate_size
                mlp_rows = tp.split(size)
                put(dst + "mlp.gate_up_proj.weight", torch.cat([tensors.rows(fused, *mlp_rows),
                                                                tensors.rows(fused, size + mlp_rows[0], size + mlp_rows[1])]))
                put(dst + "mlp.down_proj.weight", tensors.cols(src + "mlp.down_proj.weight", *mlp_rows))
            else:
                gated(dst + "mlp.", src + "mlp.", ("gate_proj", "up_proj", "down_proj"), cfg.intermediate_size)
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")
        self._fold_variant()

    def _fold_variant(self) -> None:
        """FamilyVariant's weight-folded numbers, applied once to the loaded weights."""
        v = self.variant
        for name, param in self.named_parameters():
            if v.norm_weight_offset and name.endswith("norm.weight"):
                param.data.add_(v.norm_weight_offset)
        if v.residual_scale is not None:
            for layer in self.layers:
                layer.self_attn.o_proj.weight.data.mul_(v.residual_scale)
                layer.mlp.down_proj.weight.data.mul_(v.residual_scale)
        if v.logits_divisor is not None:
            self.norm.weight.data.div_(v.logits_divisor)
