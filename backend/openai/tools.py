"""A chat request's tools: checked, turned into the guide that keeps every call well formed, and the
settings that say how this server renders and reads calls (vLLM's `--chat-template`,
`--enable-auto-tool-choice`, `--tool-call-parser`).

Every call the model writes has arguments that its tool's schema accepts, as llguidance guides the
output (tritonllm.guided):
- `tool_choice` "required" or a named function: the whole answer is calls in the parser's format
  (a grammar: one call, or several where `parallel_tool_calls` allows), each with its tool's name and
  JSON for its tool's `parameters`;
- "auto": a structural tag. The text is the model's own until it writes the format's opening marker
  (`<tool_call>` for hermes); from there the call is forced: a tool's name, JSON for its schema, the
  closer. Then the text is free again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tritonllm.core.errors import InvalidRequestError
from tritonllm.guided.grammar import closed_objects, compile_json_schema_grammar, json_compile_options
from tritonllm.openai.protocol import bad_request
from tritonllm.openai.tool_parsers import FORMATS, TOOL_NAME, CallFormat, ToolCallStream

TEMPLATES = Path(__file__).resolve().parent / "templates"
DEFAULT_FORMAT = "hermes"  # "required" and named choices without --tool-call-parser
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSettings:
    """The server's options for chat templates and tool calls."""

    chat_template: str | None = None  # the template's text; None: each tokenizer's own
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in FORMATS:
            raise ValueError(f"tool call parser {self.tool_call_parser!r} is not one of {sorted(FORMATS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file, a template shipped in tritonllm/openai/templates (by name, with or
    without `.jinja`), or the template's text itself (as vLLM takes it)."""
    for candidate in (Path(value), TEMPLATES / value, TEMPLATES / f"{value}.jinja"):
        try:
            if candidate.is_file():
                return candidate.read_text()
        except OSError:  # a template's text is no path
            pass
    if "{{" in value or "{%" in value:
        return value
    shipped = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
    raise ValueError(f"chat template {value!r} is neither a file nor a template (shipped: {shipped})")


@dataclass
class ToolPlan:
    """What a request with tools needs: the tools for the template, the guide, how to read the answer."""

    tools: list[dict]  # for the chat template
    fmt: CallFormat | None  # None (tool_choice "none"): the answer is text, not read for calls
    guide: dict | None
    named: bool = False  # a named function: finish_reason stays "stop", as OpenAI's and vLLM's
    max_calls: int | None = None

    def stream(self) -> ToolCallStream | None:
        return None if self.fmt is None else ToolCallStream(self.fmt, self.max_calls)


def _function(tool, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"tools[{i}]: only tools of type 'function' are supported", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"tools[{i}].function must be an object", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise bad_request(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                          "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return function


def _schema(function: dict, i: int) -> dict:
    """The tool's `parameters`, checked: a schema llguidance can follow, for a JSON object."""
    schema = function.get("parameters") or _NO_PARAMETERS
    if schema.get("type", "object") != "object":
        raise bad_request(f"tools[{i}].function.parameters must describe an object (type 'object'), got type "
                          f"{schema.get('type')!r}", "tools")
    closed = closed_objects(schema)
    try:
        compile_json_schema_grammar(json.dumps(closed, sort_keys=True))
    except InvalidRequestError as exc:
        raise bad_request(f"tools[{i}].function.parameters ({function['name']}) is not a JSON schema that "
                          f"can be followed: {str(exc).removeprefix('guided json: ')}", "tools") from None
    return closed


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _with_options(schema: dict) -> dict:
    # JSON as the json guide writes it; lenient, as `_schema` checked the keywords strictly already and
    # accepted only those known to go unenforced (guided/grammar.py).
    return {**schema, "x-guidance": {**json_compile_options(None), "lenient": True}}


def forced_grammar(fmt: CallFormat, schemas: dict[str, dict], parallel: bool, answer: dict | None = None) -> str:
    """A Lark grammar (llguidance's) for answers that are calls only: one, or several joined by the
    format's separator; with `answer` (a JSON schema), or else a JSON text that follows it."""
    rules = []
    alternatives = []
    for k, (name, schema) in enumerate(schemas.items()):
        rules.append(f"call_{k}: {_lark_string(fmt.call_prefix(name))} args_{k} {_lark_string(fmt.call_suffix())}")
        rules.append(f"args_{k}: %json {json.dumps(_with_options(schema), ensure_ascii=False)}")
        alternatives.append(f"call_{k}")
    calls = f"call ({_lark_string(fmt.separator)} call)*" if parallel else "call"
    if answer is not None:
        rules.append(f"answer: %json {json.dumps(_with_options(answer), ensure_ascii=False)}")
        calls = f"answer | {calls}"
    return "\n".join([f"start: {calls}", "call: " + " | ".join(alternatives), *rules])


def structural_tag(fmt: CallFormat, schemas: dict[str, dict]) -> dict:
    """vLLM's structural tag for calls anywhere in free text, each opened by the format's trigger."""
    return {"structures": [{"begin": fmt.call_prefix(name), "schema": _with_options(schema), "end": fmt.call_suffix()}
                           for name, schema in schemas.items()],
            "triggers": [fmt.trigger]}


def plan_tools(body, settings: ToolSettings) -> ToolPlan | None:
    """The request's tool plan (None without tools); 400 for what cannot be served. With tool_choice
    "none" the template still gets the tools, as vLLM's does, and the answer is text."""
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if choice is None:
        choice = "auto"  # OpenAI's default where tools are given
    named = None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type", "function") == "function" else None
        named = function.get("name") if isinstance(function, dict) else None
        if not isinstance(named, str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if named not in names:
            raise bad_request(f"tool_choice names the function {named!r}, which is not among the tools "
                              f"{names}", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                          "tool_choice")
    template_tools = [{"type": "function", "function": f} for f in functions]
    if choice == "none":
        return ToolPlan(template_tools, None, None)
    answer_schema = _answer_schema(body)
    if choice == "auto":
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              "set", "tool_choice")
    fmt = FORMATS[settings.tool_call_parser or DEFAULT_FORMAT]
    if len(set(names)) != len(names):
        raise bad_request(f"tools name a function twice: {names}", "tools")
    schemas = {f["name"]: _schema(f, i) for i, f in enumerate(functions)}
    parallel = body.parallel_tool_calls is not False
    if named is not None:
        return ToolPlan(template_tools, fmt, {"grammar": forced_grammar(fmt, {named: schemas[named]}, False)},
                        named=True, max_calls=1)
    if choice == "required":
        return ToolPlan(template_tools, fmt, {"grammar": forced_grammar(fmt, schemas, parallel)}, named=False,
                        max_calls=None if parallel else 1)
    if answer_schema is not None:  # calls, or an answer in the response format: one or the other
        return ToolPlan(template_tools, fmt, {"grammar": forced_grammar(fmt, schemas, parallel, answer_schema)},
                        named=False, max_calls=None if parallel else 1)
    return ToolPlan(template_tools, fmt, {"structural_tag": structural_tag(fmt, schemas)}, named=False,
                    max_calls=None if parallel else 1)


def _answer_schema(body) -> dict | None:
    """The JSON schema a text answer must follow beside tools (response_format json_schema or
    json_object), as OpenAI serves the two together; None without one. A call's arguments follow its
    tool's schema, so under "required" or a named function the format has nothing to guide. Other
    guides beside tools: 400."""
    guide = body._guided_decoding()
    if guide is None:
        return None
    if set(guide) == {"json"} and isinstance(guide["json"], dict):
        schema = closed_objects(guide["json"])
        try:  # checked here: in the calls' grammar its complaint would quote that grammar
            compile_json_schema_grammar(json.dumps(schema, sort_keys=True))
        except InvalidRequestError as exc:
            raise bad_request(f"the response format's schema cannot be followed: {str(exc).removeprefix('guided json: ')}",
                              body.guide_field()) from None
        return schema
    if set(guide) == {"json_object"}:
        return {"type": "object"}
    raise bad_request("guided decoding fields (regex, choice, grammar, structural tags) cannot be combined with "
                      "tools (tool_choice other than 'none'): the calls are guided already; response_format "
                      "json_schema and json_object can", body.guide_field())
