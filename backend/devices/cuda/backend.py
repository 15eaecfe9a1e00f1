"""The CUDA backend: FlashInfer's paged attention and decode graphs, applied to the plain model at load.

What `optimize` does, each part where it can run (otherwise that part stays the torch reference, with
the reason logged):
- attention through FlashInfer (flashinfer_attention.py) on token-major pools, the step's sequences
  as lengths and block tables: no masks are built, nothing is gathered;
- mixtures of experts routed without a host sync (`SparseMoeMLP.dense_routing`);
- after the pools exist (`capture`), CUDA graphs of pure-decode steps per batch bucket (graphs.py).
The step's only device-to-host transfer is then the sampled ids and log-probs.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from tritonllm.devices.backend import DeviceBackend
from tritonllm.devices.platform import resolve_kv_cache_dtype
from tritonllm.engine.config import EngineConfig
from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.layers.kv_layout import TOKEN_MAJOR
from tritonllm.models.moe import SparseMoeMLP

logger = logging.getLogger(__name__)

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


class CudaBackend(DeviceBackend):
    name = "cuda"

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.options = config.cuda
        self.device, self.dtype = device, dtype
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.dtype, dtype)
        self.block_size = config.cache.block_size
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_model_len = config.model.max_model_len
        self.num_ranks = config.parallel.tensor_parallel_size
        self.attention = "torch"
        if self.options.attention != "torch":
            if dtype not in FLASHINFER_DTYPES:
                # FlashInfer's kernels take half-precision queries only: float32 runs the reference.
                if self.options.attention == "flashinfer":
                    raise ValueError(f"cuda_attention=flashinfer needs dtype float16 or bfloat16, not {dtype}")
                logger.info("dtype %s: the torch reference attention runs (FlashInfer takes float16 and "
                            "bfloat16)", dtype)
            elif flashinfer_available():
                self.attention = "flashinfer"
            elif self.options.attention == "flashinfer":
                raise RuntimeError("cuda_attention=flashinfer, but flashinfer is not installed: pip install .[cuda]")
            else:
                logger.warning("flashinfer is not installed (pip install .[cuda]): the torch reference attention runs")
        self.plans = None
        self.graphs = None

    def optimize(self, model: nn.Module) -> nn.Module:
        for module in model.modules():
            if isinstance(module, SparseMoeMLP):
                module.dense_routing = True
        if self.attention == "flashinfer":
            from tritonllm.devices.cuda.flashinfer_attention import FlashInferAttention, FlashInferPlans

            for module in model.modules():
                if type(module) is PagedAttention:
                    module.__class__ = FlashInferAttention
            self.plans = FlashInferPlans(model, self.device, self.dtype, self.kv_dtype, self.block_size)
            for module in model.modules():
                if isinstance(module, FlashInferAttention):
                    module.plans = self.plans
            self.kv_layout, self.skips_pruned_blocks = TOKEN_MAJOR, False
        return model

    def capture(self, model: nn.Module, kv_caches, num_window_blocks: int) -> None:
        if not (self.options.graphs and self.plans is not None):
            return
        if self.num_ranks > 1 or num_window_blocks:
            logger.info("decode graphs: off (%s)", "tensor parallelism" if self.num_ranks > 1 else "a window pool")
            return
        from tritonllm.devices.cuda.graphs import DecodeGraphs

        max_batch = min(self.options.graph_max_batch or self.max_num_seqs, self.max_num_seqs)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(model, self.plans, max_batch, max_blocks)
        self.graphs.capture(kv_caches)

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.graphs is not None:
            hidden = self.graphs.run(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        if self.plans is not None:
            self.plans.plan(meta)
        return model(input_ids, positions, kv_caches, meta)

    def describe(self) -> str:
        attention = "FlashInfer paged attention" if self.attention == "flashinfer" else "torch reference attention"
        graphs = "decode graphs" if self.options.graphs and self.attention == "flashinfer" else "no decode graphs"
        return f"cuda: {attention}, {graphs}"
