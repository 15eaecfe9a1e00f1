"""The CPU's implementation of the model's ops (layers/ops.py): our C++ kernels, and GEMMs on weights
packed once at load.

Which op takes which implementation, and why where it falls back to the torch reference:
- `linear`: the GEMM chosen by `cpu_gemm` (packed_linear.py) on the weight packed once by
  `prepare_linear`, with its exact quantized blocks where it is such blocks (exact_blocks.py); `aten`
  packs nothing and runs torch on the plain weight: `F.linear` (torch's BLAS, MKL in the x86 wheels), or
  torch's oneDNN linear where that is timed faster at load (`aten_library`: MKL takes a generic path on
  non-Intel x86, at about half oneDNN's rate).
- `add_rms_norm`, `act_and_mul` (SiLU only; Gemma's GELU stays torch), `rotary_write_kv` and
  `attention`: one C++ kernel each (csrc/fused_decoder_ops.cpp, csrc/paged_decode_attention.cpp),
  for float32 with the kernels built (`cpu_kernels`). The attention kernel does not cap scores: a layer
  with Gemma 2's soft cap runs the torch attention after the fused rotary + KV write.
- `decoder_stack`: every decoder layer as one C++ call (decoder_stack.py) where the model and the
  step allow; set by the backend once the weights are packed.
- `lora_delta`: multi-LoRA's per-row adapter deltas, one C++ call per linear (csrc/lora_delta.cpp), for
  float32 with the kernels built.
- `rms_norm` (a norm with no residual add before it) stays torch: `F.rms_norm` is one call already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonllm.devices.cpu import kernels
from tritonllm.devices.cpu.load_timing import faster
from tritonllm.devices.cpu.paged_attention import kernel_attention
from tritonllm.devices.cpu.packed_linear import PackedWeight, onednn_linear, onednn_linear_supported
from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.layers.linear import Linear
from tritonllm.layers.lora import LoraBatch
from tritonllm.layers.ops import LayerOps


class CpuOps(LayerOps):
    """`kernels`: our C++ kernels run (float32, built); `gemm`: the resolved `cpu_gemm`; `batch_hint`: the
    row count packed layouts are tuned for; `exact_blocks`: keep exact quantized blocks beside the panels."""

    name = "cpu"

    def __init__(self, kernels_on: bool, gemm: str, batch_hint: int, exact_blocks: bool, kv_kernels: bool = True):
        self.kernels = kernels_on
        # The KV kernels (rotary + write, attention) read float32, float16 and bfloat16 pools, not FP8 ones.
        self.kv_kernels = kernels_on and kv_kernels
        self.gemm = gemm
        self.batch_hint = batch_hint
        self.exact_blocks = exact_blocks and gemm == "avx512"
        self.decoder_stack = None
        self.aten_library = "blas"  # with gemm=aten: "blas" (F.linear) or "onednn" (choose_aten_library)

    def linear(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed is not None:
            return layer.packed(x, layer.bias)
        if self.aten_library == "onednn" and x.dtype == torch.float32:
            return onednn_linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def choose_aten_library(self, weights: list[torch.Tensor], rows: int) -> str:
        """With `cpu_gemm=aten` on float32: which of torch's two CPU GEMM libraries the linears call, timed
        once at `rows` rows on a step's linears (`weights`: a model's own, [out, in]; each shape once). One
        shape alone is a coin toss where the libraries are close on it and far apart on another (the LM
        head; docs/PERFORMANCE.md). oneDNN only where it takes at most 90 % of BLAS's time, so that a CPU
        where both run alike keeps `F.linear` run after run (their sums are ordered differently: the
        last bits differ)."""
        weights = [w for w in weights if w.dtype == torch.float32]
        if self.gemm == "aten" and weights and onednn_linear_supported():
            distinct = list({tuple(w.shape): w for w in weights}.values())
            inputs = [torch.randn(rows, w.shape[1]) for w in distinct]

            def step(linear) -> None:
                for x, w in zip(inputs, distinct):
                    linear(x, w)

            if faster(lambda: step(lambda x, w: onednn_linear(x, w, None)), lambda: step(F.linear), 0.9):
                self.aten_library = "onednn"
        return self.aten_library

    def prepare_linear(self, layer: Linear, shared: torch.Tensor | None = None) -> None:
        """Pack the layer's weight for the GEMM kernel (`shared`: that weight already packed for it, e.g.
        the bfloat16 screen's copy of the LM head). The plain weight is dropped, unless another module
        owns it (a tied LM head: the embedding table)."""
        if self.gemm == "aten" or layer.packed is not None:  # nothing to pack, or quantized (layers/fp8.py)
            return
        layer.packed = PackedWeight(layer.weight, self.gemm, self.batch_hint, packed=shared,
                                    exact_blocks=self.exact_blocks)
        if not layer.tied:
            layer.weight = None

    def lora_delta(self, layer: Linear, x: torch.Tensor, y: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        if not self.kernels or x.dtype != torch.float32 or x.stride(-1) != 1:
            return super().lora_delta(layer, x, y, batch)
        slots = layer.lora
        return kernels.lora_delta_(y, x, [w.a if w is not None else None for w in slots],
                                   [w.b if w is not None else None for w in slots],
                                   [w.parts_table if w is not None else None for w in slots], batch.flat_segments)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self.kernels:
            return super().add_rms_norm(residual, x, weight, eps)
        return kernels.add_rms_norm_(residual, x, weight, eps)

    def act_and_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        if not self.kernels or activation != "silu":
            return super().act_and_mul(gate_up, activation)
        return kernels.silu_mul(gate_up)

    def rotary_write_kv(self, layer: PagedAttention, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                        kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor) -> torch.Tensor:
        if not self.kv_kernels:
            return super().rotary_write_kv(layer, qkv, rope, kv_cache, slot_mapping)
        return kernels.rope_write_kv(qkv, *rope, *kv_cache, slot_mapping, layer.num_heads, layer.num_kv_heads)

    def attention(self, layer: PagedAttention, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  meta: AttentionMetadata) -> torch.Tensor:
        if not self.kv_kernels or layer.softcap is not None:
            return super().attention(layer, q, kv_cache, meta)
        return kernel_attention(q, *kv_cache, meta.seqs, layer.scale, layer.window)

    def plan(self) -> dict[str, str]:
        plan = super().plan()
        if self.gemm != "aten":
            blocks = " + exact blocks" if self.exact_blocks else ""
            # cpu_gemm=avx512 is our panel GEMM, built for AVX-512 and for AVX2: name the build that runs.
            kernel = f"panel GEMM ({kernels.variant()} kernels)" if self.gemm == "avx512" else self.gemm
            plan["linear"] = plan["lm_head"] = f"{kernel} packed{blocks}"
        elif self.aten_library == "onednn":
            plan["linear"] = plan["lm_head"] = "torch's oneDNN linear on the plain weight (timed faster than F.linear's BLAS here)"
        if self.kernels:
            plan.update(lora_delta="C++ (one call per linear)", add_rms_norm="C++", act_and_mul="C++ (SiLU; other activations torch)",
                        rotary_write_kv="C++", attention="C++ paged (soft-capped layers torch)")
            if not self.kv_kernels:
                plan["rotary_write_kv"] = plan["attention"] = "torch (an FP8 KV pool: the C++ kernels read 16 and 32-bit ones)"
        else:
            why = "C++ kernels off (cpu_kernels=false, not float32, or not built)"
            for op in ("lora_delta", "add_rms_norm", "act_and_mul", "rotary_write_kv", "attention"):
                plan[op] = f"torch ({why})"
        return plan
