"""How a step's tokens are chosen from the final hidden states of its sampled rows.

Two paths, picked per step by `head_path`:
- "logits": the LM head's logits, then the sampler (runner/sampler.py) on the device: penalties and
  bans, then argmax or sampling, with each chosen token's log-prob; the device's greedy head may fuse
  the plain-greedy argmax + log-prob into one op (`GreedyHead.argmax_logprob`, devices/backend.py).
- "ids": a plain-greedy step whose rows do not all want log-probs, where the device's greedy head finds
  greedy ids without the full logits (`GreedyHead.ids_without_logits`): those rows take it, the rows
  that want a log-prob take the logits path. The ids are the same either way.
Only `[batch]` ids and log-probs leave the device.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from tritonllm.devices.backend import GreedyHead
from tritonllm.runner.sampler import choose_tokens, ranking_logprobs, top_logprobs, unpack_tokens
from tritonllm.runner.sampling_batch import SamplingBatch

TopLogprobs = list[tuple[int, float, int]]  # (token id, log-prob, rank), the chosen token first


def head_path(sampling: SamplingBatch, wants_logprob: list[bool], head: GreedyHead) -> str:
    """"ids" where the device's greedy ids without logits serve the step, else "logits"."""
    if (sampling.plain_greedy and sampling.ranked_rows is None and not all(wants_logprob)
            and head.finds_ids_without_logits(len(wants_logprob))):
        return "ids"
    return "logits"


def choose_step_tokens(model, head: GreedyHead, hidden: torch.Tensor, sampling: SamplingBatch,
                       wants_logprob: list[bool]) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """Per sampled row (`hidden` [rows, hidden_size]): its token id, log-prob (NaN if not asked) and top
    log-probs (None if not asked)."""
    top: list[TopLogprobs | None] = [None] * len(wants_logprob)
    if head_path(sampling, wants_logprob, head) == "ids":
        return (*_ids_without_logits(model, head, hidden, wants_logprob), top)
    logits = model.compute_logits(hidden)
    # A step with a row that wants its top log-probs keeps them before the choice changes the logits.
    ranking = ranking_logprobs(logits, sampling) if sampling.ranked_rows is not None else None
    # Where no row asks for its log-prob, the fused head skips computing them (an exp per logit).
    packed = choose_tokens(logits, sampling, partial(head.argmax_logprob, logprobs=any(wants_logprob)))
    ids, logprobs = unpack_tokens(packed.cpu().numpy())  # the step's one device -> host transfer
    if not all(wants_logprob):  # NaN for who did not ask, on every path
        logprobs = [lp if wants else math.nan for lp, wants in zip(logprobs, wants_logprob)]
    if ranking is not None:
        logprobs = list(logprobs)
        for row, entries in zip(sampling.ranked_rows, top_logprobs(ranking, sampling, ids)):
            top[row] = entries
            if wants_logprob[row]:  # the same number as its top entry, not the fused head's own sum
                logprobs[row] = entries[0][1]
    return ids, logprobs, top


def _ids_without_logits(model, head: GreedyHead, hidden: torch.Tensor,
                        wants_logprob: list[bool]) -> tuple[list[int], list[float]]:
    """The rows that want no log-prob through the head's greedy ids, the others through the logits."""
    screened = [i for i, wants in enumerate(wants_logprob) if not wants]
    asking = [i for i, wants in enumerate(wants_logprob) if wants]
    ids, logprobs = [0] * len(wants_logprob), [math.nan] * len(wants_logprob)
    got = head.ids_without_logits(model, hidden if not asking else hidden[screened])
    for i, token in zip(screened, got.tolist()):
        ids[i] = token
    if asking:
        logits = model.compute_logits(hidden[asking])
        asked_ids, asked_logprobs = unpack_tokens(choose_tokens(logits, SamplingBatch(), head.argmax_logprob).cpu().numpy())
        for i, token, logprob in zip(asking, asked_ids, asked_logprobs):
            ids[i], logprobs[i] = token, logprob
    return ids, logprobs
