"""A request's engine outputs (one stream per completion) -> the output tensors of its responses.

The tensors are those of Triton's vLLM backend, with one element per completion (`n`):
`text_output` (each completion's new text when streaming, its whole text otherwise),
`finish_reason`, `cumulative_logprob`, `num_output_tokens` (this response's tokens of each
completion) and `logprobs` (JSON, per completion); `num_input_tokens` once. As that backend's,
`finish_reason` comes in every response of a stream ("None" until the completion ends), `logprobs`
is JSON `null` when the sampling parameter `logprobs` was not given, and the chosen token's
`decoded_token` is the text it decoded to in `text_output` (whole where a stop condition then cut
it). Ours besides:
`prompt_logprobs` (JSON, once, in the first response after the prompt is computed, when the
sampling parameter `prompt_logprobs` asks);
`output_ids` and `output_log_probs` hold the completions' tokens one after another in index
order (`num_output_tokens` says how many are each one's; with n = 1 they are simply the tokens).

Pure numpy, no Triton: the glue (serving/generate_model.py) wraps each array in a pb_utils.Tensor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tritonllm.core.outputs import RequestOutput
from tritonllm.serving.request_parsing import ParsedRequest


# A token a guide or a bias ruled out has log-prob -inf, which JSON cannot write (Python writes
# `-Infinity`, which strict parsers refuse): the JSON gives vLLM's stand-in for it.
MIN_LOGPROB = -9999.0


@dataclass
class _Completion:
    text: list[str] = field(default_factory=list)  # not yet sent (streaming), or all of it
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # per token with top_logprobs: the text it decoded to
    cumulative_logprob: float = 0.0  # of every token so far
    finished: bool = False
    finish_reason: str | None = None
    times: dict = field(default_factory=dict)
    num_cached_prompt_tokens: int = 0


class ResponseAssembler:
    """One request's completions: `add` each engine output, then take the next response's arrays."""

    def __init__(self, parsed: ParsedRequest, decode_token: Callable[[list[int]], str], stream_interval: int = 1):
        self.parsed = parsed
        # Tokens per streamed response: the server's `stream_interval`, or the request's where larger (vLLM's).
        self.stream_interval = max(stream_interval, parsed.params.stream_interval or 1)
        self._decode = decode_token
        self.completions = [_Completion() for _ in range(parsed.params.n)]
        self.num_prompt_tokens = 0
        self._num_finished = 0
        self._prompt_logprobs: list | None = None  # arrived, not yet sent
        self._num_taken = 0  # responses taken so far
        # Not streaming, the prompt leads each full text unless exclude_input_in_output (vLLM backend's);
        # a prompt given as token ids leads it as the text those spell.
        # Decoded when the first text goes out, after the engine has checked the ids: an id out of the
        # tokenizer's range (a negative one) is the request's INVALID_ARG, not an error here.
        self._prompt_prefix: str | None = None

    def _prefix(self) -> str:
        """What leads each full text: the prompt, not streaming and unless exclude_input_in_output."""
        if self._prompt_prefix is None:
            parsed = self.parsed
            self._prompt_prefix = ""
            if not parsed.exclude_input_in_output and not parsed.stream:
                self._prompt_prefix = (parsed.prompt if parsed.prompt is not None
                                       else self._decode(parsed.prompt_token_ids or []))
        return self._prompt_prefix

    @property
    def finished(self) -> bool:
        return self._num_finished == len(self.completions)

    @property
    def num_taken(self) -> int:
        """Responses taken so far."""
        return self._num_taken

    @property
    def has_news(self) -> bool:
        """Whether a streamed response now would carry anything: new tokens, text or an ending."""
        return any(c.ids or c.text for c in self.completions)

    @property
    def due(self) -> bool:
        """Whether a streamed response is due now: there is news, and it is the first response or
        `stream_interval` tokens of some completion have come since the last one. (The final response
        goes when the request finishes, due or not.)"""
        if not self.has_news:
            return False
        return (self.stream_interval == 1 or not self._num_taken
                or max(len(c.ids) for c in self.completions) >= self.stream_interval)

    def add(self, out: RequestOutput) -> None:
        c = self.completions[out.index]
        self.num_prompt_tokens = out.num_prompt_tokens
        if out.new_text:
            c.text.append(out.new_text)
        c.ids += out.new_token_ids
        c.logprobs += out.new_logprobs
        c.top_logprobs += out.new_top_logprobs
        c.token_texts += out.new_token_texts
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = out.prompt_logprobs
        if self.parsed.return_cumulative_logprob:
            c.cumulative_logprob += math.fsum(out.new_logprobs)
        if out.finished and not c.finished:
            c.finished = True
            c.finish_reason = out.finish_reason
            c.times = out.times
            c.num_cached_prompt_tokens = out.num_cached_prompt_tokens
            self._num_finished += 1

    def take_outputs(self) -> dict[str, np.ndarray]:
        """The next response's arrays: what arrived since the last one (streaming; the whole request
        when not streaming, taken once it is finished). Clears what it takes."""
        p = self.parsed
        cs = self.completions
        outputs = {
            "text_output": np.array([(self._prefix() + "".join(c.text)).encode("utf-8") for c in cs],
                                    dtype=np.object_),
            "output_ids": np.array([t for c in cs for t in c.ids], dtype=np.int32),
        }
        if p.return_logprobs:
            outputs["output_log_probs"] = np.array([lp for c in cs for lp in c.logprobs], dtype=np.float32)
            # Without the `logprobs` sampling parameter there are none: JSON null, as the vLLM backend sends.
            outputs["logprobs"] = np.array([self._logprobs_json(c.top_logprobs, c.token_texts)
                                            if p.params.top_logprobs is not None else b"null" for c in cs],
                                           dtype=np.object_)
        if p.return_cumulative_logprob:  # each completion's so far, as the vLLM backend's
            outputs["cumulative_logprob"] = np.array([c.cumulative_logprob for c in cs], dtype=np.float32)
        if p.return_finish_reason:  # in every response, "None" while a completion runs (the vLLM backend's str(None))
            outputs["finish_reason"] = np.array([str(c.finish_reason).encode() for c in cs], dtype=np.object_)
        if p.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([self.num_prompt_tokens], dtype=np.uint32)
        if p.return_num_output_tokens:  # this response's, as the vLLM backend: a stream's sum is the total
            outputs["num_output_tokens"] = np.array([len(c.ids) for c in cs], dtype=np.uint32)
        if self._prompt_logprobs is not None:
            scored = [None if entries is None else self._token_entries(entries) for entries in self._prompt_logprobs]
            outputs["prompt_logprobs"] = np.array([json.dumps(scored).encode("utf-8")], dtype=np.object_)
            self._prompt_logprobs = None
        for c in cs:
            c.text, c.ids, c.logprobs, c.top_logprobs, c.token_texts = [], [], [], [], []
        self._num_taken += 1
        return outputs

    def response_parameters(self) -> dict:
        """For the final response: per-request timestamps (ns since the epoch) and prompt tokens reused."""
        if not self.finished:
            return {}
        times = [c.times for c in self.completions]
        merged = {}
        for key, pick in (("arrival", min), ("scheduled", min), ("first_token", min), ("finished", max)):
            values = [t[key] for t in times if t.get(key)]
            if values:
                merged[f"timing_{key}_ns"] = int(pick(values) * 1e9)
        merged["num_cached_prompt_tokens"] = self.completions[0].num_cached_prompt_tokens
        return merged

    def _logprobs_json(self, top_logprobs: list, token_texts: list[str]) -> bytes:
        """The vLLM backend's `logprobs`: per token {token id: {logprob, rank, decoded_token}}. The chosen
        token (the first key) reads as the text it decoded to in the output, so that a response's chosen
        tokens spell its text_output: "" for an ending EOS whose special text is skipped, where decoding it
        alone gives `<|im_end|>`. A token that ended the output by a stop string or a stop token reads
        whole, as vLLM reports it, though the stop is cut from the text. The other tokens read as they
        decode alone."""
        tokens = []
        for i, entries in enumerate(top_logprobs):
            decoded = self._token_entries(entries)
            if i < len(token_texts):
                decoded[str(entries[0][0])]["decoded_token"] = token_texts[i]
            tokens.append(decoded)
        return json.dumps(tokens).encode("utf-8")

    def _token_entries(self, entries: list[tuple[int, float, int]]) -> dict:
        return {str(t): {"logprob": max(lp, MIN_LOGPROB), "rank": rank, "decoded_token": self._decode([t])}
                for t, lp, rank in entries}
