"""One request's state inside the engine. Token counters are the single source of truth."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from tritonllm.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller or the server


_arrival_counter = itertools.count()


@dataclass
class RequestTimes:
    """Per-request timestamps (time.time() seconds): arrival, scheduled, first token, finish."""

    arrival: float = 0.0
    scheduled: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"arrival": self.arrival, "scheduled": self.scheduled,
                "first_token": self.first_token, "finished": self.finished}


class Sequence:
    """Prompt + generated tokens, KV bookkeeping (block table, computed tokens) and stop state."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, index: int = 0):
        self.request_id = request_id  # this sequence's own id ("<request>/<index>" when n > 1)
        self.parent_id = request_id  # the request's id, which its n completions share (set by the engine)
        self.index = index  # which of its request's n completions this is
        # A sibling completion (n > 1) waits until this sequence's prompt is in the KV cache, then
        # takes those blocks from the prefix cache instead of computing the prompt again.
        self.prefill_after: Sequence | None = None
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt followed by output
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float, int]]] = []  # per output token, if asked
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival_index = next(_arrival_counter)
        self.times = RequestTimes(arrival=arrival_time if arrival_time is not None else time.time())
        # KV state: tokens whose K/V are in the cache, and the blocks that hold them.
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # The sliding layers' blocks, where they have a pool of their own (scheduling/window_pool.py); else empty.
        self.window_block_table: list[int] = []
        self.num_cached_prompt_tokens = 0  # reused from the prefix cache at admission
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # chained hashes of full blocks, for the prefix cache
        self.bad_word_ids: list[tuple[int, ...]] = []  # params.bad_words as token ids (set by the engine)
        # params.guided_decoding's guide, with this sequence's progress through it (set by the engine):
        # a guided.grammar.GrammarCursor
        self.guided = None
        # params.prompt_logprobs: per prompt position p < num_prompt_tokens - 1, the entries scoring token
        # p + 1 (runner/prompt_logprobs.py), filled as the prompt's chunks run
        self.prompt_logprobs: list[list[tuple[int, float, int]]] = []
        self.ngram_index = None  # where its n-grams last ended, for speculative drafts (scheduling/ngram_draft.py; made on first use)
        self.draft_acceptance = None  # how often its drafts are right (ngram_draft.DraftAcceptance; made on first use)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether this sequence scores its prompt: asked for, and the first of the request's completions
        (the others share the same prompt)."""
        return self.params.prompt_logprobs is not None and self.index == 0

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def waits_for_prefix(self) -> bool:
        """Whether admission should wait for the sequence whose prompt blocks this one will share."""
        lead = self.prefill_after
        return lead is not None and not lead.is_finished and lead.num_computed_tokens < lead.num_prompt_tokens

    def append_token(self, token_id: int, logprob: float, top: list[tuple[int, float, int]] | None = None) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.times.finished = time.time()

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
