"""What the engine hands back to callers after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One request's news from one step: only what is new since the previous output."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int = 0
    times: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when the request failed in the engine; the caller gets this message
    error_kind: str | None = None  # "InvalidRequestError", "QueueFullError" or "EngineDeadError"
    # Per new token, when the request asked (top_logprobs): (token id, log-prob, rank) of the chosen
    # token, then of the rest of the N most likely tokens (sampler.token_first_entries).
    new_top_logprobs: list[list[tuple[int, float, int]]] = field(default_factory=list)
    # With top log-probs (and detokenize): per new token, the text it decoded to in the output, so that
    # they spell the output's text ("" for an ending EOS or a skipped special token), save that the token
    # ending it by a stop string or stop token keeps its whole text where the stop is cut from the output.
    new_token_texts: list[str] = field(default_factory=list)
    index: int = 0  # which of the request's n completions (request_id is then "<request>/<index>")
    # With prompt_logprobs, in the request's first output (completion 0): per prompt token, None for the
    # first, then entries as new_top_logprobs' for the prompt's own token (runner/prompt_logprobs.py).
    prompt_logprobs: list | None = None


@dataclass
class CompletionOutput:
    """A whole finished request, as returned by `Engine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    num_cached_prompt_tokens: int = 0
    times: dict[str, float] = field(default_factory=dict)
    top_logprobs: list[list[tuple[int, float, int]]] = field(default_factory=list)  # per token, if asked
    index: int = 0  # which of the prompt's n completions
    prompt_logprobs: list | None = None  # if asked (completion 0 only): as RequestOutput's
