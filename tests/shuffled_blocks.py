"""`ShuffledBlocks`: sequences advanced step by step on KV blocks drawn in shuffled order, giving each
step's host inputs as the scheduler would hand them over (the device contract tests'
tests/test_flashinfer_contract.py and tests/test_npu_contract.py)."""

from __future__ import annotations

import torch

from tritonllm.core.sampling_params import SamplingParams
from tritonllm.core.sequence import Sequence
from tritonllm.runner.step_inputs import HostStep, build_host_step
from tritonllm.scheduling.scheduler import ScheduledSeq


class ShuffledBlocks:
    """Each sequence's blocks come off a shuffled free list as its tokens need them, so that no path
    can get away with reading blocks in order."""

    def __init__(self, num_blocks: int, block_size: int, gen: torch.Generator):
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def host_step(self, new_tokens: dict[str, int]) -> HostStep:
        """The host inputs of one step feeding `new_tokens` per sequence (1: a decode; more: a prompt or
        its chunk) after what each has computed; those tokens then count as computed."""
        scheduled = []
        for name, new in new_tokens.items():
            computed = self.computed.setdefault(name, 0)
            blocks = self.blocks.setdefault(name, [])
            while len(blocks) * self.block_size < computed + new:
                blocks.append(self.free.pop())
            seq = Sequence(name, list(range(computed + new)), SamplingParams())
            seq.num_computed_tokens = computed
            seq.block_table = list(blocks)
            scheduled.append(ScheduledSeq(seq, new))
        host, _ = build_host_step(scheduled, self.block_size)
        for name, new in new_tokens.items():
            self.computed[name] += new
        return host
