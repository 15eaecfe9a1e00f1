"""One step's sampling inputs as device tensors: temperatures, top-k/p, bans, adjustments, generators."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tritonllm.runner.logit_adjustments import LogitAdjustments
from tritonllm.scheduling.scheduler import ScheduledSeq


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for one step, prepared by the model runner (all optional)."""

    temperatures: torch.Tensor | None = None  # [batch] float32; None: all greedy
    top_k: torch.Tensor | None = None  # [batch] int64 (0 = off)
    top_p: torch.Tensor | None = None  # [batch] float32 (1 = off)
    min_p: torch.Tensor | None = None  # [batch] float32 (0 = off)
    generators: list | None = None  # per row: torch.Generator or None
    banned_rows: torch.Tensor | None = None  # with banned_ids: (row, token) pairs to suppress (min_tokens)
    banned_ids: torch.Tensor | None = None
    adjustments: LogitAdjustments | None = None  # penalties, logit_bias, bad words, allowed tokens (logit_adjustments.py)
    # Rows that want their top log-probs (SamplingParams.top_logprobs), and how many each.
    ranked_rows: list[int] | None = None
    ranked_counts: list[int] | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of its logits as they come: the fast greedy heads may run."""
        return self.temperatures is None and self.banned_rows is None and self.adjustments is None


    @classmethod
    def build(cls, sampled: list[ScheduledSeq], eos_token_ids: list[int], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        """The inputs for the step's sampled rows (`sampled`, in logits-row order)."""
        batch = cls()

        def to_device(values: list[int]) -> torch.Tensor:
            return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device, non_blocking=True)

        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, item in enumerate(sampled):
            p = item.seq.params
            if item.seq.num_output_tokens < p.min_tokens:
                # EOS too under ignore_eos, as vLLM and transformers: min_tokens bans it, ignore_eos only
                # keeps a later one from ending the output.
                ban = list(p.stop_token_ids) + eos_token_ids
                banned_rows.extend([row] * len(ban))
                banned_ids.extend(ban)
        if banned_rows:
            batch.banned_rows, batch.banned_ids = to_device(banned_rows), to_device(banned_ids)
        if any(not it.seq.params.greedy for it in sampled):
            ps = [it.seq.params for it in sampled]
            batch.temperatures = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=device)
            # a top_k beyond the vocabulary means no limit
            batch.top_k = torch.tensor([min(p.top_k, vocab_size) for p in ps], dtype=torch.int64, device=device)
            batch.top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device)
            batch.min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device)
            batch.generators = [_generator(it, device) for it in sampled]
        ranked = [(row, it.seq.params.top_logprobs) for row, it in enumerate(sampled)
                  if it.seq.params.top_logprobs is not None]
        if ranked:
            batch.ranked_rows, batch.ranked_counts = [r for r, _ in ranked], [n for _, n in ranked]
        if any(it.seq.params.adjusts_logits for it in sampled):
            batch.adjustments = LogitAdjustments.build(sampled, vocab_size, device)
        return batch


def _generator(item: ScheduledSeq, device: torch.device) -> torch.Generator | None:
    seed = item.seq.params.seed
    if seed is None or item.seq.params.greedy:
        return None
    # Seeded per (seed, position): a preempted and recomputed request samples the same tokens.
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + item.seq.num_tokens) % 2**64)  # any Python int seed
    return gen
