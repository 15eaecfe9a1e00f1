"""The device-backend interface, which is also the torch reference on any device.

A backend is chosen once per engine (`devices.select_backend`). It hands the model the ops its layers
call (`ops`, layers/ops.py) when the model is built, prepares their weights once after load
(`prepare`), and gives the runner the greedy head (`head`) and the facts it reads (`capabilities`).
Every backend is built the same way: its own options from config.pbtxt plus the runtime facts
(`Runtime`) of the model and engine it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.layers.kv_layout import HEAD_MAJOR
from tritonllm.layers.ops import LayerOps, describe_plan


@dataclass(frozen=True)
class Runtime:
    """What a backend is told of the model and engine it serves."""

    device: torch.device
    dtype: torch.dtype  # the model's
    kv_dtype: torch.dtype  # the KV pool's (kv_cache_dtype resolved)
    block_size: int
    max_num_seqs: int  # a step's decodes at most: the row count packed layouts and timings are tuned for
    max_num_batched_tokens: int  # a step's rows at most, decodes and prompt chunks together
    max_model_len: int
    tensor_parallel_size: int = 1
    rank: int = 0  # ranks >= 1 run the layers only: no LM head, no token choice
    quantization: str = "none"  # the decoder linears' weights: none | fp8 (layers/fp8.py)


@dataclass(frozen=True)
class Capabilities:
    """What the runner and engine read of a backend once the model is prepared."""

    kv_layout: str = HEAD_MAJOR  # how the KV pools are laid out (layers/kv_layout.py)
    # Whether every row of a step is computed exactly as a one-token decode's row would be, so that a
    # speculative draft's rows give the same tokens and log-probs as decoding one at a time.
    exact_rows: bool = False
    # Whether attention skips the blocks kv_window pruning gives back in the middle of a context.
    skips_pruned_blocks: bool = True
    # The prompt tokens the load's warm-up runs in one step; None: the whole step budget. An
    # accelerator's first run of a shape pays for graphs, autotuning and its allocator's pools, so it
    # warms at full size; a CPU step's first run costs what its later runs do, so a short prompt
    # warms the same code (docs/PERFORMANCE.md, "Start-up").
    warmup_prompt_tokens: int | None = None
    # Whether tensor-parallel ranks sum their partial results through a shared-memory segment with our CPU
    # kernels (devices/cpu/shared_memory_all_reduce.py) rather than the process group's all-reduce.
    shared_memory_all_reduce: bool = False


class GreedyHead:
    """How a device picks plain-greedy tokens, beside the sampler's torch ops (runner/head.py). This base
    has no fast path: the sampler's argmax and log-softmax run."""

    def argmax_logprob(self, logits: torch.Tensor, logprobs: bool = True) -> torch.Tensor | None:
        """Argmax and its log-prob of plain-greedy logits, packed as the sampler packs them (int32 [2, rows]),
        where the device has a fused op (None: the sampler's torch ops). Without `logprobs` (no row asked
        for one) the log-probs may be left out, as NaN."""
        return None

    def finds_ids_without_logits(self, rows: int) -> bool:
        """Whether `ids_without_logits` serves a plain-greedy step of `rows` rows (for its rows that want
        no log-prob)."""
        return False

    def ids_without_logits(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy token ids of these final hidden states (before the final norm), found without the
        full logits: the same ids as the logits' argmax."""
        raise NotImplementedError

    def describe(self) -> str:
        return "torch"


class DeviceBackend:
    """The torch reference: the model's layers run `LayerOps` as they are, nothing is prepared."""

    name = "torch"

    def __init__(self, options, runtime: Runtime):
        self.options = options
        self.runtime = runtime
        self.ops: LayerOps = LayerOps()  # what the model is built with (models/loader.py load_model)
        self.head: GreedyHead = GreedyHead()
        self.quantized = ""  # how quantized linears compute (the plan's words), once `quantize` ran

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(kv_layout=self.ops.kv_layout)

    def quantize(self, model: nn.Module) -> None:
        """Once after load, before `prepare`: the decoder linears' weights into the form `quantization`
        names (layers/fp8.py); `prepare` leaves such a layer as it is, and `ops.linear` runs its form."""
        if self.runtime.quantization == "fp8":
            from tritonllm.layers.fp8 import quantize_linears

            self.quantized = quantize_linears(model)

    def prepare(self, model: nn.Module) -> None:
        """Once after load: each weight into the layout its op reads (and whatever else the ops and the
        head build from the loaded model)."""

    def capture(self, model: nn.Module, kv_caches, num_window_blocks: int) -> None:
        """Once the KV pools exist: capture what replays later (a backend's decode graphs)."""

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward for one step (a backend may plan its kernels first, or replay a graph)."""
        return model(input_ids, positions, kv_caches, meta)

    def plan(self) -> dict[str, str]:
        """Which implementation each op takes, and why where it fell back (layers/ops.py OPS)."""
        plan = self.ops.plan()
        if self.quantized:
            plan["linear"] = self.quantized
        if self.runtime.rank == 0:
            plan["greedy_head"] = self.head.describe()
        else:
            plan.pop("lm_head", None)
        return plan

    def describe(self) -> str:
        """The plan as the one line the server logs at load."""
        return f"{self.name}: {describe_plan(self.plan())}"
