"""The CUDA backend: the model built with the CUDA ops (ops.py), and decode graphs.

What it chooses, each part where it can run (otherwise the torch reference, with the reason in the
plan the server logs):
- attention through FlashInfer on token-major pools, the step's sequences as lengths and block tables:
  no masks are built, nothing is gathered; planned once per step before the forward;
- mixtures of experts routed without a host sync;
- after the pools exist (`capture`), CUDA graphs of pure-decode steps per batch bucket (graphs.py).
The step's only device-to-host transfer is then the sampled ids and log-probs.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from tritonllm.core.config import CudaOptions
from tritonllm.core.tracing import span
from tritonllm.devices.backend import Capabilities, DeviceBackend, Runtime
from tritonllm.devices.cuda.ops import CudaOps
from tritonllm.layers.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def choose_attention(requested: str, dtype: torch.dtype) -> tuple[str, str]:
    """`cuda_attention=requested` for a model in `dtype`: ("flashinfer" or "torch", why where torch)."""
    if requested == "torch":
        return "torch", "cuda_attention=torch"
    if dtype not in FLASHINFER_DTYPES:
        # FlashInfer's kernels take half-precision queries only: float32 runs the reference.
        if requested == "flashinfer":
            raise ValueError(f"cuda_attention=flashinfer needs dtype float16 or bfloat16, not {dtype}")
        return "torch", f"FlashInfer takes float16 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    if flashinfer_available():
        return "flashinfer", ""
    if requested == "flashinfer":
        raise RuntimeError("cuda_attention=flashinfer, but flashinfer is not installed: pip install .[cuda]")
    logger.warning("flashinfer is not installed (pip install .[cuda]): the torch reference attention runs")
    return "torch", "flashinfer is not installed"


class CudaBackend(DeviceBackend):
    name = "cuda"

    def __init__(self, options: CudaOptions, runtime: Runtime):
        super().__init__(options, runtime)
        self.ops = CudaOps(*choose_attention(options.attention, runtime.dtype))
        self.graphs = None
        self.graphs_off = "" if options.graphs else "cuda_graphs=false"

    @property
    def capabilities(self) -> Capabilities:
        # FlashInfer reads each sequence's table whole, pruned blocks included.
        return Capabilities(kv_layout=self.ops.kv_layout, skips_pruned_blocks=not self.ops.flashinfer)

    def prepare(self, model: nn.Module) -> None:
        if self.ops.flashinfer:
            from tritonllm.devices.cuda.flashinfer_attention import FlashInferPlans

            rt = self.runtime
            self.ops.plans = FlashInferPlans(model, rt.device, rt.dtype, rt.kv_dtype, rt.block_size)

    def capture(self, model: nn.Module, kv_caches, num_window_blocks: int) -> None:
        if not self.options.graphs or self.ops.plans is None:
            self.graphs_off = self.graphs_off or "no FlashInfer attention"
            return
        if self.runtime.tensor_parallel_size > 1 or num_window_blocks:
            self.graphs_off = "tensor parallelism" if self.runtime.tensor_parallel_size > 1 else "a window pool"
            logger.info("decode graphs: off (%s)", self.graphs_off)
            return
        from tritonllm.devices.cuda.graphs import DecodeGraphs

        rt = self.runtime
        max_batch = min(self.options.graph_max_batch or rt.max_num_seqs, rt.max_num_seqs)
        max_blocks = -(-rt.max_model_len // rt.block_size)
        self.graphs = DecodeGraphs(model, self.ops.plans, max_batch, max_blocks)
        self.graphs.capture(kv_caches)

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.graphs is not None:
            hidden = self.graphs.run(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        if self.ops.plans is not None:
            with span("plan"):
                self.ops.plans.plan(meta)
        with span("model"):
            return model(input_ids, positions, kv_caches, meta)

    def plan(self) -> dict[str, str]:
        plan = super().plan()
        plan["decoder_stack"] = ("decode graphs" if self.graphs is not None
                                 else f"off, layer by layer ({self.graphs_off or 'graphs captured once the pools exist'})")
        return plan
