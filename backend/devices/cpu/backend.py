"""The CPU backend: our C++ kernels and packed GEMM weights, applied to the plain model at load.

What `optimize` does to a loaded model, each part where it can run (otherwise that part stays the
torch reference, with the reason logged):
- float32 with the kernels built (`cpu_kernels`): attention reading K/V in place from the paged pool,
  rotary + KV write, residual add + RMSNorm and SiLU * up each as one fused op (fused_layers.py);
  the plain-greedy head's argmax and log-prob in one pass;
- a bfloat16 screen beside the LM head for float32 greedy ids (`greedy_screen`, greedy_screen.py);
- every GEMM weight packed once for the chosen kernel (`cpu_gemm`, packed_linear.py), with the
  exact quantized blocks kept beside it (`exact_block_weights`, exact_blocks.py);
- the decoder layers as one C++ call where a step allows (decoder_stack.py).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from tritonllm.devices.backend import DeviceBackend
from tritonllm.devices.cpu import kernels
from tritonllm.devices.cpu.decoder_stack import DecoderStack
from tritonllm.devices.cpu.fused_layers import use_fused_layers
from tritonllm.devices.cpu.greedy_screen import GreedyScreen, screen_min_rows
from tritonllm.devices.cpu.packed_linear import PackedLinear, PackedWeight, pack_linears, resolve_cpu_gemm, tune_blocks_max_rows
from tritonllm.engine.config import CpuOptions

logger = logging.getLogger(__name__)

# Steps of up to this many rows take the LM head on its exact blocks rather than the greedy screen:
# at a row or two the blocks' fewer bytes beat the screen's bfloat16 GEMM plus its checks.
EXACT_HEAD_MAX_ROWS = 2


class CpuBackend(DeviceBackend):
    """`options`: the CPU parameters of config.pbtxt; `batch_hint`: the row count packed layouts are
    tuned for (max_num_seqs); `step_rows`: the most rows a step's GEMMs take (max_num_batched_tokens:
    decodes and prompt chunks together)."""

    name = "cpu"

    def __init__(self, options: CpuOptions, dtype: torch.dtype, batch_hint: int, step_rows: int | None = None):
        self.options = options
        self.dtype = dtype
        self.batch_hint = batch_hint
        self.step_rows = max(step_rows or batch_hint, batch_hint)
        self.kernels = options.kernels and dtype == torch.float32 and kernels.load()
        self.gemm = resolve_cpu_gemm(options.gemm, torch.device("cpu"), dtype)
        if self.gemm != options.gemm:
            logger.warning("cpu_gemm=%s cannot run for %s on this CPU and build: using %s", options.gemm,
                           str(dtype).removeprefix("torch."), self.gemm)
        self.takes_groups = self.kernels  # the attention kernel reads groups with masks
        # Our kernels compute every row alike whatever the batch; oneDNN and MKL may not.
        self.exact_rows = self.kernels and self.gemm == "avx512"
        self.screen: GreedyScreen | None = None
        self.screen_min_rows = 0  # steps of fewer rows take the float32 head (greedy_screen=auto times it)
        self.head: PackedWeight | None = None

    def for_worker(self) -> "CpuBackend":
        """The backend a tensor-parallel rank >= 1 applies: the same options, no LM head work."""
        return CpuBackend(dataclasses.replace(self.options, greedy_screen="false"), self.dtype, self.batch_hint,
                          self.step_rows)

    def optimize(self, model: nn.Module) -> nn.Module:
        if self.kernels:
            use_fused_layers(model)
        if self.kernels and self.options.greedy_screen != "false":
            if kernels.packed_gemm_bf16_supported():
                # Before packing, which drops an untied head's plain weight: the screen keeps it.
                self.screen = GreedyScreen(model.head_weight())
            else:
                logger.info("greedy_screen: this CPU or build has no AVX512-BF16; the float32 head takes every row")
        if self.gemm != "aten":
            self._pack(model)
        if self.screen is not None and self.options.greedy_screen == "auto" and self.gemm == "avx512":
            self._time_screen()
        if self.kernels:
            stack = DecoderStack.build(model)
            if stack is not None:
                model.run_layers = stack.wrap(model.run_layers)
        return model

    def _pack(self, model: nn.Module) -> None:
        """Every linear packed for the GEMM kernel; a tied LM head gets a packed copy of its own (the
        embedding lookup keeps the plain table), which with `avx512_bf16` is the screen's bfloat16 copy."""
        exact_blocks = self.options.exact_blocks and self.gemm == "avx512"
        layers = [lin.packed for lin in pack_linears(model.layers, self.gemm, self.batch_hint, exact_blocks)]
        if exact_blocks:
            logger.info("exact blocks read by GEMMs of up to %d rows (timed on this CPU)",
                        tune_blocks_max_rows(layers, self.batch_hint, self.step_rows))
        shared = self.screen.packed if self.gemm == "avx512_bf16" and self.screen is not None else None
        self.head = PackedWeight(model.head_weight(), self.gemm, self.batch_hint, packed=shared, exact_blocks=exact_blocks)
        model.lm_head = PackedLinear(self.head, None)
        if self.head.blocks is not None:
            # Its own crossover: an 8-bit head's blocks are a quarter of its panels' bytes, not an eighth.
            # Its steps pass a full batch where draft tokens are verified (a row each) or prompts want log-probs.
            logger.info("the LM head's exact blocks read by GEMMs of up to %d rows (timed on this CPU)",
                        tune_blocks_max_rows([self.head], self.batch_hint, self.step_rows))

    def _time_screen(self) -> None:
        """greedy_screen=auto: keep the screen for the steps it is timed faster in, on this CPU; none: drop it."""
        rows = screen_min_rows(self.screen, lambda x: self.head(x, None), self.batch_hint)
        if rows is None:
            logger.info("greedy_screen: the float32 head is faster on this CPU (timed at %d rows); the screen is off",
                        self.batch_hint)
            self.screen = None  # and its bfloat16 copy of the head with it
        else:
            logger.info("greedy_screen: steps of %d rows or more (timed on this CPU)", rows)
            self.screen_min_rows = rows

    def screens_greedy(self, rows: int) -> bool:
        return (self.screen is not None and rows >= self.screen_min_rows
                and not (rows <= EXACT_HEAD_MAX_ROWS and self.head is not None and self.head.reads_blocks(rows)))

    def greedy_ids(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        ids, _ = self.screen(model.norm(hidden))
        return ids

    def greedy_head(self, logits: torch.Tensor, logprobs: bool = True) -> torch.Tensor | None:
        if not self.kernels or logits.dtype != torch.float32:
            return None
        ids, chosen = kernels.greedy_head(logits, logprobs)
        return torch.stack([ids.to(torch.int32), chosen.view(torch.int32)])

    def describe(self) -> str:
        parts = [f"cpu_gemm={self.gemm}", "C++ kernels" if self.kernels else "torch attention (C++ kernels off)"]
        if self.screen is not None:
            parts.append("greedy screen")
        return "cpu: " + ", ".join(parts)
