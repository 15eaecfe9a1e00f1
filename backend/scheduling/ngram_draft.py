"""Draft tokens for speculative decoding, looked up in the sequence itself (n-gram / prompt lookup).

A greedy sequence whose last n tokens (n = 3, else 2) occurred before in its prompt or output is
likely to go on as it went on then: the tokens that followed that latest earlier occurrence are the
draft. The step then feeds the sequence's last token and the draft as rows of one chunk (one row per
position, each attending to the K/V before it); row j's argmax is the greedy choice after the j-th
draft token, so the drafts are accepted up to the first one that differs from it, and that row's
choice comes on top. The tokens are the ones decoding one at a time would choose, exactly where each
row's arithmetic is a one-token decode's (the CPU kernels: docs/PERFORMANCE.md, engine work log).

On the default model's replay outputs a draft of up to 4 tokens gives ~1.5 tokens per step for ~1.8
rows. A draft row costs what a sequence's row costs, so drafts pay where the step's fixed part (the
weights read once) is most of it, a step of one or a few sequences, or where nearly every draft is
accepted (outputs that copy their prompt): `speculative_max_batch` (docs/PERFORMANCE.md, work log).
Beyond that many sequences, a sequence drafts while its own drafts keep being accepted
(`DraftAcceptance`, `speculative_min_acceptance`): it is tracked on every decode, also from the
draft it would have made, which costs a lookup and no row.
"""

from __future__ import annotations

from tritonllm.core.sequence import Sequence

NGRAM_SIZES = (3, 2)  # longest first: a longer match predicts better, a shorter one matches more often


class NgramIndex:
    """Where each n-gram of a token list last ended, kept up to date as the list grows (O(1) per token)."""

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # every n-gram ending before this position is in _ends

    def draft(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of `tokens`' last n-gram."""
        end = len(tokens)
        ends = self._ends
        for e in range(max(self._indexed, 1), end):  # n-grams ending before `end`: each has a continuation
            for n in NGRAM_SIZES:
                if e >= n:
                    ends[tuple(tokens[e - n:e])] = e
        self._indexed = max(self._indexed, end)
        for n in NGRAM_SIZES:
            if end > n:
                found = ends.get(tuple(tokens[end - n:end]))
                if found is not None:
                    return tokens[found:found + max_tokens]
        return []


class DraftAcceptance:
    """How often a sequence's draft tokens turn out to be the tokens it then chooses: an exponential
    average over draft positions (each one counted while the positions before it were right), starting
    at 0, so a sequence earns drafts in larger steps with 13 right guesses in a row (at a 0.8 bar).

    `expect` records the draft (or, in a step without drafts, the guess) made at a position; the next
    `settle`, once the sequence has grown past it, scores it against the tokens it got."""

    WEIGHT = 1 / 8  # of the newest position in the average

    def __init__(self) -> None:
        self.rate = 0.0
        self._position = 0
        self._guess: list[int] = []

    def expect(self, position: int, guess: list[int]) -> None:
        self._position, self._guess = position, guess

    def settle(self, tokens: list[int]) -> None:
        known = tokens[self._position:self._position + len(self._guess)]
        for guessed, got in zip(self._guess, known):
            right = guessed == got
            self.rate += self.WEIGHT * (right - self.rate)
            if not right:
                break
        if known:
            self._guess = []


def can_draft(seq: Sequence) -> bool:
    """Whether speculation gives this sequence the tokens it would get one step at a time: greedy, its
    logits used as they come (no penalties, bias, bans or guide), no top log-probs, min_tokens met."""
    p = seq.params
    return p.greedy and not p.adjusts_logits and p.top_logprobs is None and seq.num_output_tokens >= p.min_tokens


def draft_for(seq: Sequence, max_draft: int, max_model_len: int) -> list[int]:
    """The draft for a decoding sequence's next step ([] where it cannot draft or nothing matches), no
    longer than its remaining output allows: the step's own choice comes after the accepted drafts."""
    room = max_model_len - seq.num_tokens
    if seq.params.max_tokens is not None:
        room = min(room, seq.params.max_tokens - seq.num_output_tokens)
    k = min(max_draft, room - 1)
    if k <= 0 or not can_draft(seq):
        return []
    if seq.ngram_index is None:
        seq.ngram_index = NgramIndex()
    return seq.ngram_index.draft(seq.token_ids, k)


def accepted_tokens(draft: list[int], chosen: list[int]) -> int:
    """How many of `chosen` (one per row: the last token's, then each draft token's) are the sequence's:
    the first, and each next one while the draft token before it is the one chosen at its row."""
    n = 1
    while n <= len(draft) and draft[n - 1] == chosen[n - 1]:
        n += 1
    return n
