"""vLLM's `prompt_logprobs: N`: at each prompt token after the first, the log-prob the model gave it
from the tokens before it, its rank, and the N most likely tokens there.

A prompt chunk's forward already holds a hidden state for each of its positions; the LM head is
applied to those of a request that asks (the others only ever need their last row). Position p
scores prompt token p + 1, so a chunk that ends inside the prompt scores the first token of the
next chunk, and the prompt's last position is the one the first output token is sampled from.
Such a request computes its whole prompt: a prefix taken from the cache would have no hidden states
to score (scheduling/block_manager.py skips the lookup for it).
"""

from __future__ import annotations

import torch

from tritonllm.runner.sampler import token_first_entries
from tritonllm.scheduling.scheduler import ScheduledSeq

_ROWS_PER_PASS = 256  # rows of [vocab] float32 logits held at once (256 x 49,152: 50 MB)


def positions_to_score(item: ScheduledSeq) -> range:
    """The prompt positions this step's chunk of `item` scores (empty when it needs none)."""
    seq = item.seq
    if not seq.wants_prompt_logprobs:
        return range(0)
    start = max(seq.num_computed_tokens, len(seq.prompt_logprobs))  # a recompute after preemption: once
    end = min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens - 1)
    return range(start, max(start, end))


def score_prompts(model, hidden: torch.Tensor, scheduled: list[ScheduledSeq]) -> None:
    """Append each asking sequence's entries for this step's prompt positions to `seq.prompt_logprobs`:
    per position [(token id, log-prob, rank)] of the prompt's own token, then of the rest of the N
    most likely tokens (`sampler.token_first_entries`)."""
    for item in scheduled:
        positions = positions_to_score(item)
        if not positions:
            continue
        seq = item.seq
        first_row = item.first_row + positions.start - seq.num_computed_tokens
        n = seq.params.prompt_logprobs
        for at in range(0, len(positions), _ROWS_PER_PASS):
            count = min(_ROWS_PER_PASS, len(positions) - at)
            rows = hidden[first_row + at:first_row + at + count]
            logprobs = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)
            start = positions.start + at
            targets = torch.tensor(seq.token_ids[start + 1:start + 1 + count], device=logprobs.device)
            target_lp = logprobs.gather(1, targets.unsqueeze(1))
            ranks = ((logprobs > target_lp).sum(dim=-1) + 1).tolist()
            values, ids = logprobs.topk(n, dim=-1) if n else (logprobs[:, :0], logprobs[:, :0].long())
            for i, (target, lp, rank) in enumerate(zip(targets.tolist(), target_lp[:, 0].tolist(), ranks)):
                seq.prompt_logprobs.append(token_first_entries(target, lp, rank, ids[i].tolist(), values[i].tolist()))
