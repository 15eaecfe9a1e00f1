"""The CPU's greedy head: the fused argmax + log-prob kernel (csrc/greedy_head.cpp), and for greedy rows
that want no log-prob, the greedy screen this CPU runs fastest (greedy_screen.py), where it beats the
float32 LM head.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from torch import nn

from tritonllm.devices.backend import GreedyHead
from tritonllm.devices.cpu import kernels
from tritonllm.devices.cpu.greedy_screen import GreedyScreen, Int8GreedyScreen, fastest_screen
from tritonllm.devices.cpu.packed_linear import PackedWeight

logger = logging.getLogger(__name__)

# Steps of up to this many rows take the LM head on its exact blocks rather than the greedy screen:
# at a row or two the blocks' fewer bytes beat the screen's pass plus its checks.
EXACT_HEAD_MAX_ROWS = 2

Screen = GreedyScreen | Int8GreedyScreen


def build_screens(greedy_screen: str, head_weight: torch.Tensor, only: list[str] | None = None) -> list[Screen]:
    """The screens `greedy_screen` asks for that this CPU and build run, the 8-bit one first (only the
    first for `true`); the reason logged where none can. `only`: of those, just these kinds (the one
    timed fastest here before; none where the float32 head was)."""
    wanted = {"auto": ("int8", "bfloat16"), "true": ("int8", "bfloat16"), "int8": ("int8",),
              "bfloat16": ("bfloat16",)}[greedy_screen]
    if only is not None:
        wanted = tuple(kind for kind in wanted if kind in only)
        if not wanted:
            return []
    screens: list[Screen] = []
    missing = []
    for kind in wanted:
        if screens and greedy_screen == "true":
            break
        if kind == "int8" and not kernels.int8_screen_supported():
            missing.append("AVX2 or AVX512-VNNI")
        elif kind == "int8" and head_weight.shape[1] % 32:
            missing.append(f"a hidden size that is a multiple of 32 (it is {head_weight.shape[1]})")
        elif kind == "int8":
            screens.append(Int8GreedyScreen(head_weight))
        elif not kernels.packed_gemm_bf16_supported():
            missing.append("AVX512-BF16")
        else:
            screens.append(GreedyScreen(head_weight))
    if not screens:
        logger.info("greedy_screen=%s: the screens need %s; the float32 head takes every row", greedy_screen,
                    " or ".join(missing))
    return screens


def screen_kind(screen: Screen | None) -> str | None:
    """"int8" or "bfloat16"; None for no screen."""
    if screen is None:
        return None
    return "int8" if isinstance(screen, Int8GreedyScreen) else "bfloat16"


def head_fingerprint(weight: torch.Tensor) -> str:
    """A short name for an LM head's weight, from its shape and first rows' bytes: what a screen's timing
    against it depends on (whether the head has exact blocks, and which) differs between models."""
    rows = weight.detach()[:64].contiguous()
    digest = hashlib.sha256(rows.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    return f"{'x'.join(map(str, weight.shape))}:{weight.dtype}:{digest}"


class CpuGreedyHead(GreedyHead):
    """`fused`: the argmax + log-prob kernel runs (float32 with the kernels built). `screen`: the screen
    greedy steps of `screen_min_rows` rows or more take, if any; `head`: the LM head's packed weight, whose
    exact blocks serve the smallest steps better than a screen."""

    def __init__(self, fused: bool):
        self.fused = fused
        self.screen: Screen | None = None
        self.screen_min_rows = 0
        self.head: PackedWeight | None = None
        self.screen_off = "C++ kernels off"  # why no screen, for the plan

    def choose_screen(self, screens: list[Screen], head: PackedWeight | None, max_rows: int, timed: bool) -> None:
        """Keep the screen to use: with `timed` (greedy_screen=auto on the float32 head), the one timed fastest
        against `head`, for the steps it beats it in, or none; else the first."""
        self.head = head
        if not screens or not timed:
            self.screen = screens[0] if screens else None
            return
        chosen = fastest_screen(screens, lambda x: head(x, None), max_rows)
        if chosen is None:
            logger.info("greedy_screen: the float32 head is faster on this CPU (timed at %d rows); no screen", max_rows)
            self.screen_off = "the float32 head is faster on this CPU"
            return
        self.screen, self.screen_min_rows = chosen
        logger.info("greedy_screen: the %s screen, for steps of %d rows or more (timed on this CPU)",
                    self.screen_kind(), self.screen_min_rows)

    def use_screen(self, screen: Screen | None, min_rows: int, head: PackedWeight | None) -> None:
        """Keep `screen` from `min_rows` rows (None: no screen), as timed on this CPU by an earlier load
        (timed_choices.py), against `head`."""
        self.head = head
        self.screen, self.screen_min_rows = screen, min_rows
        if screen is None:
            self.screen_off = "the float32 head is faster on this CPU"
            logger.info("greedy_screen: the float32 head is faster on this CPU (as timed here before); no screen")
        else:
            logger.info("greedy_screen: the %s screen, for steps of %d rows or more (as timed on this CPU before)",
                        self.screen_kind(), min_rows)

    def screen_kind(self) -> str | None:
        """"int8" or "bfloat16": the screen greedy steps take; None without one."""
        return screen_kind(self.screen)

    def argmax_logprob(self, logits: torch.Tensor, logprobs: bool = True) -> torch.Tensor | None:
        if not self.fused or logits.dtype != torch.float32:
            return None
        ids, chosen = kernels.greedy_head(logits, logprobs)
        return torch.stack([ids.to(torch.int32), chosen.view(torch.int32)])

    def finds_ids_without_logits(self, rows: int) -> bool:
        return (self.screen is not None and rows >= self.screen_min_rows
                and not (rows <= EXACT_HEAD_MAX_ROWS and self.head is not None and self.head.reads_blocks(rows)))

    def ids_without_logits(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        ids, _ = self.screen(model.norm(hidden))
        return ids

    def describe(self) -> str:
        fused = "C++ argmax + log-prob" if self.fused else "torch"
        if self.screen is None:
            return f"{fused}, no screen ({self.screen_off})"
        kind = self.screen_kind()
        on = f" ({kernels.int8_screen_instructions()})" if kind == "int8" else ""
        return f"{fused}, {kind} screen{on} from {self.screen_min_rows} rows"
