"""A Llama-family model's decoder layers as one C++ call (csrc/decoder_stack.cpp), where it applies.

At a few rows a layer's ops take microseconds each, and calling them from Python costs more than
that (argument parsing, dispatch, output allocation, module calls), with the OpenMP workers waiting
between them. The C++ call runs the same ops, on the same tensors and in the same order as
`LlamaDecoderLayer.forward` with the CPU's ops (ops.py), so its results are bit for bit
those of the modules. It needs:
- float32 on CPU with our kernels, and every linear packed for `cpu_gemm=avx512`;
- one rank (tensor parallelism all-reduces between the ops);
- one window for every layer, in one pool (all attend to the whole context, or all slide with the
  same window: not sliding layers beside full ones), and one rotary embedding for every layer (not
  the sliding layers' own of Gemma 3 and OLMo 3);
- SiLU as the MLP's activation (not Gemma's GELU), no soft-capped scores (Gemma 2), and a dense MLP
  in every layer (no experts). Query and key norms per head (Qwen3) or over the projections (OLMo), and
  OLMo's layer (norms after the attention and the MLP instead of before) run in the stack too.
A step with LoRA adapter rows (layers/lora.py) runs in the stack as well: each linear's slots go in,
and the C++ adds each run's deltas right after the linear's GEMM with the kernel the modules' op uses.
"""

from __future__ import annotations

import torch

from tritonllm.devices.cpu.attention_rows import attention_rows
from tritonllm.devices.cpu.packed_linear import PackedWeight
from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.models.mlp import GatedMLP


class DecoderStack:
    """Built from a LlamaForCausalLM built with the CPU's ops, its linears packed, where `refusal(model)`
    finds nothing against it; the model's layer loop calls `run` (`LayerOps.decoder_stack`)."""

    def __init__(self, model):
        layers = list(model.layers)
        attn = layers[0].self_attn
        norms = [layers[0].input_layernorm, layers[0].post_attention_layernorm, attn.q_norm, attn.k_norm,
                 layers[0].attn_output_norm, layers[0].mlp_output_norm]
        eps = next(norm.eps for norm in norms if norm is not None)
        num_heads, num_kv_heads, scale = attn.num_heads, attn.num_kv_heads, attn.attn.scale
        self.norms = [w for layer in layers if layer.input_layernorm is not None
                      for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
        self.qk_norms = [w for layer in layers if layer.self_attn.q_norm is not None
                         for w in (layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)]
        self.whole_projection_norms = layers[0].self_attn.projection_norms
        self.output_norms = [w for layer in layers if layer.attn_output_norm is not None
                             for w in (layer.attn_output_norm.weight, layer.mlp_output_norm.weight)]
        linears = [lin for layer in layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                       layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self.linears = linears  # their `lora` slots are read at each step with adapter rows
        self._lora_weights: list = []  # the slots' LoraWeights the table was built from (kept alive by this)
        self._lora_table: torch.Tensor | None = None
        packed: list[PackedWeight] = [lin.packed for lin in linears]
        self.biases = [lin.bias for lin in linears]
        self.out_features = [p.out_features for p in packed]
        # What PackedWeight would read: the float32 panels, or at up to blocks_max_rows rows the blocks.
        self.blocks_max_rows = min(p.blocks_max_rows for p in packed)
        self.panels = ([p.data for p in packed], [None] * len(packed))
        self.blocks = ([p.blocks[0] if p.blocks is not None else p.data for p in packed],
                       [p.blocks[1] if p.blocks is not None else None for p in packed])
        self.eps, self.num_heads, self.num_kv_heads, self.scale = eps, num_heads, num_kv_heads, scale
        self.windows = {layer.self_attn.attn.window for layer in layers}  # None: a layer over the whole context
        self._kv_caches = None  # the runner's pool, split once into K and V lists
        self._k_caches: list[torch.Tensor] = []
        self._v_caches: list[torch.Tensor] = []

    @staticmethod
    def refusal(model) -> str | None:
        """Why the stack cannot run this model's layers (None: it can)."""
        layers = list(model.layers)
        if model.tp.world_size != 1 or not layers:
            return "tensor parallelism" if layers else "no layers"
        if not all(isinstance(layer.mlp, GatedMLP) for layer in layers):  # a mixture of experts: the modules run
            return "a mixture of experts"
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if lin.packed is not None and lin.packed.kernel == "fp8":
                    return "FP8 weights (quantization=fp8)"
                if lin.packed is None or lin.packed.kernel != "avx512":
                    return "linears not packed for cpu_gemm=avx512"
        first = layers[0]
        if first.mlp.activation != "silu":  # nor an activation other than SiLU (Gemma's GELU)
            return f"activation {first.mlp.activation}"
        if first.self_attn.attn.softcap is not None:  # nor Gemma 2's capped scores
            return "soft-capped attention"
        if any(layer.self_attn.local_rope for layer in layers):  # one rotary for every layer (not Gemma 3's, OLMo 3's)
            return "sliding layers with a rotary of their own"
        attn = first.self_attn
        norms = [first.input_layernorm, first.post_attention_layernorm, attn.q_norm, attn.k_norm,
                 first.attn_output_norm, first.mlp_output_norm]
        if len({norm.eps for norm in norms if norm is not None}) != 1:  # the C++ layer takes one eps for all its norms
            return "norms with different eps"
        return None

    def run(self, hidden: torch.Tensor, kv_caches, meta: AttentionMetadata) -> torch.Tensor | None:
        """The final residual stream of the step's embeddings `hidden`, or None for a step it does not take."""
        attention = self.applies(hidden, meta)
        if attention is None:
            return None
        return self(hidden, kv_caches, meta, attention)

    def applies(self, hidden: torch.Tensor, meta: AttentionMetadata) -> tuple | None:
        """The step's attention rows (attention_rows.py) if it can take the stack, else None."""
        # The C++ layers take one block table and one set of rows for all of them: not sliding layers
        # beside full ones, nor a window pool of their own (meta.sliding). Where every layer slides with
        # one window, the rows carry it.
        if meta.sliding is not None or len(self.windows) != 1:
            return None
        return attention_rows(meta.seqs, next(iter(self.windows)))

    def __call__(self, hidden: torch.Tensor, kv_caches, meta: AttentionMetadata,
                 attention: tuple) -> torch.Tensor:
        """hidden: the step's embeddings (becomes the residual stream) -> the final residual stream."""
        if self._kv_caches is not kv_caches:
            self._kv_caches = kv_caches
            self._k_caches, self._v_caches = [k for k, _ in kv_caches], [v for _, v in kv_caches]
        weights, scales = self.blocks if hidden.shape[0] <= self.blocks_max_rows else self.panels
        row_seq, row_end, row_start = attention
        cos, sin = meta.rope
        table, lora_slots, segments = self._lora(meta)
        return torch.ops.tritonllm.decoder_stack(
            hidden, self.norms, weights, scales, self.biases, self.out_features, self._k_caches, self._v_caches,
            cos, sin, meta.slot_mapping, meta.seqs.block_table, row_seq, row_end, row_start,
            self.qk_norms, self.whole_projection_norms, self.output_norms, self.scale, self.eps, self.num_heads, self.num_kv_heads,
            table, lora_slots, segments)

    def _lora(self, meta: AttentionMetadata) -> tuple[torch.Tensor | None, int, list[int]]:
        """The linears' adapter slots as the C++ takes them (a table of addresses, slots per linear) and the
        step's runs of rows; (None, 0, []) for a step of base-model rows only."""
        if meta.lora is None or self.linears[0].lora is None:
            return None, 0, []
        slots = [w for lin in self.linears for w in lin.lora]
        if self._lora_table is None or any(w is not held for w, held in zip(slots, self._lora_weights)):
            self._lora_weights, self._lora_table = slots, lora_table(self.linears)
        return self._lora_table, len(self.linears[0].lora), meta.lora.flat_segments


def lora_table(linears: list) -> torch.Tensor:
    """Per linear and slot: the addresses of its adapter's A, B and parts (0: none), its ranks and part
    count, int64 [linears x slots, 5].

    Why addresses: a step would otherwise pass every slot's three tensors of every linear (hundreds) to
    the C++, and converting them costs more than a small step's deltas. The table is built when the
    slots change; the caller holds the LoraWeights (and so the tensors) as long as it uses the table.
    """
    rows = []
    for lin in linears:
        for w in lin.lora:
            if w is None:
                rows.append((0, 0, 0, 0, 0))
                continue
            a, b, parts = w.a, w.b, w.parts_table
            if not (a.dtype == b.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
                    and parts.is_contiguous() and a.shape == (b.shape[0], lin.in_features) and b.shape[1] == lin.out_features):
                raise ValueError(f"LoRA weights A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a linear of "
                                 f"{lin.in_features} in and {lin.out_features} out as contiguous float32")
            rows.append((a.data_ptr(), b.data_ptr(), a.shape[0], parts.data_ptr() if parts.numel() else 0,
                         parts.shape[0]))
    return torch.tensor(rows, dtype=torch.int64)
