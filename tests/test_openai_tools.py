"""Tool calls on /v1/chat/completions: the call parsers on canned model text (no server), then through a
real tritonserver and the OpenAI server with the `openai` SDK and LangChain's `ChatOpenAI.bind_tools`.

The server runs smollm2 with the shipped Hermes-style template (`--chat-template chatml_hermes_tools
--enable-auto-tool-choice --tool-call-parser hermes`). A 135M model does not choose tools well, so the
tests that need a call ask for one ("required" or a named function) and check the calls' form and that
their arguments fit the tool's schema, not the model's judgement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tritonllm.core.errors import InvalidRequestError
from tritonllm.guided.grammar import compile_grammar
from tritonllm.guided.structural_tag import structural_tag_grammar, structural_tag_text
from tritonllm.openai.protocol import ChatCompletionRequest, OpenAIError, check_context
from tritonllm.openai.choices import Choices
from tritonllm.openai.tool_parsers import FORMATS, ToolCallStream
from tritonllm.openai.tools import ToolSettings, plan_tools, read_chat_template
from tritonllm.openai.triton import TritonOutput

pytestmark = pytest.mark.unit

MODEL = "smollm2"
WEATHER_SCHEMA = {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 12},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": WEATHER_SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                                  "maxLength": 8}},
                                                        "required": ["zone"]}}}
HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", '
               '"note": "a } and \\" inside"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
               '{"zone": "CET"}}\n</tool_call>')
SERVING = ToolSettings(chat_template=None, enable_auto_tool_choice=True, tool_call_parser="hermes")


def fits_weather(arguments: str) -> bool:
    """The schema's rules, checked by hand: the two properties, a short city, a unit of the enum."""
    value = json.loads(arguments)
    return (isinstance(value, dict) and set(value) == {"city", "unit"} and isinstance(value["city"], str)
            and len(value["city"]) <= 12 and value["unit"] in ("celsius", "fahrenheit"))


def feed_in_pieces(stream: ToolCallStream, text: str, size: int) -> list[dict]:
    deltas = []
    for start in range(0, len(text), size):
        deltas += stream.feed(text[start:start + size])
    return deltas + stream.finish()


def calls_from_deltas(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Content and calls put together from deltas, as a client does; checks each delta's shape on the way."""
    content, calls = "", []
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        if "content" in delta:
            content += delta["content"]
            continue
        (call,) = delta["tool_calls"]
        if "id" in call:  # a call's first chunk: everything but the arguments
            assert call["index"] == len(calls) and call["type"] == "function"
            assert call["function"]["arguments"] == "" and call["id"].startswith("chatcmpl-tool-")
            calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": ""})
        else:  # later chunks: the index and an arguments fragment, nothing else
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, calls


# ---- parsers on canned text --------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 3, 7, len(HERMES_TEXT)])
def test_hermes_stream_gives_openais_deltas_whatever_the_pieces(size):
    stream = ToolCallStream(FORMATS["hermes"])
    content, calls = calls_from_deltas(feed_in_pieces(stream, HERMES_TEXT, size))
    assert content == "Let me look.\n" and stream.text_content() == "Let me look.\n"
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius", "note": 'a } and " inside'}
    assert calls[1]["arguments"] == '{"zone": "CET"}'
    # The whole answer's calls are the stream's, to the character.
    assert [c.message() for c in stream.calls] == [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]
    assert all(c.complete for c in stream.calls)


def test_hermes_text_without_calls_stays_text_and_a_held_marker_prefix_is_released():
    stream = ToolCallStream(FORMATS["hermes"])
    assert stream.feed("Paris is nice <tool") == [{"content": "Paris is nice "}]  # "<tool" may start a call
    assert stream.feed("s> are fine") == [{"content": "<tools> are fine"}]
    assert stream.finish() == [] and stream.calls == []
    stream = ToolCallStream(FORMATS["hermes"])
    assert feed_in_pieces(stream, "see <tool_", 4) == [{"content": "see "}, {"content": "<tool_"}]
    assert stream.text_content() == "see <tool_"


@pytest.mark.parametrize("cut_at", ['<tool_call>\n{"name', '<tool_call>\n{"name": "get_weather",', '</tool_call', '<tool_'])
def test_markup_an_answer_cut_by_max_tokens_had_no_room_to_finish_is_not_content(cut_at):
    # The answer as max_tokens cut it: one whole call, then the start of more markup.
    whole = HERMES_TEXT.split("<tool_call>", 2)
    text = "<tool_call>".join(whole[:2]) + "\n" if cut_at != "</tool_call" else HERMES_TEXT[:HERMES_TEXT.index("</tool_call>")]
    for size in (1, 5, 1000):
        stream = ToolCallStream(FORMATS["hermes"])
        deltas = []
        for piece in (text, cut_at):
            for start in range(0, len(piece), size):
                deltas += stream.feed(piece[start:start + size])
        content, calls = calls_from_deltas(deltas + stream.finish(cut=True))
        assert content == "Let me look.\n" and stream.text_content() == "Let me look.\n", (size, content)
        assert calls[0]["name"] == "get_weather" and stream.calls[0].complete
    # An answer that ended by itself keeps such text as content, as before.
    stream = ToolCallStream(FORMATS["hermes"])
    assert calls_from_deltas(feed_in_pieces(stream, "see <tool_", 4))[0] == "see <tool_"


def test_hermes_marker_without_a_call_is_text_and_only_calls_give_null_content():
    stream = ToolCallStream(FORMATS["hermes"])
    content, calls = calls_from_deltas(feed_in_pieces(stream, "<tool_call>\nnot a call at all", 5))
    assert calls == [] and content == "<tool_call>\nnot a call at all"
    stream = ToolCallStream(FORMATS["hermes"])
    feed_in_pieces(stream, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n', 2)
    assert stream.text_content() is None and len(stream.calls) == 1


def test_hermes_call_cut_short_is_not_complete():
    stream = ToolCallStream(FORMATS["hermes"])
    _, calls = calls_from_deltas(feed_in_pieces(stream, '<tool_call>\n{"name": "get_time", "arguments": {"zo', 4))
    assert calls[0]["arguments"] == '{"zo' and not stream.calls[0].complete


@pytest.mark.parametrize("text", ['{"name": "get_time", "parameters": {"zone": "CET"}}; '
                                  '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
                                  '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}};{"name": '
                                  '"get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'])
def test_llama3_json_calls_joined_by_semicolons(text):
    for size in (1, 5, len(text)):
        stream = ToolCallStream(FORMATS["llama3_json"])
        content, calls = calls_from_deltas(feed_in_pieces(stream, text, size))
        assert content == "" and stream.text_content() is None
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_time", {"zone": "CET"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]


def test_llama3_json_text_stays_text_and_a_call_after_text_is_read():
    stream = ToolCallStream(FORMATS["llama3_json"])
    assert calls_from_deltas(feed_in_pieces(stream, "It is {sunny} in Paris.", 3)) == ("It is {sunny} in Paris.", [])
    # "auto" guides a call wherever the model opens one, so one after text is a call too.
    stream = ToolCallStream(FORMATS["llama3_json"])
    content, calls = calls_from_deltas(feed_in_pieces(stream, 'Checking. {"name": "get_time", "parameters": {}}', 3))
    assert content == "Checking. " and [(c["name"], c["arguments"]) for c in calls] == [("get_time", "{}")]
    assert stream.calls[0].complete


def test_parallel_tool_calls_false_reports_the_first_call_only():
    stream = ToolCallStream(FORMATS["hermes"], max_calls=1)
    _, calls = calls_from_deltas(feed_in_pieces(stream, HERMES_TEXT, 4))
    assert [c["name"] for c in calls] == ["get_weather"] and len(stream.reported_calls) == 1


def test_choices_stream_chunks_and_whole_message_with_tools():
    """Triton outputs through `Choices`: chunks as OpenAI streams them, finish_reason tool_calls, and the whole
    answer's message with null content."""
    plan = plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME],
                                            tool_choice="required"), SERVING)
    text = HERMES_TEXT[len("Let me look.\n"):]
    pieces = [text[i:i + 9] for i in range(0, len(text), 9)]
    choices = Choices(chat=True, n=1, num_prompts=1, top_logprobs=None, tools=plan)
    chunks = []
    for k, piece in enumerate(pieces):
        final = k == len(pieces) - 1
        out = TritonOutput(texts=[piece], token_counts=[2], finish_reasons=["stop" if final else None],
                           num_input_tokens=5, final=final)
        chunks += [choices.delta_choice(d) for d in choices.add(0, out)]
    assert all("content" not in c["delta"] for c in chunks)
    assert [c["finish_reason"] for c in chunks].count("tool_calls") == 1 and chunks[-1]["finish_reason"] == "tool_calls"
    assert chunks[-1]["delta"] == {}  # the finish reason's own chunk, as OpenAI ends a stream
    _, calls = calls_from_deltas([c["delta"] for c in chunks if c["delta"]])
    message = choices.response("id", MODEL, False)["choices"][0]["message"]
    assert message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        (c["name"], c["arguments"]) for c in calls]
    # Cut by max_tokens before any call was whole: the whole message is empty too, as the stream was.
    cut = Choices(chat=True, n=1, num_prompts=1, top_logprobs=None, tools=plan)
    deltas = cut.add(0, TritonOutput(texts=['<tool_call>\n{"name": "get_'], token_counts=[12],
                                     finish_reasons=["length"], num_input_tokens=5, final=True))
    assert all(not d.text for d in deltas)
    assert cut.response("id", MODEL, False)["choices"][0]["message"] == {"role": "assistant", "content": ""}


# ---- requests: plans, guides and refusals ------------------------------------------------------------

def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "What is the weather in Paris?"}], **fields)


def test_guides_compile_for_each_choice():
    required = plan_tools(_request(tools=[WEATHER, TIME], tool_choice="required"), SERVING)
    assert "call_0 | call_1" in required.guide["grammar"] and '("\\n" call)*' in required.guide["grammar"]
    compile_grammar(required.guide["grammar"])
    named = plan_tools(_request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                    "function": {"name": "get_time"}}), SERVING)
    assert named.named and named.max_calls == 1 and "get_weather" not in named.guide["grammar"]
    compile_grammar(named.guide["grammar"])
    auto = plan_tools(_request(tools=[WEATHER, TIME]), SERVING)  # tool_choice left out: "auto"
    tag = auto.guide["structural_tag"]
    assert tag["triggers"] == ["<tool_call>"]
    assert [s["begin"] for s in tag["structures"]] == ['<tool_call>\n{"name": "get_weather", "arguments": ',
                                                       '<tool_call>\n{"name": "get_time", "arguments": ']
    structural_tag_grammar(structural_tag_text(tag))
    single = plan_tools(_request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), SERVING)
    assert single.max_calls == 1 and "call)*" not in single.guide["grammar"]
    none = plan_tools(_request(tools=[WEATHER], tool_choice="none"), SERVING)
    assert none.guide is None and none.stream() is None and none.tools == [WEATHER]
    # The guides write calls as the parser reads them.
    hermes = FORMATS["hermes"]
    assert hermes.call_prefix("get_time") + '{"zone": "CET"}' + hermes.call_suffix() == (
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools",
     "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
                                                                             {"x": {"type": "strin"}}}}}],
      "tool_choice": "required"}, "tools", "is not a JSON schema that can be followed"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
      "tool_choice": "required"}, "tools", "must describe an object"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "[a-z]+"}, "guided_regex",
     "cannot be combined"),
    ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
     "response_format", "the response format's schema cannot be followed"),
])
def test_bad_tool_requests_are_refused_naming_the_field(fields, param, words):
    with pytest.raises(OpenAIError) as info:
        plan_tools(_request(**fields), SERVING)
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


def test_a_response_format_beside_tools_guides_the_text_answer_and_leaves_the_calls_to_their_schemas():
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    auto = plan_tools(_request(tools=[WEATHER], response_format=fmt), SERVING)
    assert auto.guide["grammar"].startswith("start: answer | call") and '"answer"' in auto.guide["grammar"]
    compile_grammar(auto.guide["grammar"])
    as_object = plan_tools(_request(tools=[WEATHER], response_format={"type": "json_object"}), SERVING)
    compile_grammar(as_object.guide["grammar"])
    required = plan_tools(_request(tools=[WEATHER], tool_choice="required", response_format=fmt), SERVING)
    assert required.guide == plan_tools(_request(tools=[WEATHER], tool_choice="required"), SERVING).guide


def test_auto_needs_the_servers_parser_as_vllm_says():
    with pytest.raises(OpenAIError) as info:
        plan_tools(_request(tools=[WEATHER]), ToolSettings())
    assert info.value.message == ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                                  "be set")
    # Required and named need no parser: the calls are then written in the hermes format.
    assert plan_tools(_request(tools=[WEATHER], tool_choice="required"), ToolSettings()).fmt.name == "hermes"


@pytest.mark.parametrize("messages, words", [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "sunny"}], "needs tool_call_id"),
    ([{"role": "wizard", "content": "hi"}], "unknown role 'wizard'"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], "in an assistant message"),
])
def test_bad_messages_are_refused(messages, words):
    with pytest.raises(OpenAIError) as info:
        ChatCompletionRequest(messages=messages).check()
    assert info.value.status == 400 and info.value.param == "messages" and words in info.value.message


def test_tool_call_arguments_reach_the_template_as_objects():
    request = ChatCompletionRequest(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}])
    request.check()
    rendered = request.template_messages()
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "CET"} and rendered[1]["content"] == ""
    assert rendered[2]["tool_call_id"] == "c1"


def test_context_limits_use_vllms_words():
    with pytest.raises(OpenAIError) as info:
        check_context(2048, 30, 100_000_000)
    assert info.value.param == "max_tokens" and info.value.message == (
        "'max_tokens' or 'max_completion_tokens' is too large: 100000000. This model's maximum context length is "
        "2048 tokens and your request has 30 input tokens (100000000 > 2048 - 30).")
    with pytest.raises(OpenAIError) as info:
        check_context(2048, 2048, None)
    assert info.value.message.startswith("This model's maximum context length is 2048 tokens. However, your request "
                                         "has 2048 input tokens.")
    check_context(2048, 30, 2018)  # exactly what is left
    check_context(2048, 5000, 16, truncate_prompt_tokens=100)  # the model keeps the last 100
    check_context(None, 10**6, 10**9)  # a model that states no max_model_len: the model decides


def test_the_shipped_template_is_found_by_name_and_bad_values_are_refused():
    assert "<tool_call>" in read_chat_template("chatml_hermes_tools")
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError):
        read_chat_template("no-such-template")
    with pytest.raises(ValueError):
        ToolSettings(enable_auto_tool_choice=True)
    with pytest.raises(InvalidRequestError):  # what an invalid tool schema fails on, underneath
        compile_grammar('start: %json {"type": "strin"}')


def test_server_options_come_from_the_command_line_and_the_environment():
    """`TRITONLLM_OPENAI_ARGS` reaches the server's options (how tritonllm-serve passes them on)."""
    def run(args: list[str], env_args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tritonllm.openai", *args], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "TRITONLLM_OPENAI_ARGS": env_args})

    refused = run(["--tool-call-parser", "mistral"], "")
    assert refused.returncode == 2 and "invalid choice: 'mistral'" in refused.stderr
    from_env = run([], "--enable-auto-tool-choice")
    assert from_env.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in from_env.stderr
    no_template = run(["--chat-template", "no-such-template"], "")
    assert no_template.returncode == 2 and "chatml_hermes_tools" in no_template.stderr


# ---- through a real server ----------------------------------------------------------------------------

@pytest.fixture
def client(openai_tools_client):
    return openai_tools_client  # conftest.py's: the OpenAI server with the tool template and parser


QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.mark.server
def test_required_call_has_schema_valid_arguments_whole_and_streamed(client):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME],
                                          tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                          temperature=0)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    if call.function.name == "get_weather":
        assert fits_weather(call.function.arguments)
    else:
        assert call.function.name == "get_time" and set(json.loads(call.function.arguments)) == {"zone"}

    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                            temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    tool_deltas = [{"tool_calls": d["tool_calls"]} for d in deltas if d.get("tool_calls")]
    _, calls = calls_from_deltas(tool_deltas)
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.server
def test_named_function_is_called_with_its_schema_streamed_and_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[TIME, WEATHER], tool_choice=named,
                                          max_tokens=64, temperature=0)
    (call,) = chat.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and fits_weather(call.function.arguments)
    assert chat.choices[0].finish_reason == "stop"  # OpenAI's and vLLM's for a named function
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[TIME, WEATHER], tool_choice=named,
                                            max_tokens=64, temperature=0, stream=True)
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in stream if c.choices]
    _, calls = calls_from_deltas([{"tool_calls": d["tool_calls"]} for d in deltas if d.get("tool_calls")])
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert len([d for d in deltas if d.get("tool_calls")]) >= 2  # the name first, the arguments after


@pytest.mark.server
def test_auto_answers_text_or_well_formed_calls(client):
    """Whatever the model chooses under "auto", the answer parses: text, or calls whose arguments fit."""
    for stream in (False, True):
        response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=48,
                                                  temperature=0, stream=stream)
        if stream:
            deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in response if c.choices]
            content, calls = calls_from_deltas([{k: v for k, v in d.items() if k != "role"} for d in deltas
                                                if d.get("content") or d.get("tool_calls")])
            arguments = [c["arguments"] for c in calls]
        else:
            message = response.choices[0].message
            content, arguments = message.content or "", [c.function.arguments for c in message.tool_calls or []]
        assert content or arguments
        assert all(fits_weather(a) for a in arguments)


@pytest.mark.server
def test_bad_tool_requests_get_openai_400s(client):
    import openai

    cases = [dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "missing"}}),
             dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                       "required": 3}}}],
                  tool_choice="required"),
             dict(messages=[*QUESTION, {"role": "tool", "content": "sunny"}], tools=[WEATHER])]
    for fields in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, **{"messages": QUESTION, "max_tokens": 4, **fields})
        assert info.value.status_code == 400 and set(info.value.body) == {"message", "type", "param", "code"}
    # The server still answers after them.
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).choices[0].message


@pytest.mark.server
def test_langchain_runs_a_two_turn_tool_loop(openai_tools_server):
    """LangChain's ChatOpenAI.bind_tools: a call, the tool's result, then the final answer."""
    from typing import Literal

    import langchain_openai  # the test extra installs it
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=12)
        unit: Literal["celsius", "fahrenheit"]

    seen = []

    @tool(args_schema=Weather)
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city now, in celsius or fahrenheit."""
        seen.append((city, unit))
        return f"Sunny, 21 degrees {unit}"

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{openai_tools_server}/v1", api_key="unused", temperature=0,
                                      max_tokens=64, max_retries=0, timeout=600)
    messages = [HumanMessage("What is the weather in Paris?")]
    first = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke(messages)
    assert len(first.tool_calls) == 1 and first.tool_calls[0]["name"] == "get_weather"
    messages.append(first)
    result = get_weather.invoke(first.tool_calls[0])  # a ToolMessage answering that call
    assert isinstance(result, ToolMessage) and result.tool_call_id == first.tool_calls[0]["id"]
    assert seen and isinstance(seen[0][0], str)
    messages.append(result)
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert final.tool_calls == [] and isinstance(final.content, str) and final.content.strip()
