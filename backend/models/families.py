"""How the Llama-family architectures differ from Llama's, read from their Hugging Face configs.

`models/llama.py` builds one decoder from these answers: which families it loads and what it refuses
(`check_supported`), the MLP's activation, the few numbers by which Granite and the Gemmas scale or
cap the computation (`FamilyVariant`), which layers attend through a sliding window
(`sliding_layers`, `kv_release_window`), where experts replace the MLP (`MoeSpec`), and how long a
sequence stays exact (`exact_context_limit`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonllm.layers.activations import ACTIVATIONS
from tritonllm.layers.rotary import partial_rotary_factor

# mixtures of experts in place of (some of) the dense MLPs (`MoeSpec`)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "gemma", "gemma2", "gemma3_text",
                         "olmo2", "olmo3") + MOE_MODEL_TYPES
# an RMSNorm over each query and key head before the rotary embedding
HEAD_NORM_MODEL_TYPES = ("qwen3", "gemma3_text", "qwen3_moe")
# an RMSNorm over the whole query projection and the whole key projection (all heads together), before
# the rotary embedding
PROJECTION_NORM_MODEL_TYPES = ("olmo2", "olmo3", "olmoe")
# where transformers turns only `partial_rotary_factor` of each head's dimensions (Phi-4-mini); the
# others' transformers modules turn them all whatever the config says
PARTIAL_ROTARY_MODEL_TYPES = ("phi3",)


def activation_name(cfg) -> str:
    """Gemma 2 and 3 name their activation `hidden_activation`; the others `hidden_act`."""
    return getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu"


@dataclass(frozen=True)
class FamilyVariant:
    """Where a family's computation departs from Llama's. The loader folds `residual_scale`,
    `logits_divisor` and `norm_weight_offset` into the weights, so the layers compute them without an op:
    - `embedding_scale` multiplies the embeddings (Gemma: sqrt(hidden_size); Granite: embedding_multiplier);
    - `attention_scale` replaces head_dim ** -0.5 (Granite: attention_multiplier);
    - `residual_scale` multiplies each attention and MLP output before its residual add (Granite:
      residual_multiplier), folded into o_proj and down_proj;
    - `logits_divisor` divides the logits (Granite: logits_scaling), folded into the final norm's weight;
    - `norm_weight_offset`: the RMSNorms multiply by offset + weight (Gemma: 1), folded into the weights;
    - `attention_softcap`, `logits_softcap`: scores and logits become cap * tanh(x / cap) (Gemma 2);
    - `output_norms`: each attention and MLP output is normed before its residual add (Gemma 2 and 3, OLMo 2 and 3);
    - `input_norms`: each attention and MLP input is normed (every family but OLMo 2 and 3).
    Folding rounds once more than transformers does (a relative 6e-8 in float32).
    """

    embedding_scale: float | None = None
    attention_scale: float | None = None
    residual_scale: float | None = None
    logits_divisor: float | None = None
    norm_weight_offset: float = 0.0
    attention_softcap: float | None = None
    logits_softcap: float | None = None
    output_norms: bool = False
    input_norms: bool = True

    @classmethod
    def of(cls, cfg) -> "FamilyVariant":
        if cfg.model_type == "granite":
            return cls(embedding_scale=cfg.embedding_multiplier, attention_scale=cfg.attention_multiplier,
                       residual_scale=cfg.residual_multiplier, logits_divisor=cfg.logits_scaling)
        if cfg.model_type == "gemma":
            return cls(embedding_scale=cfg.hidden_size ** 0.5, norm_weight_offset=1.0)
        if cfg.model_type in ("gemma2", "gemma3_text"):
            return cls(embedding_scale=cfg.hidden_size ** 0.5, norm_weight_offset=1.0,
                       attention_scale=cfg.query_pre_attn_scalar ** -0.5, attention_softcap=cfg.attn_logit_softcapping,
                       logits_softcap=cfg.final_logit_softcapping, output_norms=True)
        if cfg.model_type in ("olmo2", "olmo3"):
            return cls(output_norms=True, input_norms=False)
        return cls()


@dataclass(frozen=True)
class MoeSpec:
    """A mixture of experts in place of the dense MLP (models/moe.py), as the family's config sets it:
    - `top_k` of `num_experts` experts per token, picked by softmax probability; `normalize_top_k`: those k
      probabilities renormalized to sum to 1 (Mixtral always; the others by `norm_topk_prob`);
    - each expert a gated MLP of `expert_size` (Qwen's `moe_intermediate_size`, else `intermediate_size`);
    - `shared_expert_size`: Qwen2-MoE's expert that every token takes, gated by a sigmoid of its own;
    - `checkpoint_names`: the block's name in the checkpoint and its experts' gate, up and down names.
    """

    num_experts: int
    top_k: int
    normalize_top_k: bool
    expert_size: int
    shared_expert_size: int | None
    checkpoint_names: tuple[str, str, str, str]

    @classmethod
    def of(cls, cfg) -> "MoeSpec | None":
        if cfg.model_type not in MOE_MODEL_TYPES:
            return None
        mixtral = cfg.model_type == "mixtral"
        return cls(num_experts=getattr(cfg, "num_local_experts", None) or cfg.num_experts,
                   top_k=cfg.num_experts_per_tok,
                   normalize_top_k=True if mixtral else bool(cfg.norm_topk_prob),
                   expert_size=getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
                   shared_expert_size=getattr(cfg, "shared_expert_intermediate_size", None) or None,
                   checkpoint_names=("block_sparse_moe", "w1", "w3", "w2") if mixtral else
                                    ("mlp", "gate_proj", "up_proj", "down_proj"))

    @staticmethod
    def in_layer(cfg, index: int) -> bool:
        """Whether layer `index` has the experts (Qwen's MoE configs keep some layers dense:
        mlp_only_layers, all but every decoder_sparse_step-th, and every layer when num_experts is 0, as
        transformers builds them)."""
        if cfg.model_type not in ("qwen2_moe", "qwen3_moe"):
            return True
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        return cfg.num_experts > 0 and index not in (getattr(cfg, "mlp_only_layers", None) or []) and (index + 1) % step == 0


def check_supported(cfg) -> None:
    """Raise ValueError naming what `models/llama.py` cannot compute for this config."""
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    factor = partial_rotary_factor(cfg)
    if factor != 1.0 and cfg.model_type not in PARTIAL_ROTARY_MODEL_TYPES:
        raise ValueError(f"a partial rotary embedding (partial_rotary_factor={factor}) is not supported "
                         f"for model_type {cfg.model_type!r} (only {', '.join(PARTIAL_ROTARY_MODEL_TYPES)})")
    if activation_name(cfg) not in ACTIVATIONS:
        raise ValueError(f"hidden_act {activation_name(cfg)!r} is not supported ({', '.join(ACTIVATIONS)})")
    if getattr(cfg, "clip_qkv", None) is not None:  # OLMoE's option to clamp Q, K and V
        raise ValueError(f"clip_qkv={cfg.clip_qkv} is not supported")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")


def sliding_layers(cfg) -> list[bool]:
    """Per layer, whether it attends only to its last `sliding_window` positions: every layer of a model
    with a `sliding_window` (Mistral, Phi-3), or those `layer_types` names "sliding_attention" (Gemma 2,
    Qwen with use_sliding_window)."""
    n = cfg.num_hidden_layers
    if not getattr(cfg, "sliding_window", None):
        return [False] * n
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return [kind == "sliding_attention" for kind in layer_types[:n]]
    if cfg.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):  # configs without layer_types: the layers from max_window_layers on
        first = getattr(cfg, "max_window_layers", 0) if getattr(cfg, "use_sliding_window", False) else n
        return [i >= first for i in range(n)]
    return [True] * n


def attention_window(cfg, max_position: int) -> int | None:
    """The window the steps' sliding masks must carry: None when no layer slides, or when the window is
    no shorter than the longest sequence (it never limits anything then)."""
    window = getattr(cfg, "sliding_window", None)
    return window if any(sliding_layers(cfg)) and window < max_position else None


def kv_release_window(cfg, max_position: int) -> int | None:
    """When every layer slides, no layer reads a sequence's K/V further back than this window: the
    scheduler frees the blocks behind it, exactly (unlike `kv_window` pruning). None otherwise: some
    layer attends to the whole sequence (Gemma 2 and 3, Qwen's first max_window_layers)."""
    window = attention_window(cfg, max_position)
    return window if window is not None and all(sliding_layers(cfg)) else None


def window_pool_layers(cfg, max_position: int) -> list[bool] | None:
    """Per layer, whether its K/V live in the window pool (scheduling/window_pool.py): the sliding layers of a model
    where other layers attend to the whole sequence. None when there is no such mix (one pool; when every
    layer slides, that pool frees what is behind the window itself)."""
    sliding = sliding_layers(cfg)
    if attention_window(cfg, max_position) is None or all(sliding):
        return None
    return sliding


def exact_context_limit(cfg) -> tuple[int, str] | None:
    """The longest sequence (prompt + output) over which this module computes what the model does, and why
    it stops there; None: no limit besides max_position_embeddings.

    `longrope` rotary frequencies (Phi-3's long-context variants) are the short ones up to the
    original context, which are the ones our fixed table holds.
    """
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type") == "longrope":
        original = params.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings")
        return original, f"its longrope frequencies change past {original} positions"
    return None
