"""Warm-up at load: the step shapes that first requests would otherwise pay for (allocations, kernel
choices, packed-weight crossovers), run once on throw-away sequences."""

from __future__ import annotations

import logging
import time

from tritonllm.devices import platform
from tritonllm.core.sampling_params import SamplingParams
from tritonllm.core.sequence import Sequence
from tritonllm.runner.model_runner import ModelRunner
from tritonllm.scheduling.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)


def warm_up(runner: ModelRunner, max_num_batched_tokens: int, max_num_seqs: int) -> None:
    """A prefill at the full token budget (or the device backend's `warmup_prompt_tokens`), two prompts
    sharing it, a decode at the full batch and one at a single row."""
    started = time.perf_counter()
    budget = min(max_num_batched_tokens, runner.max_model_len)
    if runner.backend.capabilities.warmup_prompt_tokens is not None:
        budget = min(budget, runner.backend.capabilities.warmup_prompt_tokens)
    forward_dummy(runner, [budget])
    forward_dummy(runner, [budget // 2, budget - budget // 2])
    # Decodes without log-probs: the greedy screen's path where there is one (the others took the logits path).
    forward_dummy(runner, [1] * min(max_num_seqs, runner.num_blocks), logprobs=False)
    forward_dummy(runner, [1], logprobs=False)  # one row: the exact-block GEMMs where there are any
    logger.info("warm-up took %.2f s", time.perf_counter() - started)


def forward_dummy(runner: ModelRunner, num_tokens_per_seq: list[int], logprobs: bool = True) -> None:
    """One step over throw-away sequences written into unallocated blocks (skipped if they do not fit)."""
    bs = runner.block_size
    next_block = 0
    items = []
    for i, n in enumerate(num_tokens_per_seq):
        seq = Sequence(f"warmup-{i}", [0] * n, SamplingParams(max_tokens=1, logprobs=logprobs))
        nb = -(-n // bs)
        seq.block_table = list(range(next_block, next_block + nb))
        if runner.num_window_blocks:  # throw-away K/V: sequences may share window-pool blocks
            seq.window_block_table = [b % runner.num_window_blocks for b in seq.block_table]
        next_block += nb
        items.append(ScheduledSeq(seq, n))
    if next_block > runner.num_blocks:
        return
    runner.execute(runner.prepare(items))
    platform.synchronize(runner.device)
