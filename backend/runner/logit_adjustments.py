"""Changes to listed tokens' logits before the choice: penalties on seen tokens, the caller's
logit_bias, bad words and allowed tokens.

The host lists, for each row that asks, the tokens concerned (the distinct tokens it has seen and
how often, the ids in its logit_bias, the bad words' last tokens due now, the allowed ids, a guide's
next tokens); one indexed write per kind then changes only those logits on the device, so a step pays for those
tokens, not for rows x vocabulary. The penalty formulas are vLLM's (and for the repetition penalty
transformers'): a seen token's logit l becomes l / p if l > 0 else l * p (prompt and output
tokens), then l - frequency * count - presence for each token of the output. logit_bias is
OpenAI's: the value is added to the token's logit, after the penalties. A bad word's last token is
banned where the output so far ends with the word's other tokens (vLLM's bad_words); with
allowed_token_ids, every other token is, and with a guide every token it does not allow next
(guided/decoding.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tritonllm.scheduling.scheduler import ScheduledSeq


@dataclass
class TokenValues:
    """(row, token) pairs, distinct, and one float32 value each; flat tensors on the device."""

    rows: torch.Tensor  # int64
    ids: torch.Tensor  # int64
    values: torch.Tensor  # float32

    @classmethod
    def gather(cls, parts: list[tuple[int, np.ndarray, object]], device: torch.device) -> TokenValues | None:
        """Per row (row, its tokens, one value or one per token) -> flat tensors; None when empty."""
        if not parts:
            return None
        rows = np.concatenate([np.full(len(tokens), row, dtype=np.int64) for row, tokens, _ in parts])
        ids = np.concatenate([tokens for _, tokens, _ in parts])
        values = np.concatenate([np.broadcast_to(np.float32(v), t.shape) for _, t, v in parts]).astype(np.float32)
        return cls(*(torch.from_numpy(a).to(device, non_blocking=True) for a in (rows, ids, values)))


@dataclass
class AllowedTokens:
    """Rows that may choose only some tokens: those rows, and per row which tokens it may not choose.

    A mask rather than (row, token) pairs: a guide inside a JSON string allows ~48k of 49k tokens, and
    pairs for a batch of such rows were millions of indices to send and scatter each step.
    """

    rows: torch.Tensor  # int64 [n]
    forbidden: torch.Tensor  # bool [n, vocab]

    @classmethod
    def gather(cls, parts: list[tuple[int, np.ndarray]], vocab: int, device: torch.device) -> AllowedTokens | None:
        """Per row (row, its allowed tokens: ids, or a bool per token of the tokenizer's vocabulary) -> tensors."""
        if not parts:
            return None
        forbidden = np.ones((len(parts), vocab), dtype=bool)
        for i, (_, allowed) in enumerate(parts):
            if allowed.dtype == np.bool_:  # (a tokenizer may list more tokens than the model has rows)
                n = min(len(allowed), vocab)
                np.logical_not(allowed[:n], out=forbidden[i, :n])
            else:
                forbidden[i, allowed] = False
        rows = np.fromiter((row for row, _ in parts), dtype=np.int64, count=len(parts))
        return cls(*(torch.from_numpy(a).to(device, non_blocking=True) for a in (rows, forbidden)))


def _guide_allows(guide, output: list[int], explicit: np.ndarray | None) -> np.ndarray:
    """A guide's next tokens (a bool per token where the guide gives them so, else ids), and with
    allowed_token_ids (`explicit`, sorted ids) those both allow."""
    mask_of = getattr(guide, "allowed_mask", None)  # guides that allow thousands of tokens at a time
    due = mask_of(output) if mask_of is not None else np.asarray(guide.allowed_tokens(output), dtype=np.int64)
    if explicit is None:
        return due
    if due.dtype == np.bool_:
        inside = explicit[explicit < len(due)]
        both = inside[due[inside]]
    else:
        both = np.intersect1d(explicit, due)
    return both if len(both) else due  # nothing both allow: the guide wins, as the stricter constraint


@dataclass
class LogitAdjustments:
    """A step's penalties, biases, bans and allowed tokens; each kind None when no row has it."""

    repeat: TokenValues | None  # every distinct prompt and output token, and that row's repetition_penalty
    output: TokenValues | None  # every distinct output token: frequency_penalty * count + presence_penalty
    bias: TokenValues | None  # the row's logit_bias
    banned: TokenValues | None  # bad words' last tokens that would complete them now (values unused)
    allowed: AllowedTokens | None  # allowed_token_ids or a guide: every other token of the row is banned

    @classmethod
    def build(cls, sampled: list[ScheduledSeq], vocab: int, device: torch.device) -> LogitAdjustments | None:
        """The adjustments of a step's sampled rows (in logits-row order); None when no row has one."""
        repeat, output, bias, banned, allowed = [], [], [], [], []
        for row, item in enumerate(sampled):
            seq, p = item.seq, item.seq.params
            if not p.adjusts_logits:
                continue
            if p.repetition_penalty != 1.0:
                repeat.append((row, np.unique(np.asarray(seq.token_ids, dtype=np.int64)), p.repetition_penalty))
            if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
                ids, counts = np.unique(np.asarray(seq.output_token_ids, dtype=np.int64), return_counts=True)
                output.append((row, ids, p.frequency_penalty * counts.astype(np.float32) + p.presence_penalty))
            if p.logit_bias:
                bias.append((row, np.fromiter(p.logit_bias, dtype=np.int64, count=len(p.logit_bias)),
                             np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))))
            if seq.bad_word_ids:
                out = seq.output_token_ids
                due = {w[-1] for w in seq.bad_word_ids
                       if len(w) == 1 or (len(out) >= len(w) - 1 and tuple(out[len(out) - len(w) + 1:]) == w[:-1])}
                if due:
                    banned.append((row, np.fromiter(sorted(due), dtype=np.int64, count=len(due)), 0.0))
            if p.allowed_token_ids or seq.guided is not None:
                ids = np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64)) if p.allowed_token_ids else None
                if seq.guided is not None:  # the guide's next tokens (with allowed_token_ids: both)
                    ids = _guide_allows(seq.guided, seq.output_token_ids, ids)
                allowed.append((row, ids))
        if not (repeat or output or bias or banned or allowed):
            return None
        return cls(*(TokenValues.gather(parts, device) for parts in (repeat, output, bias, banned)),
                   AllowedTokens.gather(allowed, vocab, device))

    def apply(self, logits: torch.Tensor) -> None:
        """In place on float32 logits [rows, vocab]. Pairs are distinct per kind, so indexed writes are exact."""
        if self.repeat is not None:
            r = self.repeat
            seen = logits[r.rows, r.ids]
            logits[r.rows, r.ids] = torch.where(seen > 0, seen / r.values, seen * r.values)
        if self.output is not None:
            logits[self.output.rows, self.output.ids] -= self.output.values
        if self.bias is not None:
            logits[self.bias.rows, self.bias.ids] += self.bias.values
        if self.banned is not None:
            logits[self.banned.rows, self.banned.ids] = float("-inf")
        if self.allowed is not None:
            rows = self.allowed.rows
            logits[rows] = logits[rows].masked_fill(self.allowed.forbidden, float("-inf"))
