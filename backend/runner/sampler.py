"""The fused head: LM head, token choice and its log-prob on the device; only [batch] values leave it.

Greedy rows take the argmax; rows with temperature > 0 sample (top-k / top-p / min-p applied) by
inverse CDF with one uniform number per row, still on the device. The chosen ids and their log-probs travel to the host
in one int32 [2, batch] tensor (the log-probs' float32 bits reinterpreted), i.e. one transfer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tritonllm.runner.sampling_batch import SamplingBatch


def choose_tokens(logits: torch.Tensor, batch: SamplingBatch,
                  greedy_head: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> torch.Tensor:
    """logits [batch, vocab] -> int32 [2, batch]: token ids and the float32 bits of their log-probs.

    `greedy_head`: a device backend's fused op for an all-greedy batch, in the same packed form (it
    returns None where it does not apply).
    """
    if greedy_head is not None and batch.plain_greedy:
        packed = greedy_head(logits)
        if packed is not None:
            return packed
    logits = logits.float()
    _change_logits(logits, batch)
    logprobs_all = None
    max_logit, ids = logits.max(dim=-1)
    if batch.temperatures is not None:
        sampled = _sample(logits, batch)
        ids = torch.where(batch.temperatures > 0, sampled, ids)
        logprobs_all = torch.log_softmax(logits, dim=-1)
        chosen = logprobs_all.gather(1, ids.unsqueeze(1)).squeeze(1)
    else:  # log-prob of the max = -log(sum(exp(logits - max))): logsumexp without finding the max again
        # In place: logits is this step's own tensor, and a fresh [batch, vocab] buffer costs page faults.
        chosen = logits.sub_(max_logit.unsqueeze(1)).exp_().sum(dim=-1).log_().neg_()
    return torch.stack([ids.to(torch.int32), chosen.contiguous().view(torch.int32)])


def _change_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Logit adjustments and min_tokens bans, in place on float32 logits: what the choice sees."""
    if batch.adjustments is not None:
        batch.adjustments.apply(logits)
    if batch.banned_rows is not None:
        logits[batch.banned_rows, batch.banned_ids] = float("-inf")


def ranking_logprobs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[ranked rows, vocab] log-probs of the logits as the choice sees them. Call it before
    `choose_tokens`, which changes the logits in place."""
    changed = logits.float().clone()
    _change_logits(changed, batch)
    return torch.log_softmax(changed[batch.ranked_rows], dim=-1)


def token_first_entries(token: int, token_lp: float, token_rank: int, top_ids: list[int],
                        top_values: list[float]) -> list[tuple[int, float, int]]:
    """(token id, log-prob, rank) of `token` itself, then of the other tokens of `top_ids` (the N most
    likely), as vLLM lists them: a reader finds the chosen (or prompt) token first, and N or N + 1 entries. `token_rank` (1 + the tokens
    more likely than it) is used when it is not among `top_ids`; within them it keeps its place there."""
    top = [(t, lp, r + 1) for r, (t, lp) in enumerate(zip(top_ids, top_values))]
    own = next((e for e in top if e[0] == token), (token, token_lp, token_rank))
    return [own] + [e for e in top if e[0] != token]


def top_logprobs(logprobs: torch.Tensor, batch: SamplingBatch, chosen_ids: list[int]) -> list[list[tuple[int, float, int]]]:
    """Per ranked row: (token id, log-prob, rank) of the chosen token, then of the rest of its N
    most likely tokens (`token_first_entries`)."""
    chosen = torch.tensor([chosen_ids[r] for r in batch.ranked_rows], device=logprobs.device)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = ((logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
    k = max(batch.ranked_counts)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen.unsqueeze(1)[:, :0])
    return [token_first_entries(chosen_ids[row], float(chosen_lp[i, 0]), ranks[i], ids[i, :n].tolist(),
                                values[i, :n].tolist())
            for i, (row, n) in enumerate(zip(batch.ranked_rows, batch.ranked_counts))]


_TOP_P_WINDOW = 256  # top_p's cut is looked for among a row's most likely tokens first (see _top_p)


def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    temps = batch.temperatures.clamp(min=1e-5).unsqueeze(1)
    scaled = logits / temps
    if batch.top_k is not None and bool((batch.top_k > 0).any()):
        scaled = _top_k(scaled, batch.top_k)
    probs = torch.softmax(scaled, dim=-1)
    if batch.top_p is not None and bool((batch.top_p < 1).any()):
        probs = _top_p(probs, batch.top_p)
    if batch.min_p is not None and bool((batch.min_p > 0).any()):
        # After top-k and top-p, as transformers; relative to the most likely token, which survives them all.
        floor = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    # Inverse CDF: one uniform number per row, and the token whose slice of the running total holds
    # u x the total. The exponential race (argmax of p / E) would need one random draw per vocabulary
    # entry, which costs far more than the sums. In float32 a token's slice is off by at most half an
    # ulp of the running total.
    uniform = torch.empty(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    if batch.generators is None or not any(batch.generators):
        uniform.uniform_()
    else:
        for row, gen in enumerate(batch.generators):
            uniform[row].uniform_(generator=gen)
    cumulative = probs.cumsum(dim=-1)
    ids = (cumulative <= uniform * cumulative[:, -1:]).sum(dim=-1).clamp_(max=probs.shape[1] - 1)
    # Rounding could land on a token of probability 0 (masked) at the very end of the row: take the mode.
    return torch.where(probs.gather(1, ids.unsqueeze(1)).squeeze(1) > 0, ids, probs.argmax(dim=-1))


def _top_k(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Rows with top_k > 0 keep the tokens at least as likely as their k-th (ties kept).

    torch.topk over the largest k asked for, not a sort of the vocabulary, which costs far more.
    """
    limited = top_k > 0
    k = top_k.clamp(min=1, max=scaled.shape[1])
    largest = scaled.topk(int(k[limited].max()), dim=-1).values
    kth = largest.gather(1, (k.clamp(max=largest.shape[1]) - 1).unsqueeze(1))
    return scaled.masked_fill(limited.unsqueeze(1) & (scaled < kth), float("-inf"))


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows with top_p < 1 keep the most likely tokens while the mass before each is <= top_p.

    The cut is looked for among each row's _TOP_P_WINDOW most likely tokens (torch.topk); a row whose
    cut lies beyond them (a very flat distribution) is sorted in full. Tokens as likely as the last
    one kept are kept too.
    """
    window = min(_TOP_P_WINDOW, probs.shape[1])
    largest = probs.topk(window, dim=-1).values
    kept = ((largest.cumsum(dim=-1) - largest) <= top_p.unsqueeze(1)).sum(dim=-1)
    cut = largest.gather(1, (kept - 1).clamp(min=0).unsqueeze(1))
    applies = (top_p < 1).unsqueeze(1)
    out = probs.masked_fill(applies & (probs < cut), 0.0)
    beyond = ((kept >= window) & (top_p < 1)).nonzero().flatten()
    if len(beyond):
        sorted_probs, order = probs[beyond].sort(dim=-1, descending=True)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[beyond].unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        out[beyond] = probs[beyond].masked_fill(drop, 0.0)
    return out


def unpack_tokens(packed: np.ndarray) -> tuple[list[int], list[float]]:
    """Host side of the single transfer: int32 [2, batch] -> (ids, log-probs)."""
    return packed[0].tolist(), packed[1].view(np.float32).tolist()
