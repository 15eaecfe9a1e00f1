"""How a step's tokens are chosen from the final hidden states of its sampled rows.

Two paths, picked per step by `head_path`:
- "logits": the LM head's logits, then the sampler (runner/sampler.py) on the device: penalties and
  bans, then argmax or sampling, with each chosen token's log-prob; the device's greedy head may fuse
  the plain-greedy argmax + log-prob into one op (`GreedyHead.argmax_logprob`, devices/backend.py).
- "ids": a plain-greedy step whose rows do not all want log-probs, where the device's greedy head finds
  greedy ids without the full logits (`GreedyHead.ids_without_logits`): those rows take it, the rows
  that want a log-prob take the logits path. The ids are the same either way.
Only `[batch]` ids and log-probs leave the device: `launch_step_tokens` leaves them on the device as
one int32 [2, rows] tensor, whose copy to the host runs behind the device's work (`StepTokens`), so
that the host can build the next step meanwhile and that step can read the ids where they are.
"""

from __future__ import annotations

import math
import time
from functools import partial

import numpy as np
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


class StepTokens:
    """A launched step's chosen tokens: on the device now (`packed`, which the next step's inputs may
    read there), on the host once `result()` has waited for them.

    On an accelerator the [2, rows] tensor is copied into page-locked host memory without blocking,
    and an event recorded after the copy tells when it has landed; on the CPU the tensor is the
    host's already and is copied, since nothing guarantees that the head leaves it alone later.
    """

    def __init__(self, packed: torch.Tensor, wants_logprob: list[bool], ranking: torch.Tensor | None = None,
                 sampling: SamplingBatch | None = None, device_started=None):
        self.packed = packed  # int32 [2, rows] on the device: ids, and the float32 bits of their log-probs
        self._wants_logprob = wants_logprob
        self._ranking = ranking  # [ranked rows, vocab] log-probs, for the rows that want their top ones
        self._sampling = sampling
        self._started = device_started  # an event recorded before the forward, where device time is asked for
        self._ended = None
        self._result: tuple[list[int], list[float], list[TopLogprobs | None]] | None = None
        self.wait_seconds = 0.0  # how long `result()` waited for the device
        if packed.device.type == "cpu":
            self._host, self._landed = packed.clone(), None
            return
        self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._host.copy_(packed, non_blocking=True)
        self._landed = _event(packed.device)
        self._landed.record()
        if device_started is not None:
            self._ended = _event(packed.device, timing=True)
            self._ended.record()

    @classmethod
    def none(cls, device: torch.device) -> "StepTokens":
        """A step that chooses no token (prompt chunks only)."""
        return cls(torch.empty(2, 0, dtype=torch.int32, device=device), [])

    def wait(self) -> None:
        """Block until the ids and log-probs are on the host."""
        if self._landed is not None:
            started = time.perf_counter()
            self._landed.synchronize()
            self.wait_seconds += time.perf_counter() - started
            self._landed = None

    def device_seconds(self) -> float | None:
        """The forward and head's time on the device, where events timed it (after `wait`)."""
        if self._started is None or self._ended is None:
            return None
        self.wait()
        return self._started.elapsed_time(self._ended) / 1000

    def result(self) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
        """Per sampled row: its token id, log-prob (NaN if not asked) and top log-probs (None if not asked)."""
        if self._result is None:
            self.wait()
            self._result = _unpack(self._host.numpy(), self._wants_logprob, self._ranking, self._sampling)
            self._host = self._ranking = None
        return self._result


def _event(device: torch.device, timing: bool = False):
    """A new event of `device`'s kind (torch.cuda.Event, torch.npu.Event)."""
    return getattr(torch, device.type).Event(enable_timing=timing)


def device_started_event(device: torch.device):
    """An event recorded now on `device`, from which `StepTokens.device_seconds` times a step; None on the CPU."""
    if device.type == "cpu":
        return None
    event = _event(device, timing=True)
    event.record()
    return event


def _unpack(packed: np.ndarray, wants_logprob: list[bool], ranking: torch.Tensor | None,
            sampling: SamplingBatch | None) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    ids, logprobs = unpack_tokens(packed)
    top: list[TopLogprobs | None] = [None] * len(wants_logprob)
    if not all(wants_logprob):  # NaN for who did not ask, on every path
        logprobs = [lp if wants else math.nan for lp, wants in zip(logprobs, wants_logprob)]
    if ranking is not None:
        logprobs = list(logprobs)
        for row, entries in zip(sampling.ranked_rows, top_logprobs(ranking, sampling, ids)):
            top[row] = entries
            if wants_logprob[row]:  # the same number as its top entry, not the fused head's own sum
                logprobs[row] = entries[0][1]
    return ids, logprobs, top


def choose_step_tokens(model, head: GreedyHead, hidden: torch.Tensor, sampling: SamplingBatch,
                       wants_logprob: list[bool]) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """Per sampled row (`hidden` [rows, hidden_size]): its token id, log-prob (NaN if not asked) and top
    log-probs (None if not asked)."""
    return launch_step_tokens(model, head, hidden, sampling, wants_logprob).result()


def launch_step_tokens(model, head: GreedyHead, hidden: torch.Tensor, sampling: SamplingBatch,
                       wants_logprob: list[bool], device_started=None) -> StepTokens:
    """The tokens of the sampled rows (`hidden` [rows, hidden_size]) chosen on the device, on their way to
    the host: nothing here waits for the device, except where sampling's top-k, top-p or min-p asks it
    whether any row uses them, and for the rows' top log-probs, found once the ids are on the host."""
    if head_path(sampling, wants_logprob, head) == "ids":
        return StepTokens(_ids_without_logits(model, head, hidden, wants_logprob), wants_logprob,
                          device_started=device_started)
    logits = model.compute_logits(hidden)
    # A step with a row that wants its top log-probs keeps them before the choice changes the logits.
    ranking = ranking_logprobs(logits, sampling) if sampling.ranked_rows is not None else None
    # Where no row asks for its log-prob, the fused head skips computing them (an exp per logit).
    packed = choose_tokens(logits, sampling, partial(head.argmax_logprob, logprobs=any(wants_logprob)))
    return StepTokens(packed, wants_logprob, ranking, sampling, device_started)


def _ids_without_logits(model, head: GreedyHead, hidden: torch.Tensor, wants_logprob: list[bool]) -> torch.Tensor:
    """int32 [2, rows]: the rows that want no log-prob through the head's greedy ids (log-prob NaN), the
    others through the logits."""
    screened = [i for i, wants in enumerate(wants_logprob) if not wants]
    asking = [i for i, wants in enumerate(wants_logprob) if wants]
    got = head.ids_without_logits(model, hidden if not asking else hidden[screened]).to(torch.int32)
    nan_bits = torch.full((len(screened),), math.nan, dtype=torch.float32, device=got.device).view(torch.int32)
    if not asking:
        return torch.stack([got, nan_bits])
    packed = torch.empty(2, len(wants_logprob), dtype=torch.int32, device=got.device)
    packed[:, screened] = torch.stack([got, nan_bits])
    logits = model.compute_logits(hidden[asking])
    packed[:, asking] = choose_tokens(logits, SamplingBatch(), head.argmax_logprob)
    return packed
