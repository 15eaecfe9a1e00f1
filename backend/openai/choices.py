"""Triton outputs -> OpenAI's completion objects, whole or as stream chunks.

A request's choices are numbered prompt by prompt: choice `k * n + i` is completion i of prompt k
(several prompts are a `/v1/completions` feature). Each Triton response carries, per completion, the
new text, its token count, and with log-probs the model's `logprobs` JSON: per token, the chosen
token first, then the N most likely ones with their ranks (docs/API.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tritonllm.openai.reasoning import ReasoningStream, ThinkingTokens
from tritonllm.openai.tool_parsers import ToolCallStream
from tritonllm.openai.tools import ToolPlan
from tritonllm.openai.triton import TritonOutput


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    # chat: OpenAI's logprobs.content items; completions: tokens, token_logprobs, top_logprobs, text_offset
    chat_logprobs: list[dict] = field(default_factory=list)
    completion_logprobs: dict = field(default_factory=lambda: {"tokens": [], "token_logprobs": [],
                                                               "top_logprobs": [], "text_offset": []})
    text_length: int = 0  # characters so far, for text_offset


@dataclass
class Delta:
    """What one Triton response added to one choice."""

    index: int
    text: str
    logprobs: dict | list | None
    finish_reason: str | None
    tool_calls: list[dict] | None = None  # chat with tools: this delta's part of the calls
    reasoning: str = ""  # chat with a reasoning parser: this delta's thinking (before its text)


def _finish_reason(reason: str | None) -> str | None:
    # The model's reasons are vLLM's: stop, length, abort. OpenAI knows stop and length.
    return None if reason is None else ("length" if reason == "length" else "stop")


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class Choices:
    """The state of one request's choices: `add` each Triton response, then build the object or chunks."""

    def __init__(self, chat: bool, n: int, num_prompts: int, top_logprobs: int | None, echo: list[str] | None = None,
                 tools: ToolPlan | None = None, token_bytes: Callable[[int], bytes | None] | None = None,
                 thinking: bool | None = None, decode: Callable[[list[int]], str] | None = None):
        """`token_bytes`: token id -> its own bytes (token_bytes.py), for chat log-probs' `bytes`; None: the
        UTF-8 of each token's text. `thinking`: chat with a reasoning parser (reasoning.py), whether the
        answer starts inside the thinking block; None: no parser. `decode`: token ids -> text (special
        tokens kept), to count the thinking's tokens for usage; None: not counted."""
        self.chat, self.n, self.top_n = chat, n, top_logprobs
        self._token_bytes = token_bytes
        self.choices = [_Choice() for _ in range(n * num_prompts)]
        # Chat with tools: each choice's text is read for calls as it arrives.
        self._tools = tools
        self._calls: list[ToolCallStream | None] = [tools.stream() if tools is not None else None
                                                    for _ in self.choices]
        # With a reasoning parser: each choice's thinking is read apart from its answer first.
        self._reasoning = [ReasoningStream(thinking=thinking) if thinking is not None else None
                           for _ in self.choices]
        self._thinking_tokens = [ThinkingTokens(decode) if thinking is not None and decode is not None else None
                                 for _ in self.choices]
        self._ids_missing = False  # a response without token ids (another model): no thinking count
        self.prompt_tokens = [0] * num_prompts
        self.prompt_logprobs: list = [None] * num_prompts
        self._echo = echo  # completions with echo: each prompt's text, leading its choices' text
        self._echoed: set[int] = set()
        self.created = int(time.time())

    def add(self, prompt_index: int, out: TritonOutput) -> list[Delta]:
        if out.num_input_tokens is not None:
            self.prompt_tokens[prompt_index] = out.num_input_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs
        deltas = []
        for i, text in enumerate(out.texts):
            index = prompt_index * self.n + i
            choice = self.choices[index]
            if self._echo is not None and index not in self._echoed:
                self._echoed.add(index)
                text = self._echo[prompt_index] + text
            choice.tokens += out.token_counts[i] if i < len(out.token_counts) else 0
            counter = self._thinking_tokens[index]
            if counter is not None:
                if out.ids is not None and i < len(out.ids):
                    counter.ids += out.ids[i]
                else:
                    self._ids_missing = True
            logprobs = None
            if out.top_logprobs is not None and i < len(out.top_logprobs):
                logprobs = self._logprobs(choice, out.top_logprobs[i])
            reasoning = ""
            thoughts = self._reasoning[index]
            if thoughts is not None:
                reasoning, text = thoughts.feed(text)
                if out.final:
                    more, rest = thoughts.finish()
                    reasoning, text = reasoning + more, text + rest
            choice.text.append(text)
            choice.text_length += len(text)
            calls = self._calls[index]
            if calls is not None:
                deltas += self._tool_deltas(index, calls, text, logprobs, out, reasoning)
                continue
            if out.final and out.finish_reasons is not None:
                choice.finish_reason = _finish_reason(out.finish_reasons[i])
            if text or logprobs or reasoning or (out.final and choice.finish_reason is not None):
                deltas.append(Delta(index, text, logprobs, choice.finish_reason if out.final else None,
                                    reasoning=reasoning))
        return deltas

    def reasoning(self, index: int) -> str | None:
        """Choice `index`'s thinking so far: None without a reasoning parser, or where it had none."""
        thoughts = self._reasoning[index]
        return ("".join(thoughts.reasoning) or None) if thoughts is not None else None

    def tool_calls(self, index: int) -> ToolCallStream | None:
        """Choice `index`'s calls as read so far (None without tools, or with tool_choice "none")."""
        return self._calls[index]

    def _tool_deltas(self, index: int, calls: ToolCallStream, text: str, logprobs, out: TritonOutput,
                     reasoning: str = "") -> list[Delta]:
        """A chat choice with tools: its new text as content and tool call deltas, each a chunk of its own."""
        parts = calls.feed(text)
        choice = self.choices[index]
        if out.final:
            reason = _finish_reason(out.finish_reasons[index % self.n]) if out.finish_reasons is not None else None
            parts += calls.finish(cut=reason == "length")
            if out.finish_reasons is not None:
                # As OpenAI's and vLLM's: calls end an answer with "tool_calls", but for a named function.
                if reason == "stop" and not self._tools.named and any(c.complete for c in calls.reported_calls):
                    reason = "tool_calls"
                choice.finish_reason = reason
        deltas = [Delta(index, part.get("content", ""), None, None, part.get("tool_calls")) for part in parts]
        if reasoning:
            deltas.insert(0, Delta(index, "", None, None, reasoning=reasoning))
        if logprobs and not deltas:
            deltas.append(Delta(index, "", None, None))
        if out.final and choice.finish_reason is not None and not deltas:
            deltas.append(Delta(index, "", None, None))
        if deltas:
            deltas[0].logprobs = logprobs
            if out.final:
                deltas[-1].finish_reason = choice.finish_reason
        return deltas

    def _logprobs(self, choice: _Choice, tokens: list[dict]):
        """This response's tokens in OpenAI's log-probs form; also appended to the choice's."""
        top_n = self.top_n or 0
        if self.chat:
            items = []
            for entries in tokens:
                ranked = sorted(entries.items(), key=lambda item: item[1]["rank"])
                token_id, chosen = next(iter(entries.items()))
                items.append({"token": chosen["decoded_token"], "logprob": chosen["logprob"],
                              "bytes": self._bytes(token_id, chosen["decoded_token"]),
                              "top_logprobs": [{"token": e["decoded_token"], "logprob": e["logprob"],
                                                "bytes": self._bytes(t, e["decoded_token"])} for t, e in ranked[:top_n]]})
            choice.chat_logprobs += items
            return items
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = choice.text_length
        for entries in tokens:
            ranked = sorted(entries.values(), key=lambda e: e["rank"])
            chosen = next(iter(entries.values()))
            part["tokens"].append(chosen["decoded_token"])
            part["token_logprobs"].append(chosen["logprob"])
            # As OpenAI's and vLLM's: the sampled token is always among them (up to logprobs + 1 entries).
            top = {chosen["decoded_token"]: chosen["logprob"]}
            top.update((e["decoded_token"], e["logprob"]) for e in ranked[:top_n])
            part["top_logprobs"].append(top)
            part["text_offset"].append(offset)
            offset += len(chosen["decoded_token"])
        for key, values in part.items():
            choice.completion_logprobs[key] += values
        return part

    def _bytes(self, token_id: str, text: str) -> list[int]:
        own = self._token_bytes(int(token_id)) if self._token_bytes is not None else None
        return list(own) if own is not None else _bytes(text)

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens)
        completion = sum(c.tokens for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        counters = [c for c in self._thinking_tokens if c is not None]
        if counters and not self._ids_missing:  # OpenAI's field, for reasoning models
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(
                counter.count(thoughts.thinking or thoughts.closed)
                for counter, thoughts in zip(self._thinking_tokens, self._reasoning))}
        return usage

    # ---- whole responses ----------------------------------------------------------------------
    def response(self, request_id: str, model: str, want_logprobs: bool) -> dict:
        choices = []
        for index, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.chat:
                message = {"role": "assistant", "content": text}
                calls = self._calls[index]
                if calls is not None:  # the text outside calls: markup (even cut short) is not content
                    complete = [c.message() for c in calls.reported_calls if c.complete]
                    message["content"] = calls.text_content() if complete else (calls.text_content() or "")
                    if complete:
                        message["tool_calls"] = complete
                if self._reasoning[index] is not None:  # vLLM's field, and its name before
                    message["reasoning"] = message["reasoning_content"] = self.reasoning(index)
                choice = {"index": index, "message": message,
                          "logprobs": {"content": c.chat_logprobs} if want_logprobs else None,
                          "finish_reason": c.finish_reason}
            else:
                choice = {"index": index, "text": text,
                          "logprobs": c.completion_logprobs if want_logprobs else None,
                          "finish_reason": c.finish_reason}
            if self.prompt_logprobs[index // self.n] is not None:  # vLLM's field
                choice["prompt_logprobs"] = self.prompt_logprobs[index // self.n]
            choices.append(choice)
        return {"id": request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": model, "choices": choices, "usage": self.usage()}

    # ---- stream chunks ------------------------------------------------------------------------
    def chunk(self, request_id: str, model: str, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": model, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def first_chunk_choices(self) -> list[dict]:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        if not self.chat:
            return []
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(self.choices))]

    def delta_choice(self, delta: Delta) -> dict:
        if self.chat:
            message = {"content": delta.text} if delta.text else {}
            if delta.reasoning:
                message["reasoning"] = message["reasoning_content"] = delta.reasoning
            if delta.tool_calls:
                message["tool_calls"] = delta.tool_calls
            choice = {"index": delta.index, "delta": message,
                      "logprobs": {"content": delta.logprobs} if delta.logprobs is not None else None,
                      "finish_reason": delta.finish_reason}
        else:
            choice = {"index": delta.index, "text": delta.text, "logprobs": delta.logprobs,
                      "finish_reason": delta.finish_reason}
        return choice
