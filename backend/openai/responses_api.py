"""OpenAI's Responses API (`POST /v1/responses`) on the chat path.

A Responses request is a chat request in other clothes: `instructions` and the `input` items become
chat messages (function calls an assistant's `tool_calls`, their outputs `tool` messages), function
tools become chat tools, `text.format` a `response_format`. The chat path renders, guides and parses
it (server.py); `ResponseOutput` turns its text and tool call deltas into the Responses API's output
items (a `message` with `output_text`, a `function_call` per call) and, streaming, into its events
(`response.created` ... `response.completed`), each with its `sequence_number`.

Responses are kept (`store`, true by default as OpenAI's) in a bounded store in this process, so that
`previous_response_id` continues a conversation and `GET /v1/responses/{id}` finds one; a restart of
this server forgets them. A background response (`background: true`) is kept from its start, with its
events when it was created streaming (background_responses.py runs it).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Union

from pydantic import ValidationError

from tritonllm.openai.protocol import PASSED_ON, ChatCompletionRequest, OpenAIError, RequestBody, bad_request
from tritonllm.openai.choices import Delta
from tritonllm.openai.tool_parsers import TOOL_NAME, ToolCallStream

MAX_STORED = 2048  # responses kept for previous_response_id; the oldest go first
MAX_STORED_BYTES = 256 << 20  # and at most this much of their JSON (long conversations are kept whole)
# vLLM's sampling and guided decoding fields that a Responses request may carry too (as extra body
# fields), passed on as the chat endpoint passes them.
_PASSED_ON = tuple(name for name in PASSED_ON if name != "n") + (
    "logit_bias", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern",
    "structured_outputs")
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "summary_text": "text"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = ("user", "assistant", "system", "developer")
# The chat request's fields (and the model's parameters) that errors name -> the Responses request's.
_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text", "logprobs": "top_logprobs", "input_ids": "input"}


class ResponsesRequest(RequestBody):
    """The request fields this server reads; others are ignored (and logged once), as by vLLM."""

    model: str | None = None
    input: Union[str, list[dict]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None  # OpenAI's bound on built-in tools' calls: none are served here; echoed
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: dict | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    metadata: dict | None = None
    user: str | None = None
    truncation: str | None = None
    reasoning: dict | None = None  # accepted (effort is the model's own); thinking: --reasoning-parser
    background: bool | None = None
    stream_options: dict | None = None  # OpenAI's `include_obfuscation`: nothing to obfuscate here

    def check(self) -> None:
        for name, what in (("conversation", "conversations (send the items, or previous_response_id)"),
                           ("prompt", "stored prompt templates (send the instructions and input)")):
            if (self.model_extra or {}).get(name) is not None:
                raise bad_request(f"{name} is not supported: this server keeps no {what}", name)
        if self.background and not self.store:  # OpenAI's rule: its answer is only ever fetched from the store
            raise bad_request("background responses must be stored: leave store out, or set it true", "background")
        if self.truncation not in (None, "disabled", "auto"):
            raise bad_request(f"truncation must be 'auto' or 'disabled', got {self.truncation!r}", "truncation")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise bad_request(f"max_output_tokens must be at least 1, got {self.max_output_tokens}",
                              "max_output_tokens")
        if isinstance(self.input, str) and not self.input:
            raise bad_request("input must not be empty", "input")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs}", "top_logprobs")

    def field_of(self, name: str) -> str:
        return _FIELDS.get(name, name)

    def guide_field(self) -> str | None:
        if _response_format(self.text) is not None:
            return "text"
        return next((name for name in _PASSED_ON if name.startswith(("guided_", "structured_"))
                     and (self.model_extra or {}).get(name) is not None), None)

    def named(self, error: OpenAIError) -> OpenAIError:
        """An error of the chat request that serves this one, in this request's words."""
        super().named(error)
        if error.param == "tools":  # the chat form's path to a tool's fields; the Responses form is flat
            error.message = re.sub(r"tools\[(\d+)\]\.function\.", r"tools[\1].", error.message)
        if error.param == "max_output_tokens":
            error.message = error.message.replace("'max_tokens' or 'max_completion_tokens'", "'max_output_tokens'")
        return error

    def ignored_fields(self) -> list[str]:
        return sorted(name for name in self.model_extra or {} if name not in _PASSED_ON)

    @property
    def wants_logprobs(self) -> bool:
        # As OpenAI's and vLLM's: `include` asks for them; `top_logprobs` says how many alternatives.
        return LOGPROBS_INCLUDE in (self.include or [])

    # ---- as a chat request ------------------------------------------------------------------------
    def chat_request(self, conversation: list[dict]) -> ChatCompletionRequest:
        """The chat request that serves this one: the instructions, then `conversation` (the messages of
        a stored conversation this one continues, then the input's: `input_messages`)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + conversation
        if not messages:
            raise bad_request("input must hold at least one message", "input")
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls}
        extra = self.model_extra or {}
        chat.update((name, extra[name]) for name in _PASSED_ON if name in extra)
        if self.tools:
            chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = _response_format(self.text)
        if response_format is not None:
            chat["response_format"] = response_format
        if self.wants_logprobs:
            chat["logprobs"] = True
            chat["top_logprobs"] = self.top_logprobs or 0
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as exc:  # a passed-on field of the wrong type: it has the request's name
            first = exc.errors()[0]
            name = str(first["loc"][0]) if first.get("loc") else None
            raise bad_request(f"{name}: {first.get('msg')}" if name else str(first.get("msg")), name) from None

    def input_items(self) -> list[dict]:
        """The input as OpenAI lists a response's input items: each an object with an `id`, a message's
        text as a content part."""
        raw = [{"type": "message", "role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        items = []
        for item in raw:
            item = {"type": "message", **item}
            if item["type"] == "message" and isinstance(item.get("content"), str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
            item.setdefault("id", _id({"message": "msg", "function_call": "fc"}.get(item["type"], "item")))
            items.append(item)
        return items

    def input_messages(self) -> list[dict]:
        """The input as chat messages: a text is one user message; items in order, consecutive function
        calls joined into the assistant message before them (one turn's calls)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict] = []
        for i, item in enumerate(self.input):
            if not isinstance(item, dict):
                raise bad_request(f"input[{i}] must be an object (an input item)", "input")
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in _ROLES:
                    raise bad_request(f"input[{i}]: a message's role is one of {', '.join(_ROLES)}, got {role!r} "
                                      "(a tool's result is a function_call_output item)", "input")
                messages.append({"role": role, "content": _message_text(item.get("content"), i, role)})
            elif kind == "function_call":
                call = _call(item, i)
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                call_id = item.get("call_id")
                if not isinstance(call_id, str):
                    raise bad_request(f"input[{i}]: a function_call_output needs the call_id of the call it answers",
                                      "input")
                text = _message_text(item.get("output"), i, "tool", "output")
                messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            elif kind == "reasoning":
                continue  # another model's reasoning: nothing this one reads
            else:
                raise bad_request(f"input[{i}]: items of type {kind!r} are not supported (message, function_call, "
                                  "function_call_output)", "input")
        return messages


def _message_text(content, i: int, role: str, field: str = "content") -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].{field} must be a text or a list of content parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) or ("refusal" if kind == "refusal" and role == "assistant" else None)
        if key is None:
            raise bad_request(f"input[{i}].{field}: only text content parts are supported, got {kind!r}", "input")
        if not isinstance(part.get(key), str):
            raise bad_request(f"input[{i}].{field}: a part of type {kind!r} needs its {key} as a string", "input")
        texts.append(part[key])
    return "\n".join(texts)


def _call(item: dict, i: int) -> dict:
    name, arguments, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
    if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
        raise bad_request(f"input[{i}]: a function_call needs call_id, name and arguments (JSON text)", "input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _chat_tool(tool, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"tools[{i}]: only function tools are supported, got {kind!r}", "tools")
    if "name" not in tool and isinstance(tool.get("function"), dict):
        raise bad_request(f"tools[{i}]: the Responses API's function tools are flat, {{\"type\": \"function\", "
                          "\"name\": ..., \"parameters\": ...}, not chat's {\"function\": {...}}", "tools")
    if not isinstance(tool.get("name"), str) or not TOOL_NAME.match(tool["name"]):
        raise bad_request(f"tools[{i}].name must be 1 to 64 letters, digits, '_' or '-', got {tool.get('name')!r}",
                          "tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                      "tool_choice")


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format json_schema needs a schema", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise bad_request(f"text.format type {kind!r} is not supported: text, json_object or json_schema", "text")


# ---- the output -----------------------------------------------------------------------------------

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _OpenItem:
    item: dict
    output_index: int
    text: list[str] = field(default_factory=list)  # a message's text, a call's arguments, or the thinking
    logprobs: list[dict] = field(default_factory=list)


class ResponseOutput:
    """One response: the chat path's deltas (one choice) -> output items, and the stream's events."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body = body
        self.response: dict[str, Any] = {
            "id": _id("resp"), "object": "response", "created_at": int(time.time()),
            "status": "queued" if body.background else "in_progress", "background": bool(body.background), "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls, "model": model, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "top_logprobs": body.top_logprobs,
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": body.truncation or "disabled",
            "usage": None, "user": body.user, "metadata": body.metadata or {}}
        self._sequence = 0
        self._space = ""  # whitespace not yet known to start a message
        self._open: _OpenItem | None = None
        self._calls: dict[int, _OpenItem] = {}  # the chat deltas' call index -> its item

    @property
    def id(self) -> str:
        return self.response["id"]

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))  # the response as it is now, not as it will be

    def current(self) -> dict:
        """The response as it stands, the item being written included with its text so far (its own
        dict gets the text only when it closes)."""
        response = self._snapshot()
        open_ = self._open
        if open_ is not None:
            item, text = response["output"][open_.output_index], "".join(open_.text)
            if item["type"] == "message":
                item["content"] = [{"type": "output_text", "text": text, "annotations": [],
                                    "logprobs": open_.logprobs if self.body.wants_logprobs else []}]
            elif item["type"] == "reasoning":
                item["content"] = [{"type": "reasoning_text", "text": text}]
            else:
                item["arguments"] = text
        return response

    def start(self) -> list[dict]:
        created = self._event("response.created", response=self._snapshot())  # a background one: queued
        self.response["status"] = "in_progress"
        return [created, self._event("response.in_progress", response=self._snapshot())]

    def add(self, delta: Delta) -> list[dict]:
        events: list[dict] = []
        if delta.reasoning:  # a reasoning model's thinking: an item of its own, before the answer's
            open_ = self._open
            if open_ is None or open_.item["type"] != "reasoning":
                events += self._close()
                open_ = self._open_item({"id": _id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                                         "content": []})
                events.append(self._event("response.output_item.added", output_index=open_.output_index,
                                          item=dict(open_.item)))
                events.append(self._event("response.content_part.added", item_id=open_.item["id"],
                                          output_index=open_.output_index, content_index=0,
                                          part={"type": "reasoning_text", "text": ""}))
            open_.text.append(delta.reasoning)
            events.append(self._event("response.reasoning_text.delta", item_id=open_.item["id"],
                                      output_index=open_.output_index, content_index=0, delta=delta.reasoning))
        text = delta.text
        open_ = self._open
        if text and (open_ is None or open_.item["type"] != "message"):
            # Whitespace between items (after the thinking, before a call) is no message: held until
            # text comes that is one.
            self._space += text
            text = "" if not text.strip() else self._space
            if text:
                self._space = ""
                events += self._close()
                events += self._open_message()
                open_ = self._open
        if text:
            logprobs = list(delta.logprobs) if isinstance(delta.logprobs, list) else []
            if delta.reasoning:  # the piece's tokens spell its thinking first: only the last ones are the text's
                logprobs = _last_tokens(logprobs, len(delta.text))
            open_.text.append(text)
            open_.logprobs += logprobs
            events.append(self._event("response.output_text.delta", item_id=open_.item["id"],
                                      output_index=open_.output_index, content_index=0, delta=text,
                                      logprobs=logprobs))
        for call in delta.tool_calls or []:
            item = self._calls.get(call["index"])
            function = call.get("function") or {}
            if item is None:
                self._space = ""
                events += self._close()
                item = self._calls[call["index"]] = self._open_item(
                    {"id": _id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                     "call_id": call.get("id") or _id("call"), "name": function.get("name", "")})
                events.append(self._event("response.output_item.added", output_index=item.output_index,
                                          item=dict(item.item)))
            if function.get("arguments"):
                item.text.append(function["arguments"])
                events.append(self._event("response.function_call_arguments.delta", item_id=item.item["id"],
                                          output_index=item.output_index, delta=function["arguments"]))
        return events

    def _open_item(self, item: dict) -> _OpenItem:
        self.response["output"].append(item)
        self._open = _OpenItem(item, len(self.response["output"]) - 1)
        return self._open

    def _open_message(self) -> list[dict]:
        item = self._open_item({"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                                "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=item.output_index, item=dict(item.item)),
                self._event("response.content_part.added", item_id=item.item["id"], output_index=item.output_index,
                            content_index=0, part=part)]

    def _close(self, status: str = "completed", complete_calls: set[str] | None = None) -> list[dict]:
        open_, self._open = self._open, None
        if open_ is None:
            return []
        item, index = open_.item, open_.output_index
        text = "".join(open_.text)
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            item["status"] = status
            return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=index, item=dict(item))]
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [],
                    "logprobs": open_.logprobs if self.body.wants_logprobs else []}
            item["content"] = [part]
            item["status"] = status
            return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                text=text, logprobs=part["logprobs"]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=index, item=dict(item))]
        item["arguments"] = text
        finished = complete_calls is None or item["call_id"] in complete_calls
        item["status"] = "completed" if finished else "incomplete"
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=text, name=item["name"]),
                self._event("response.output_item.done", output_index=index, item=dict(item))]

    def finish(self, finish_reason: str | None, calls: ToolCallStream | None, usage: dict) -> list[dict]:
        """The last events: open items closed, then `response.completed` (or `response.incomplete`, where
        max_output_tokens cut the answer). The response is whole after it."""
        cut = finish_reason == "length"
        complete = {c.id for c in calls.reported_calls if c.complete} if calls is not None else None
        events = self._close("incomplete" if cut else "completed", complete)
        if all(item["type"] == "reasoning" for item in self.response["output"]):  # an empty answer is still a message
            events += self._open_message()
            events += self._close("incomplete" if cut else "completed")
        self.response["status"] = "incomplete" if cut else "completed"
        if cut:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.response["usage"] = {
            "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {
                "reasoning_tokens": usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}
        kind = "response.incomplete" if cut else "response.completed"
        return events + [self._event(kind, response=self._snapshot())]

    def cancelled(self) -> list[dict]:
        """A background response stopped by `POST /v1/responses/{id}/cancel`: what it had written stays, its
        open item incomplete. OpenAI streams no event of its own for a cancel: the stream just ends."""
        events = self._close("incomplete")
        self.response["status"] = "cancelled"
        return events

    def failed(self, error: OpenAIError) -> list[dict]:
        """A stream's end after its headers went: OpenAI's `error` event, then `response.failed`."""
        self.response["status"] = "failed"
        # OpenAI's codes for a failed response: the request's fault, or the server's.
        code = "invalid_prompt" if 400 <= error.status < 500 else "server_error"
        self.response["error"] = {"code": code, "message": error.message}
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=self._snapshot())]

    def as_messages(self) -> list[dict]:
        """The output as chat messages, for a conversation that continues from this response."""
        messages: list[dict] = []
        for item in self.response["output"]:
            if item["type"] == "message":
                messages.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
            elif item["type"] == "function_call" and item["status"] == "completed":
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return messages


def _last_tokens(tokens: list[dict], length: int) -> list[dict]:
    """The last of a piece's tokens (chat log-probs items), as many as spell its last `length` characters."""
    taken, covered = [], 0
    for item in reversed(tokens):
        if covered >= length:
            break
        taken.append(item)
        covered += len(item["token"])
    return taken[::-1]


# ---- kept responses -------------------------------------------------------------------------------

@dataclass
class _Kept:
    response: dict
    conversation: list[dict]  # the messages through it
    items: list[dict]  # its request's input items
    events: list[dict] | None  # a background response created streaming: its events, for GET ?stream=true
    size: int
    running: ResponseOutput | None  # a background response while it runs: shown as it stands


class ResponseStore:
    """The last MAX_STORED responses (fewer where they hold more than MAX_STORED_BYTES), each with the
    conversation that led to it (its instructions left out: OpenAI does not carry them to the next
    response). A background response is put when it starts and again when it ends."""

    def __init__(self, capacity: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._bytes = 0

    def history(self, response_id: str) -> list[dict]:
        if response_id not in self._kept:
            raise OpenAIError(400, f"Previous response with id '{response_id}' not found: it was not stored "
                              "(store false), or this server no longer keeps it (it keeps the last "
                              f"{self.capacity}, and forgets them when it restarts)", "previous_response_not_found",
                              "previous_response_id")
        kept = self._kept[response_id]
        if kept.response["status"] in ("queued", "in_progress"):
            raise bad_request(f"Previous response with id '{response_id}' is still {kept.response['status']}: "
                              "continue it once it has ended", "previous_response_id")
        return [dict(m) for m in kept.conversation]

    def put(self, output: ResponseOutput, conversation: list[dict], items: list[dict] | None = None,
            events: list[dict] | None = None) -> None:
        """Keep `output`'s response, with `conversation` (the messages it answered, instructions left out),
        its request's input `items` (ResponsesRequest.input_items) and, for a streamed background response,
        its `events`. Putting a kept response again replaces it in place."""
        whole = conversation + output.as_messages()
        items = items or []
        size = sum(len(json.dumps(part)) for part in (output.response, whole, items, events or []))
        if output.id in self._kept:
            self._bytes -= self._kept[output.id].size
        running = output if output.response["status"] in ("queued", "in_progress") else None
        self._kept[output.id] = _Kept(output.response, whole, items, events, size, running)
        self._bytes += size
        while len(self._kept) > self.capacity or (self._bytes > self.max_bytes and len(self._kept) > 1):
            self._bytes -= self._kept.popitem(last=False)[1].size

    def events(self, response_id: str) -> list[dict]:
        """The events of a background response created streaming, as far as it has come."""
        self.get(response_id)
        events = self._kept[response_id].events
        if events is None:
            raise bad_request(f"Response {response_id} cannot be streamed: only a background response created "
                              "with stream true keeps its events", "stream")
        return events

    def input_items(self, response_id: str, after: str | None = None, limit: int = 20, order: str = "desc") -> dict:
        """OpenAI's list of a response's input items, a page at a time (newest first unless order=asc)."""
        self.get(response_id)
        if not 1 <= limit <= 100:
            raise bad_request(f"limit must be in [1, 100], got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
        items = self._kept[response_id].items
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"after: no input item {after!r} in response {response_id}", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def get(self, response_id: str) -> dict:
        if response_id not in self._kept:
            raise OpenAIError(404, f"Response with id '{response_id}' not found", "not_found", "response_id")
        kept = self._kept[response_id]
        return kept.running.current() if kept.running is not None else kept.response

    def delete(self, response_id: str) -> dict:
        self.get(response_id)
        self._bytes -= self._kept.pop(response_id).size
        return {"id": response_id, "object": "response", "deleted": True}
