"""OpenAI request bodies, and how each field becomes the Triton model's inputs and sampling parameters.

The model's own checks stay the truth: values are passed on as they are, and a value the engine
refuses comes back as Triton's INVALID_ARG, answered with HTTP 400 and the engine's message. Here
are only what the model cannot see: OpenAI's own fields and defaults, and the features this server
does not offer (refused with 400 naming the field).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Union

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tritonllm.core.sampling_params import MAX_N

logger = logging.getLogger("tritonllm.openai")

# The completions of one request (n per prompt), each a Triton request and a choice built here: checked
# before anything is built, so that a request cannot make the server build millions of them.
MAX_COMPLETIONS = 16384


class OpenAIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable_error",
             500: "internal_server_error"}

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "internal_server_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request", param)


def _where(loc) -> str:
    """A pydantic error's place as a field path: without `body` or `query`, nor the union member it tried
    (`str`, `list[dict[str,any]]`), which names no field of the request."""
    parts = [str(p) for p in loc if p not in ("body", "query")]
    return ".".join(p for k, p in enumerate(parts) if k == 0 or not (p in _TYPE_NAMES or "[" in p))


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def invalid(errors: list[dict]) -> OpenAIError:
    """pydantic's complaints as one 400, naming the first field at fault."""
    problems = []
    for error in errors:
        where = _where(error.get("loc", ()))
        problems.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    param = _where(errors[0].get("loc", ())) if errors else ""
    return OpenAIError(400, "; ".join(dict.fromkeys(problems)) or "invalid request body", "invalid_request",
                       param or None)


def _finite(value) -> bool:
    """Whether every number in a parsed JSON value is finite (walked without recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def parse_body(model_class, data: bytes):
    """A request body as `model_class`, or a 400. JSON only: NaN and Infinity, which Python's JSON writes
    but JSON has not, are refused here (echoed back, they would make the answer no JSON either)."""
    try:
        value = pydantic_core.from_json(data, allow_inf_nan=False)
    except ValueError as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}", "invalid_request") from None
    if not _finite(value):  # a number beyond float's range (1e400) reads as infinity
        raise OpenAIError(400, "the request body holds a number too large for a float (JSON numbers here must be "
                          "finite)", "invalid_request")
    try:
        return model_class.model_validate(value)
    except ValidationError as exc:
        raise invalid(exc.errors()) from None


def check_context(max_model_len: int | None, num_input_tokens: int, max_tokens: int | None,
                  truncate_prompt_tokens: int | None = None, param: str = "messages") -> None:
    """vLLM's 400s for a prompt that leaves no room in `max_model_len`, and for a `max_tokens` beyond what
    it leaves (with vLLM's words, which clients match to shorten a request)."""
    if max_model_len is None:
        return
    if truncate_prompt_tokens is not None:  # the model keeps the prompt's end (-1: as much as fits)
        keep = max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep > 0:
            num_input_tokens = min(num_input_tokens, keep)
    if num_input_tokens >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your request "
                          f"has {num_input_tokens} input tokens. Please reduce the length of the input messages.",
                          param)
    if max_tokens is not None and max_tokens > max_model_len - num_input_tokens:
        raise bad_request(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                          f"context length is {max_model_len} tokens and your request has {num_input_tokens} input "
                          f"tokens ({max_tokens} > {max_model_len} - {num_input_tokens}).", "max_tokens")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # structural_tag's `structures` and `triggers`
    type: str
    json_schema: dict | None = None


# The request fields passed on to the model's sampling parameters under the same names.
PASSED_ON = ("n", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p", "min_tokens",
             "ignore_eos", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
             "spaces_between_special_tokens", "bad_words", "allowed_token_ids", "priority", "truncate_prompt_tokens",
             "prompt_logprobs")


class RequestBody(BaseModel):
    """A request body of this server's. Fields it does not know are kept aside (and ignored), as vLLM's
    server does, so that clients written for other servers keep working."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        # OpenAI's clients send null for a field they leave unset (n=None, stream=None): its default then.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    def field_of(self, name: str) -> str:
        """The field of this request that sets the model's parameter (or the chat request's field) `name`."""
        return name

    def guide_field(self) -> str | None:
        """The field of this request that asked for guided decoding (the first, where several did)."""
        return None

    def named(self, error: OpenAIError) -> OpenAIError:
        """`error`, its `param` the field this request's client sent (the guide's, for the model's
        complaints about a guide)."""
        if error.param is None and error.status == 400 and error.message.startswith("guided"):
            error.param = self.guide_field()
        if error.param is not None:
            error.param = self.field_of(error.param)
        return error


_GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")


class _Request(RequestBody):
    """Fields both completion endpoints take. Fields of neither OpenAI nor vLLM are logged once."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None  # accepted, not used
    # vLLM's extra sampling fields, passed on under the same names (docs/API.md lists them).
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    priority: int | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    # vLLM's guided decoding fields, and its newer `structured_outputs` object.
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted: llguidance is the only backend
    structured_outputs: dict | None = None

    def _check_common(self) -> None:
        """What both endpoints refuse before building anything, in the engine's and vLLM's words."""
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be >= 1, got {self.n}" if self.n < 1 else f"n must be at most {MAX_N}, got {self.n}",
                              "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")

    def warn_ignored(self) -> None:
        warn_ignored(self.model_extra or {})

    def guide_field(self) -> str | None:
        return next((name for name in _GUIDE_FIELDS if getattr(self, name) is not None), None)

    def _sampling(self, max_tokens: int | None) -> dict[str, Any]:
        """The model's `sampling_parameters` for this request (values not set are left to the model)."""
        params: dict[str, Any] = {name: getattr(self, name) for name in PASSED_ON if getattr(self, name) is not None}
        # OpenAI's default temperature is 1 (sampling); the model's is 0 (greedy).
        params["temperature"] = 1.0 if self.temperature is None else self.temperature
        params["max_tokens"] = max_tokens
        if self.logit_bias:
            params["logit_bias"] = self.logit_bias
        guide = self._guided_decoding()
        if guide is not None:
            params["guided_decoding"] = guide
        return params

    def _guided_decoding(self) -> dict | None:
        kinds: dict[str, Any] = {}
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":
                kinds["json_object"] = True
            elif rf.type == "json_schema":
                schema = (rf.json_schema or {}).get("schema")
                if schema is None:
                    raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
                kinds["json"] = schema
            elif rf.type == "structural_tag":
                extra = rf.model_extra or {}
                kinds["structural_tag"] = {"structures": extra.get("structures"), "triggers": extra.get("triggers")}
            else:
                raise bad_request(f"response_format type {rf.type!r} is not supported: text, json_object, "
                                  "json_schema or structural_tag", "response_format")
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                kinds[kind] = getattr(self, field)
        if self.structured_outputs is not None:
            kinds.update(self.structured_outputs)
        if not kinds:
            return None
        if self.guided_whitespace_pattern is not None:
            kinds["whitespace_pattern"] = self.guided_whitespace_pattern
        return kinds  # more than one kind: the model refuses it, naming them

    def wants_usage(self) -> tuple[bool, bool]:
        """(usage chunk at the end, usage in every chunk), for streams: as vLLM's, the usage in every chunk only
        where the last chunk's is asked for too."""
        if self.stream_options is None:
            return False, False
        include = bool(self.stream_options.include_usage)
        return include, include and bool(self.stream_options.continuous_usage_stats)


_WARNED: set[str] = set()


def warn_ignored(names) -> None:
    """Log a request field this server does not know, once per name."""
    for name in sorted(names):
        if name not in _WARNED:
            _WARNED.add(name)
            logger.warning("request field %r is not known to this server and is ignored", name)


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise bad_request("prompt must not be empty", "prompt")
        if len(prompts) * self.n > MAX_COMPLETIONS:
            raise bad_request(f"{len(prompts)} prompts with n={self.n} are {len(prompts) * self.n} completions; at most "
                              f"{MAX_COMPLETIONS} in one request", "prompt")
        return prompts

    def field_of(self, name: str) -> str:
        return "prompt" if name == "input_ids" else name

    def check(self) -> None:
        self._check_common()
        if self.suffix:
            raise bad_request("suffix (insertion) is not supported", "suffix")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (the prompt's log-probs: prompt_logprobs)", "echo")

    def sampling_parameters(self) -> dict[str, Any]:
        params = self._sampling(self.max_tokens)
        if self.best_of is not None:
            params["best_of"] = self.best_of
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        return params

    @property
    def return_logprobs(self) -> bool:
        return self.logprobs is not None


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _template_call(call: dict) -> dict:
    """An assistant message's call as chat templates take it: arguments as an object where they are JSON
    text (OpenAI sends text; templates write `arguments | tojson`), as vLLM passes them."""
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except (json.JSONDecodeError, RecursionError):  # nested too deep for Python: the template gets the text
            pass
    return {**call, "function": function}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id: passed to the template
    role: str
    content: Union[str, list[dict], None] = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    functions: list[dict] | None = None
    function_call: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    modalities: list[str] | None = None
    audio: dict | None = None
    # vLLM's chat template fields.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None

    def check(self) -> None:
        self._check_common()
        if self.functions and self.function_call != "none":
            raise bad_request("functions (deprecated) are not supported: use tools", "functions")
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                raise bad_request(f"messages[{i}]: unknown role {m.role!r}; a message's role is one of "
                                  f"{', '.join(ROLES)}", "messages")
            extra = m.model_extra or {}
            if m.role == "tool" and not isinstance(extra.get("tool_call_id"), str):
                raise bad_request(f"messages[{i}]: a message of role 'tool' needs tool_call_id, the id of the call it "
                                  "answers", "messages")
            calls = extra.get("tool_calls")
            if calls is not None and (m.role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls)):
                raise bad_request(f"messages[{i}].tool_calls: a list of calls, each with function.name and "
                                  "function.arguments, in an assistant message", "messages")
        if self.audio is not None or (self.modalities and set(self.modalities) - {"text"}):
            raise bad_request("only text output is supported", "modalities")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs true", "top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")

    def template_messages(self) -> list[dict]:
        """The messages as the chat template takes them: text content only, `developer` as `system`."""
        out = []
        for i, m in enumerate(self.messages):
            message = {**(m.model_extra or {}), "role": "system" if m.role == "developer" else m.role}
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    # An assistant's refusal part is its text too (OpenAI's message history; vLLM takes it so).
                    kind = "refusal" if part.get("type") == "refusal" and m.role == "assistant" else "text"
                    if part.get("type") != kind or not isinstance(part.get(kind), str):
                        raise bad_request(f"messages[{i}]: only text content parts (and an assistant's refusal) are "
                                          f"supported, got {part.get('type')!r}", "messages")
                    texts.append(part[kind])
                content = "\n".join(texts)  # as vLLM joins a message's text parts
            message["content"] = content if content is not None else ""
            if m.role == "assistant" and message.get("tool_calls"):
                message["tool_calls"] = [_template_call(c) for c in message["tool_calls"]]
            out.append(message)
        return out

    def template_kwargs(self) -> dict:
        """apply_chat_template's keyword arguments: the request's extra template variables, then ours."""
        kwargs = dict(self.chat_template_kwargs or {})
        kwargs.update(add_generation_prompt=self.add_generation_prompt,
                      continue_final_message=self.continue_final_message)
        return kwargs

    def field_of(self, name: str) -> str:
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return {"logprobs": "top_logprobs", "input_ids": "messages"}.get(name, name)

    @property
    def max_new_tokens(self) -> int | None:
        # OpenAI's chat default: no limit but the context (max_model_len).
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_parameters(self, tool_guide: dict | None = None) -> dict[str, Any]:
        params = self._sampling(self.max_new_tokens)
        if tool_guide is not None:  # tools.plan_tools refuses it beside another guide
            params["guided_decoding"] = tool_guide
        if self.logprobs:
            params["logprobs"] = self.top_logprobs or 0
        return params

    @property
    def return_logprobs(self) -> bool:
        return self.logprobs

