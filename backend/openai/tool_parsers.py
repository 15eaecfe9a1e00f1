"""Tool calls in the model's text: the call formats vLLM's parsers name, and one incremental parser.

A format says how a model writes a call (`CallFormat`): `hermes` wraps each call's JSON in
`<tool_call>...</tool_call>`; `llama3_json` writes the call's JSON alone (`{"name": ..., "parameters":
{...}}`, several joined by `; `, after `<|python_tag|>` where special tokens are kept). Text around the
calls is content. A call starts at the format's marker (`<tool_call>`, or `{"name"`), wherever it is:
the guides (tools.py) let the model start a call after text, so the parser reads one there too.

`ToolCallStream` reads a choice's text as it arrives and gives OpenAI's deltas for it: content, the
first chunk of each call (`index`, `id`, `type`, `function.name`, `function.arguments` ""), then the
call's argument text in fragments (`index` and `function.arguments` only), as OpenAI's and vLLM's
streams do. A whole (not streamed) answer is the same stream fed at once, so both agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class CallFormat:
    """How one call is written: opener + `{"name": NAME, "<args_key>": ARGUMENTS}` + closer."""

    name: str
    opener: str  # text before the call's JSON object
    args_key: str
    closer: str  # text after the call's JSON object
    separator: str  # between two calls, as guides write them
    trigger: str  # what starts a call inside free text (a structural tag's trigger)
    markers: tuple[tuple[str, bool], ...]  # (text that starts a call, whether it precedes the call's JSON)

    def call_prefix(self, tool_name: str) -> str:
        """The call's text up to its arguments."""
        return f'{self.opener}{{"name": {json.dumps(tool_name)}, "{self.args_key}": '

    def call_suffix(self) -> str:
        return "}" + self.closer


FORMATS = {
    "hermes": CallFormat("hermes", opener="<tool_call>\n", args_key="arguments", closer="\n</tool_call>",
                         separator="\n", trigger="<tool_call>", markers=(("<tool_call>", True),)),
    "llama3_json": CallFormat("llama3_json", opener="", args_key="parameters", closer="", separator="; ",
                              trigger='{"name": ', markers=(("<|python_tag|>", True), ('{"name"', False))),
}

# A call's JSON up to its arguments' value. The name comes first, as every format writes it.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_MAX_HEADER = 512  # characters after a call's start within which its header must have appeared


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _JsonValueEnd:
    """Finds where one JSON value ends in text fed piece by piece (strings and nesting respected)."""

    def __init__(self):
        self.started = False
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.scalar = False  # a number, true, false or null: ends at the first delimiter

    def feed(self, text: str) -> int | None:
        """The index just after the value's end in `text`, or None if it goes on."""
        for i, c in enumerate(text):
            if not self.started:
                if c.isspace():
                    continue
                self.started = True
                if c in "{[":
                    self.depth = 1
                elif c == '"':
                    self.in_string = True
                else:
                    self.scalar = True
                continue
            if self.scalar:
                if c in ",}] \t\r\n":
                    return i
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that starts `marker` (text that may still become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallStream:
    """One choice's text -> OpenAI deltas: `{"content": ...}` or `{"tool_calls": [...]}`, in order.

    `max_calls`: calls after this many are read but not reported (`parallel_tool_calls` false)."""

    fmt: CallFormat
    max_calls: int | None = None
    calls: list[ToolCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _buffer: str = ""
    _state: str = "text"  # text | header | arguments | tail | between
    _started_at: str = ""  # the text that opened the current call (content again if it is no call)
    _value: _JsonValueEnd | None = None

    # ---- feeding ----------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        out: list[dict] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self, cut: bool = False) -> list[dict]:
        """The end of the text: what was held back is decided. `cut`: the answer was cut (max_tokens), so
        what is held back is the start of markup it had no room to finish (a call's opening, a closer),
        which is dropped rather than given as content."""
        out: list[dict] = []
        if cut:
            while self._step(out, final=False):
                pass
            if self._state == "tail":  # the arguments' value had ended
                self.calls[-1].complete = True
            self._buffer, self._state = "", "text"
            return out
        while self._step(out, final=True):
            pass
        if self._state == "header":  # a start marker, then no call: it was text
            self._emit_content(out, self._started_at + self._buffer)
        elif self._buffer and self._state == "text":
            self._emit_content(out, self._buffer)
        self._buffer = ""
        return out

    @property
    def reported_calls(self) -> list[ToolCall]:
        return self.calls if self.max_calls is None else self.calls[:self.max_calls]

    def text_content(self) -> str | None:
        """The answer's text outside calls; None where it has calls and no other text (OpenAI's null)."""
        text = "".join(self.content)
        if self.reported_calls and not text.strip():
            return None
        return text

    # ---- the state machine ----------------------------------------------------------------------
    def _step(self, out: list[dict], final: bool) -> bool:
        """Consume what can be decided of the buffer; True if the state changed (step again)."""
        buf, state = self._buffer, self._state
        if state == "text":
            found = min(((buf.find(m), m, before) for m, before in self.fmt.markers if m in buf), default=None)
            if found is not None:
                at, marker, before = found
                self._emit_content(out, buf[:at])
                return self._open_call(buf[at:], buf[at + len(marker):] if before else buf[at:])
            keep = 0 if final else max(_held_prefix(buf, m) for m, _ in self.fmt.markers)
            self._emit_content(out, buf[:len(buf) - keep])
            self._buffer = buf[len(buf) - keep:]
            return False
        if state == "header":
            match = _HEADER.match(buf)
            if match is None:
                if final or len(buf) > _MAX_HEADER or re.search(r'"(arguments|parameters)"\s*:', buf):
                    self._emit_content(out, self._started_at + buf)  # no call after all: text
                    self._buffer, self._state = "", "text"
                return False
            try:
                name = json.loads(f'"{match.group(1)}"')
            except json.JSONDecodeError:
                name = match.group(1)
            call = ToolCall(len(self.calls), new_call_id(), name)
            self.calls.append(call)
            self._report(out, call, {"index": call.index, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": ""}})
            self._buffer, self._state, self._value = buf[match.end():], "arguments", _JsonValueEnd()
            return True
        if state == "arguments":
            if not self._value.started:  # spacing before the value is the format's, not the arguments'
                buf = buf.lstrip()
            end = self._value.feed(buf)
            piece = buf if end is None else buf[:end]
            call = self.calls[-1]
            if piece:
                call.arguments += piece
                self._report(out, call, {"index": call.index, "function": {"arguments": piece}})
            self._buffer = "" if end is None else buf[end:]
            if end is None:
                return False
            self._state = "tail"
            return True
        if state == "tail":  # the call object's "}", then the format's closer
            closer = self.fmt.closer.strip()
            match = re.match(r"\s*\}?\s*", buf)
            rest = buf[match.end():]
            if closer and rest.startswith(closer):
                self.calls[-1].complete = True
                self._buffer, self._state = rest[len(closer):], "text"
                return True
            if not final and (not rest or (closer and closer.startswith(rest))):
                return False  # more may come
            # The call's object closed without the closer (or the answer ended): what follows is text.
            self.calls[-1].complete = "}" in buf[:match.end()] or bool(closer)
            self._buffer, self._state = rest, "between" if not closer else "text"
            return True
        if state == "between":  # llama3_json: `;` and spaces between calls
            match = re.match(r"\s*;?\s*", buf)
            if match.end() == len(buf) and not final:
                return False
            self._buffer, self._state = buf[match.end():], "text"
            return True
        return False

    def _open_call(self, started_at: str, rest: str) -> bool:
        self._started_at = started_at[:len(started_at) - len(rest)]
        self._buffer, self._state = rest, "header"
        return True

    def _emit_content(self, out: list[dict], text: str) -> None:
        if not text:
            return
        # Whitespace between a call's end and the next call (or the answer's end) is the format's, not content.
        if self.calls and not text.strip():
            return
        self.content.append(text)
        if out and "content" in out[-1]:
            out[-1]["content"] += text
        else:
            out.append({"content": text})

    def _report(self, out: list[dict], call: ToolCall, delta: dict) -> None:
        if self.max_calls is None or call.index < self.max_calls:
            out.append({"tool_calls": [delta]})
