"""The CPU backend: the model built with the CPU's ops (ops.py), their weights prepared once at load.

What it chooses, each part where it can run (otherwise that part stays the torch reference, with the
reason in the plan the server logs):
- the ops: our C++ kernels for float32 (`cpu_kernels`), GEMMs on packed weights (`cpu_gemm`), exact
  quantized blocks beside them (`exact_block_weights`);
- the greedy head (head.py): the fused argmax kernel, and an 8-bit or bfloat16 screen for float32
  greedy ids where it beats the float32 LM head (`greedy_screen`);
- the decoder layers as one C++ call where a step allows (decoder_stack.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tritonllm.core.config import CpuOptions
from tritonllm.devices.backend import Capabilities, DeviceBackend, Runtime
from tritonllm.devices.cpu import kernels, timed_choices
from tritonllm.devices.cpu.decoder_stack import DecoderStack
from tritonllm.devices.cpu.greedy_screen import GreedyScreen
from tritonllm.devices.cpu.head import CpuGreedyHead, build_screens, head_fingerprint, screen_kind
from tritonllm.devices.cpu.ops import CpuOps
from tritonllm.devices.cpu.packed_linear import (PackedWeight, drop_unread_panels, resolve_cpu_gemm, set_blocks_max_rows,
                                                 tune_blocks_max_rows)
from tritonllm.layers.fp8 import is_fp8
from tritonllm.layers.linear import Linear

logger = logging.getLogger(__name__)

# The warm-up's prompt step on the CPU: long enough for every prompt path (chunks of several blocks,
# two prompts in a step), far below a full step budget, whose warm-up bought nothing a first request would feel.
CPU_WARMUP_PROMPT_TOKENS = 64


class CpuBackend(DeviceBackend):
    name = "cpu"

    def __init__(self, options: CpuOptions, runtime: Runtime):
        super().__init__(options, runtime)
        use_kernels = options.kernels and runtime.dtype == torch.float32 and kernels.load()
        gemm = resolve_cpu_gemm(options.gemm, torch.device("cpu"), runtime.dtype)
        if gemm != options.gemm:
            logger.warning("cpu_gemm=%s cannot run for %s on this CPU and build: using %s", options.gemm,
                           str(runtime.dtype).removeprefix("torch."), gemm)
        self.ops = CpuOps(use_kernels, gemm, runtime.max_num_seqs, options.exact_blocks,
                          kv_kernels=not is_fp8(runtime.kv_dtype))
        self.head = CpuGreedyHead(fused=use_kernels)
        # The most rows a step's GEMMs take: decodes and prompt chunks together.
        self.step_rows = max(runtime.max_num_batched_tokens, runtime.max_num_seqs)
        self.stack_refusal = "C++ kernels off"  # why the decoder layers do not run as one call
        # Tensor parallelism's all-reduce through shared memory needs the kernels loaded, whatever the dtype.
        self.shared_memory_all_reduce = runtime.tensor_parallel_size > 1 and options.kernels and kernels.load()

    @property
    def capabilities(self) -> Capabilities:
        # Our kernels compute every row alike whatever the batch; oneDNN and MKL may not.
        # FP8 linears (layers/fp8.py) multiply their widened values through torch's GEMM: not our kernels.
        return Capabilities(kv_layout=self.ops.kv_layout,
                            exact_rows=self.ops.kernels and self.ops.gemm == "avx512" and not self.quantized,
                            warmup_prompt_tokens=CPU_WARMUP_PROMPT_TOKENS,
                            shared_memory_all_reduce=self.shared_memory_all_reduce)

    def prepare(self, model: nn.Module) -> None:
        ops = self.ops
        # greedy_screen=auto on the float32 head: the screen timed fastest against it, where one pays. Untimed
        # (cpu_gemm other than avx512, whose head is not the float32 one): the bfloat16 screen where the head
        # is that same bfloat16 copy, else the first.
        timed = self.options.greedy_screen == "auto" and ops.gemm == "avx512"
        builds_screens = ops.kernels and self.options.greedy_screen != "false" and self.runtime.rank == 0
        known, chosen, screen_timing = False, None, None
        if timed and builds_screens:
            # The choice depends on this head (its blocks, or none, against the screens): its first rows name it.
            screen_timing = ("greedy screen", [head_fingerprint(model.lm_head.weight), self.runtime.max_num_seqs,
                                               self.step_rows, ops.exact_blocks])
            known, chosen = timed_choices.recall(*screen_timing)
        screens = []
        if builds_screens:
            # Before packing, which drops an untied head's plain weight: the screens keep it. Only the one
            # chosen on this CPU before, if any.
            screens = build_screens(self.options.greedy_screen, model.lm_head.weight,
                                    only=([chosen[0]] if chosen else []) if known else None)
            self.head.screen_off = "" if screens or known else "no screen runs on this CPU"
        elif self.options.greedy_screen == "false":
            self.head.screen_off = "greedy_screen=false"
        layers = [m for m in model.layers.modules() if isinstance(m, Linear)]
        for layer in layers:
            ops.prepare_linear(layer)
        if ops.gemm != "aten":
            self._tune_blocks(model, layers, screens)
        elif any(layer.weight is not None for layer in layers):
            weights = [layer.weight for layer in layers if layer.weight is not None]
            shapes = sorted({(*w.shape, str(w.dtype)) for w in [*weights, model.lm_head.weight]})
            library, _ = timed_choices.remembered(
                "aten library", [shapes, self.runtime.max_num_seqs],
                lambda: ops.choose_aten_library([*weights, model.lm_head.weight], self.runtime.max_num_seqs))
            ops.aten_library = library
            if library == "onednn":
                logger.info("cpu_gemm=aten: torch's oneDNN linear, timed faster than F.linear's BLAS on this CPU")
        if known:
            self.head.use_screen(screens[0] if screens else None, chosen[1] if chosen else 0, model.lm_head.packed)
        else:
            shares = [s for s in screens if isinstance(s, GreedyScreen) and ops.gemm == "avx512_bf16"]
            self.head.choose_screen(shares or screens, model.lm_head.packed, self.runtime.max_num_seqs, timed)
            if screen_timing is not None and screens:
                timed_choices.keep(*screen_timing, [screen_kind(self.head.screen), self.head.screen_min_rows]
                                   if self.head.screen is not None else None)
        if ops.kernels:
            self.stack_refusal = DecoderStack.refusal(model) if ops.kv_kernels else "an FP8 KV pool"
            ops.decoder_stack = None if self.stack_refusal else DecoderStack(model)

    def _tune_blocks(self, model: nn.Module, layers: list[Linear], screens: list) -> None:
        """Pack the LM head (a tied one gets a packed copy of its own; with `avx512_bf16` the bfloat16
        screen's), time up to how many rows the exact blocks pay, and free the float32 panels where the
        blocks take every step size."""
        ops = self.ops
        packed = [layer.packed for layer in layers if isinstance(layer.packed, PackedWeight)]  # not FP8 ones
        if ops.exact_blocks:
            logger.info("exact blocks read by GEMMs of up to %d rows (%s)", *self._blocks_max_rows(packed))
        bf16 = [screen for screen in screens if isinstance(screen, GreedyScreen)]
        shared = bf16[0].packed if ops.gemm == "avx512_bf16" and bf16 else None
        if self.runtime.rank == 0:
            ops.prepare_linear(model.lm_head, shared)
            head = model.lm_head.packed
            if head.blocks is not None:
                # Its own crossover: an 8-bit head's blocks are a quarter of its panels' bytes, not an eighth.
                # Its steps pass a full batch where draft tokens are verified (a row each) or prompts want log-probs.
                logger.info("the LM head's exact blocks read by GEMMs of up to %d rows (%s)",
                            *self._blocks_max_rows([head]))
            packed_head = [head]
        else:
            packed_head = []
        freed = drop_unread_panels(packed, self.step_rows) + drop_unread_panels(packed_head, self.step_rows)
        if freed:
            logger.info("float32 panels freed where the exact blocks take every step: %.0f MiB", freed / 2**20)

    def _blocks_max_rows(self, weights: list[PackedWeight]) -> tuple[int, str]:
        """Up to how many rows `weights`' GEMMs read their exact blocks (set on each), timed on this CPU or as
        timed here before for weights of these shapes and blocks; and which of the two it was."""
        shapes = sorted({(w.out_features, w.in_features, str(w.blocks[0].dtype)) for w in weights if w.blocks is not None})
        rows, kept = timed_choices.remembered(
            "exact blocks max rows", [shapes, self.runtime.max_num_seqs, self.step_rows],
            lambda: tune_blocks_max_rows(weights, self.runtime.max_num_seqs, self.step_rows))
        set_blocks_max_rows(weights, rows)
        return rows, "as timed on this CPU before" if kept else "timed on this CPU"

    def plan(self) -> dict[str, str]:
        plan = super().plan()
        if self.ops.gemm != self.options.gemm:
            why = f" (cpu_gemm={self.options.gemm} cannot run for this CPU, dtype and build)"
            plan["linear"] += why
            if "lm_head" in plan:
                plan["lm_head"] += why
        if self.ops.decoder_stack is not None:
            plan["decoder_stack"] = "C++ (unless sliding layers mix with full ones)"
        else:
            plan["decoder_stack"] = f"off, layer by layer ({self.stack_refusal})"
        if self.runtime.tensor_parallel_size > 1:
            plan["all_reduce"] = ("C++ through shared memory" if self.shared_memory_all_reduce else
                                  "gloo (cpu_kernels=false)" if not self.options.kernels else "gloo (no C++ kernels)")
        return plan
