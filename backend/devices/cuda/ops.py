"""The CUDA implementation of the model's ops (layers/ops.py).

- `rotary_write_kv` and `attention`: FlashInfer's paged attention (flashinfer_attention.py) on
  token-major pools, the step's sequences as lengths and block tables, planned once per step for every
  kind of layer; where FlashInfer cannot run (float32, or not installed) the torch reference.
- Mixtures of experts route without a host sync (`dense_routing`), so a step can be captured in a graph.
- Every other op is the torch reference: on a GPU those are cuBLAS and torch's own kernels already.
"""

from __future__ import annotations

import torch

from tritonllm.devices.cuda.flashinfer_attention import FlashInferPlans, LayerKind
from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.layers.kv_layout import TOKEN_MAJOR
from tritonllm.layers.ops import LayerOps


class CudaOps(LayerOps):
    """`attention`: "flashinfer" or "torch" (and why, for the plan)."""

    name = "cuda"
    dense_routing = True

    def __init__(self, attention: str, why: str = ""):
        self.flashinfer = attention == "flashinfer"
        self.why = why
        if self.flashinfer:
            self.kv_layout = TOKEN_MAJOR
        self.plans: FlashInferPlans | None = None  # made once the model exists (CudaBackend.prepare)

    def attention(self, layer: PagedAttention, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  meta: AttentionMetadata) -> torch.Tensor:
        if not self.flashinfer:
            return super().attention(layer, q, kv_cache, meta)
        wrappers = self.plans.active or self.plans.wrappers
        return wrappers[LayerKind.of(layer)].run(q.contiguous(), kv_cache)

    def plan(self) -> dict[str, str]:
        plan = super().plan()
        if self.flashinfer:
            plan["attention"] = "FlashInfer paged (token-major pool)"
        elif self.why:
            plan["attention"] = f"torch ({self.why})"
        return plan
