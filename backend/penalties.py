"""Repetition, presence and frequency penalties: a step's seen tokens, applied to its logits on the device.

The host lists, for each row that asks for a penalty, the distinct tokens it has seen and how
often; one scatter per kind then changes only those logits, so a step pays for the tokens its
penalized rows have seen, not for rows x vocabulary. The formulas are vLLM's (and for the
repetition penalty transformers'): a seen token's logit l becomes l / p if l > 0 else l * p (prompt
and output tokens), then l - frequency * count - presence for each token of the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .scheduler import ScheduledSeq


@dataclass
class LogitPenalties:
    """(row, token) pairs and what each does to its logit; each tensor is flat and on the device."""

    repeat_rows: torch.Tensor  # int64: rows with repetition_penalty != 1 ...
    repeat_ids: torch.Tensor  # int64: ... and every distinct token of their prompt and output
    repeat_factors: torch.Tensor  # float32: that row's repetition_penalty
    output_rows: torch.Tensor  # int64: rows with a presence or frequency penalty ...
    output_ids: torch.Tensor  # int64: ... and every distinct token of their output
    output_subtract: torch.Tensor  # float32: frequency_penalty * count + presence_penalty

    @classmethod
    def build(cls, sampled: list[ScheduledSeq], device: torch.device) -> LogitPenalties | None:
        """The penalties of a step's sampled rows (in logits-row order); None when no row has one."""
        repeat: list[tuple[int, np.ndarray, float]] = []
        output: list[tuple[int, np.ndarray, np.ndarray]] = []
        for row, item in enumerate(sampled):
            seq, p = item.seq, item.seq.params
            if not p.penalized:
                continue
            if p.repetition_penalty != 1.0:
                repeat.append((row, np.unique(np.asarray(seq.token_ids, dtype=np.int64)), p.repetition_penalty))
            if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
                ids, counts = np.unique(np.asarray(seq.output_token_ids, dtype=np.int64), return_counts=True)
                output.append((row, ids, p.frequency_penalty * counts.astype(np.float32) + p.presence_penalty))
        if not repeat and not output:
            return None

        def flat(parts: list[tuple[int, np.ndarray, object]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """Per row (row, its tokens, one value or one per token) -> flat rows, tokens, values on the device."""
            if not parts:
                no_ids = torch.zeros(0, dtype=torch.int64, device=device)
                return no_ids, no_ids, torch.zeros(0, dtype=torch.float32, device=device)
            rows = np.concatenate([np.full(len(tokens), row, dtype=np.int64) for row, tokens, _ in parts])
            tokens = np.concatenate([tokens for _, tokens, _ in parts])
            values = np.concatenate([np.broadcast_to(np.float32(v), t.shape) for _, t, v in parts]).astype(np.float32)
            return tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in (rows, tokens, values))

        return cls(*flat(repeat), *flat(output))

    def apply(self, logits: torch.Tensor) -> None:
        """In place on float32 logits [rows, vocab]."""
        if self.repeat_rows.numel():
            seen = logits[self.repeat_rows, self.repeat_ids]
            logits[self.repeat_rows, self.repeat_ids] = torch.where(
                seen > 0, seen / self.repeat_factors, seen * self.repeat_factors)
        if self.output_rows.numel():
            # Pairs are distinct (np.unique per row), so a plain indexed write is exact.
            logits[self.output_rows, self.output_ids] -= self.output_subtract
