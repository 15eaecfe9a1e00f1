"""The CPU backend: our C++ kernels and packed GEMM weights, applied to the plain model at load.

What `optimize` does to a loaded model, each part where it can run (otherwise that part stays the
torch reference, with the reason logged):
- float32 with the kernels built (`cpu_kernels`): attention reading K/V in place from the paged pool,
  rotary + KV write, residual add + RMSNorm and SiLU * up each as one fused op (fused_layers.py);
  the plain-greedy head's argmax and log-prob in one pass;
- an 8-bit or bfloat16 screen beside the LM head for float32 greedy ids (`greedy_screen`, greedy_screen.py);
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
from tritonllm.devices.cpu.greedy_screen import GreedyScreen, Int8GreedyScreen, fastest_screen
from tritonllm.devices.cpu.packed_linear import (PackedLinear, PackedWeight, drop_unread_panels, pack_linears,
                                                  resolve_cpu_gemm, tune_blocks_max_rows)
from tritonllm.engine.config import CpuOptions

logger = logging.getLogger(__name__)

# Steps of up to this many rows take the LM head on its exact blocks rather than the greedy screen:
# at a row or two the blocks' fewer bytes beat the screen's pass plus its checks.
EXACT_HEAD_MAX_ROWS = 2


class CpuBackend(DeviceBackend):
    """`options`: the CPU parameters of config.pbtxt; `batch_hint`: the row count packed layouts are
    tuned for (max_num_seqs); `step_rows`: the most rows a step's GEMMs take (max_num_batched_tokens:
    decodes and prompt chunks together), None where unknown."""

    name = "cpu"

    def __init__(self, options: CpuOptions, dtype: torch.dtype, batch_hint: int, step_rows: int | None = None):
        self.options = options
        self.dtype = dtype
        self.batch_hint = batch_hint
        self.step_rows = None if step_rows is None else max(step_rows, batch_hint)
        self.kernels = options.kernels and dtype == torch.float32 and kernels.load()
        self.gemm = resolve_cpu_gemm(options.gemm, torch.device("cpu"), dtype)
        if self.gemm != options.gemm:
            logger.warning("cpu_gemm=%s cannot run for %s on this CPU and build: using %s", options.gemm,
                           str(dtype).removeprefix("torch."), self.gemm)
        self.takes_groups = self.kernels  # the attention kernel reads groups with masks
        # Our kernels compute every row alike whatever the batch; oneDNN and MKL may not.
        self.exact_rows = self.kernels and self.gemm == "avx512"
        self.screen: GreedyScreen | Int8GreedyScreen | None = None
        self.screen_min_rows = 0  # steps of fewer rows take the float32 head (greedy_screen=auto times it)
        self._screens: list[GreedyScreen | Int8GreedyScreen] = []  # what greedy_screen=auto times
        self.head: PackedWeight | None = None

    def for_worker(self) -> "CpuBackend":
        """The backend a tensor-parallel rank >= 1 applies: the same options, no LM head work."""
        return CpuBackend(dataclasses.replace(self.options, greedy_screen="false"), self.dtype, self.batch_hint,
                          self.step_rows)

    def optimize(self, model: nn.Module) -> nn.Module:
        if self.kernels:
            use_fused_layers(model)
        if self.kernels and self.options.greedy_screen != "false":
            # Before packing, which drops an untied head's plain weight: the screens keep it.
            self._screens = self._build_screens(model.head_weight())
            # Untimed (cpu_gemm other than avx512, whose head is not the float32 one to time against): the
            # bfloat16 screen where the head is that same bfloat16 copy, else the first.
            shares = [s for s in self._screens if isinstance(s, GreedyScreen) and self.gemm == "avx512_bf16"]
            self.screen = (shares or self._screens or [None])[0]
        if self.gemm != "aten":
            self._pack(model)
        if self._screens and self.options.greedy_screen == "auto" and self.gemm == "avx512":
            self._time_screens()
        self._screens = []
        if self.kernels:
            stack = DecoderStack.build(model)
            if stack is not None:
                model.run_layers = stack.wrap(model.run_layers)
        return model

    def _pack(self, model: nn.Module) -> None:
        """Every linear packed for the GEMM kernel; a tied LM head gets a packed copy of its own (the
        embedding lookup keeps the plain table), which with `avx512_bf16` is the screen's bfloat16 copy.
        Where the exact blocks take every step size, the float32 panels are freed once timed."""
        exact_blocks = self.options.exact_blocks and self.gemm == "avx512"
        layers = [lin.packed for lin in pack_linears(model.layers, self.gemm, self.batch_hint, exact_blocks)]
        if exact_blocks:
            logger.info("exact blocks read by GEMMs of up to %d rows (timed on this CPU)",
                        tune_blocks_max_rows(layers, self.batch_hint, self.step_rows))
        bf16 = [screen for screen in self._screens if isinstance(screen, GreedyScreen)]
        shared = bf16[0].packed if self.gemm == "avx512_bf16" and bf16 else None
        self.head = PackedWeight(model.head_weight(), self.gemm, self.batch_hint, packed=shared, exact_blocks=exact_blocks)
        model.lm_head = PackedLinear(self.head, None)
        if self.head.blocks is not None:
            # Its own crossover: an 8-bit head's blocks are a quarter of its panels' bytes, not an eighth.
            # Its steps pass a full batch where draft tokens are verified (a row each) or prompts want log-probs.
            logger.info("the LM head's exact blocks read by GEMMs of up to %d rows (timed on this CPU)",
                        tune_blocks_max_rows([self.head], self.batch_hint, self.step_rows))
        freed = 0 if self.step_rows is None else (drop_unread_panels(layers, self.step_rows)
                                                  + drop_unread_panels([self.head], self.step_rows))
        if freed:
            logger.info("float32 panels freed where the exact blocks take every step: %.0f MiB", freed / 2**20)

    def _build_screens(self, head_weight: torch.Tensor) -> list[GreedyScreen | Int8GreedyScreen]:
        """The screens `greedy_screen` asks for that this CPU and build run, the 8-bit one first (only the
        first for `true`)."""
        wanted = {"auto": ("int8", "bfloat16"), "true": ("int8", "bfloat16"), "int8": ("int8",),
                  "bfloat16": ("bfloat16",)}[self.options.greedy_screen]
        screens: list[GreedyScreen | Int8GreedyScreen] = []
        missing = []
        for kind in wanted:
            if screens and self.options.greedy_screen == "true":
                break
            if kind == "int8" and not kernels.int8_screen_supported():
                missing.append("AVX512-VNNI")
            elif kind == "int8" and head_weight.shape[1] % 32:
                missing.append(f"a hidden size that is a multiple of 32 (it is {head_weight.shape[1]})")
            elif kind == "int8":
                screens.append(Int8GreedyScreen(head_weight))
            elif not kernels.packed_gemm_bf16_supported():
                missing.append("AVX512-BF16")
            else:
                screens.append(GreedyScreen(head_weight))
        if not screens:
            logger.info("greedy_screen=%s: the screens need %s; the float32 head takes every row",
                        self.options.greedy_screen, " or ".join(missing))
        return screens

    def _time_screens(self) -> None:
        """greedy_screen=auto: keep the screen timed fastest, for the steps it beats the float32 head in; none
        where no screen does."""
        chosen = fastest_screen(self._screens, lambda x: self.head(x, None), self.batch_hint)
        if chosen is None:
            logger.info("greedy_screen: the float32 head is faster on this CPU (timed at %d rows); no screen",
                        self.batch_hint)
            self.screen = None  # and its copy of the head with it
        else:
            self.screen, self.screen_min_rows = chosen
            logger.info("greedy_screen: the %s screen, for steps of %d rows or more (timed on this CPU)",
                        self.screen_kind(), self.screen_min_rows)

    def screen_kind(self) -> str | None:
        """"int8" or "bfloat16": the screen greedy steps take; None without one."""
        if self.screen is None:
            return None
        return "int8" if isinstance(self.screen, Int8GreedyScreen) else "bfloat16"

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
            parts.append(f"{self.screen_kind()} greedy screen")
        return "cpu: " + ", ".join(parts)
