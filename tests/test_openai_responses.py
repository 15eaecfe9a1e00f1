"""OpenAI's Responses API (`/v1/responses`): requests as chat requests, the chat path's deltas as output
items and stream events (checked against the `openai` SDK's own types), and end to end with the SDK
and LangChain's Responses mode against the OpenAI server in front of a real tritonserver."""

from __future__ import annotations

import asyncio
import json
import typing

import pytest

from tritonllm.openai.protocol import OpenAIError
from tritonllm.openai.choices import Delta
from tritonllm.openai.responses_api import ResponseOutput, ResponsesRequest, ResponseStore
from tritonllm.openai.tool_parsers import FORMATS, ToolCallStream

openai = pytest.importorskip("openai")  # the test extra installs it
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

pytestmark = pytest.mark.unit

MODEL = "smollm2"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
# The SDK's event classes by their `type`.
EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
          for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


def _events_are_the_sdks(events: list[dict]) -> list:
    parsed = [EVENTS[e["type"]].model_validate(e) for e in events]
    assert [e["sequence_number"] for e in events] == list(range(events[0]["sequence_number"],
                                                                events[0]["sequence_number"] + len(events)))
    return parsed


# ---- the request as a chat request ---------------------------------------------------------------

def test_instructions_and_items_become_the_chat_messages_an_agent_loop_sends():
    body = ResponsesRequest.model_validate({
        "model": MODEL, "instructions": "Be brief.", "max_output_tokens": 40, "top_k": 5, "frobnicate": 1,
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "text"}}, "reasoning": None,
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris"}', "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Rain"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "developer", "content": [{"type": "input_text", "text": "Answer in French."}]}]})
    body.check()
    assert body.ignored_fields() == ["frobnicate"]  # top_k is vLLM's, passed on
    chat = body.chat_request(body.input_messages())
    chat.check()
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                        for c in calls]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Rain"},
        {"role": "system", "content": "Answer in French."}]
    assert chat.tools == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                     "parameters")}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    sampling = chat.sampling_parameters()
    assert sampling["max_tokens"] == 40 and sampling["top_k"] == 5 and sampling["temperature"] == 1.0
    assert "guided_decoding" not in sampling


def test_text_formats_and_logprobs_map_to_the_chat_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = ResponsesRequest.model_validate({"input": "hi", "include": ["message.output_text.logprobs"],
                                            "text": {"format": {"type": "json_schema", "name": "A", "schema": schema,
                                                                "strict": True}}})
    chat = body.chat_request(body.input_messages())
    assert chat.sampling_parameters()["guided_decoding"] == {"json": schema}
    assert chat.logprobs and chat.top_logprobs == 0
    # As OpenAI's and vLLM's: top_logprobs alone asks for nothing; `include` does.
    alone = ResponsesRequest.model_validate({"input": "hi", "top_logprobs": 3})
    assert not alone.chat_request(alone.input_messages()).logprobs
    as_object = ResponsesRequest.model_validate({"input": "hi", "text": {"format": {"type": "json_object"}}})
    assert as_object.chat_request(as_object.input_messages()).sampling_parameters()["guided_decoding"] == {"json_object": True}


@pytest.mark.parametrize("fields, param, words", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "'input_image' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "only text"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "call_id"),
    ({"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": {}}]}, "input", "JSON text"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice must be"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text", "not supported"),
    ({"input": "hi", "background": True, "store": False}, "background", "must be stored"),
    ({"input": ""}, "input", "empty"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "not supported"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "flat"),
    ({"input": "hi", "tools": [{"type": "function", "name": 5}]}, "tools", "tools[0].name"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "function_call_output"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input", "input[0].output"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input", "text as a string"),
    ({"input": "hi", "seed": "x"}, "seed", "seed: "),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(fields, param, words):
    body = ResponsesRequest.model_validate(fields)
    with pytest.raises(OpenAIError) as info:
        body.check()
        body.chat_request(body.input_messages())
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


# ---- deltas -> output items and events -------------------------------------------------------------

def _hermes_deltas(text_pieces: list[str]) -> tuple[list[Delta], ToolCallStream]:
    calls = ToolCallStream(FORMATS["hermes"])
    deltas = []
    for piece in text_pieces:
        for part in calls.feed(piece):
            deltas.append(Delta(0, part.get("content", ""), None, None, part.get("tool_calls")))
    for part in calls.finish():
        deltas.append(Delta(0, part.get("content", ""), None, None, part.get("tool_calls")))
    return deltas, calls


def test_text_then_a_call_are_a_message_and_a_function_call_in_the_sdks_shapes():
    body = ResponsesRequest.model_validate({"input": "hi", "tools": [WEATHER], "max_tool_calls": 3})
    assert body.ignored_fields() == []  # max_tool_calls bounds built-in tools' calls: none here, so echoed
    output = ResponseOutput(body, MODEL)
    deltas, calls = _hermes_deltas(["Checking. ", "<tool_call>\n{\"name\": \"get_weather\", ",
                                    "\"arguments\": {\"city\": ", "\"Paris\"}}\n</tool_call>"])
    events = output.start()
    for delta in deltas:
        events += output.add(delta)
    events += output.finish("stop", calls, {"prompt_tokens": 7, "completion_tokens": 20, "total_tokens": 27})
    _events_are_the_sdks(events)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.done" in kinds
    response = Response.model_validate(output.response)
    assert response.status == "completed" and response.output_text == "Checking. "
    assert response.max_tool_calls == 3
    message, call = response.output
    assert message.type == "message" and message.status == "completed"
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.status == "completed" and call.call_id == calls.calls[0].id
    deltas_text = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas_text == call.arguments
    assert response.usage.input_tokens == 7 and response.usage.output_tokens == 20
    # The completed event carries the whole response; the created one the empty response of then.
    assert events[0]["response"]["output"] == [] and events[-1]["response"] == output.response
    # The next turn sees the call as the assistant's.
    assert output.as_messages() == [{"role": "assistant", "content": "Checking. ", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]}]


def test_a_cut_answer_is_incomplete_and_an_empty_one_is_an_empty_message():
    body = ResponsesRequest.model_validate({"input": "hi", "max_output_tokens": 3, "tools": [WEATHER]})
    cut = ResponseOutput(body, MODEL)
    deltas, calls = _hermes_deltas(["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci"])
    events = cut.start() + [e for d in deltas for e in cut.add(d)]
    events += cut.finish("length", calls, {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4})
    _events_are_the_sdks(events)
    response = Response.model_validate(cut.response)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in response.output] == ["incomplete"] and events[-1]["type"] == "response.incomplete"
    assert cut.as_messages() == []  # an unfinished call is not carried into the next turn

    empty = ResponseOutput(ResponsesRequest.model_validate({"input": "hi"}), MODEL)
    events = empty.start() + empty.finish("stop", None, {"prompt_tokens": 1, "completion_tokens": 1,
                                                         "total_tokens": 2})
    _events_are_the_sdks(events)
    assert Response.model_validate(empty.response).output[0].content[0].text == ""


def test_the_store_continues_conversations_forgets_the_oldest_and_404s_the_unknown():
    store = ResponseStore(capacity=2)
    outputs = []
    for k in range(3):
        body = ResponsesRequest.model_validate({"input": f"question {k}", "instructions": "not carried"})
        output = ResponseOutput(body, MODEL)
        output.add(Delta(0, f"answer {k}", None, None))
        output.finish("stop", None, {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
        store.put(output, body.input_messages())
        outputs.append(output)
    assert store.history(outputs[2].id) == [{"role": "user", "content": "question 2"},
                                            {"role": "assistant", "content": "answer 2"}]
    assert store.get(outputs[1].id)["output"][0]["content"][0]["text"] == "answer 1"
    with pytest.raises(OpenAIError) as info:
        store.history(outputs[0].id)
    assert info.value.status == 400 and info.value.param == "previous_response_id"  # OpenAI's status
    assert store.delete(outputs[1].id)["deleted"] is True
    with pytest.raises(OpenAIError):
        store.get(outputs[1].id)
    # The input items of a kept response, a page at a time.
    body = ResponsesRequest.model_validate({"input": [{"role": "user", "content": f"q{k}"} for k in range(5)]})
    output = ResponseOutput(body, MODEL)
    output.finish("stop", None, {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1})
    store.put(output, body.input_messages(), body.input_items())
    first = store.input_items(output.id, limit=2)
    assert [i["content"][0]["text"] for i in first["data"]] == ["q4", "q3"] and first["has_more"]
    rest = store.input_items(output.id, after=first["last_id"], limit=10)
    assert [i["content"][0]["text"] for i in rest["data"]] == ["q2", "q1", "q0"] and not rest["has_more"]
    assert store.input_items(output.id, order="asc", limit=1)["data"][0]["content"][0]["type"] == "input_text"
    # A byte budget too: a response larger than it stays alone (the one just made is always kept).
    small = ResponseStore(capacity=10, max_bytes=1)
    for output in outputs:
        small.put(output, [])
    assert small.get(outputs[2].id)["id"] == outputs[2].id
    for gone in outputs[:2]:
        with pytest.raises(OpenAIError):
            small.get(gone.id)


# ---- end to end ------------------------------------------------------------------------------------

@pytest.fixture
def client(openai_tools_client):
    return openai_tools_client  # conftest.py's: the OpenAI server with the tool template and parser



@pytest.mark.server
def test_the_sdk_gets_the_chat_answer_whole_streamed_and_continued(client):
    question = "What is the capital of France? Answer in one word."
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          max_tokens=12, temperature=0)
    whole = client.responses.create(model=MODEL, input=question, max_output_tokens=12, temperature=0)
    assert whole.status in ("completed", "incomplete") and whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens

    scored = client.responses.create(model=MODEL, input=question, max_output_tokens=12, temperature=0, top_logprobs=2,
                                     include=["message.output_text.logprobs"])
    chat_scored = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                 max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    assert [(t.token, t.logprob, len(t.top_logprobs)) for t in scored.output[0].content[0].logprobs] == [
        (t.token, t.logprob, len(t.top_logprobs)) for t in chat_scored.choices[0].logprobs.content]

    with client.responses.stream(model=MODEL, input=question, max_output_tokens=12, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text

    # previous_response_id continues the conversation; the response is kept and can be deleted.
    follow = client.responses.create(model=MODEL, input="And of Italy?", previous_response_id=whole.id,
                                     max_output_tokens=12, temperature=0)
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": whole.output_text},
               {"role": "user", "content": "And of Italy?"}]
    same = client.chat.completions.create(model=MODEL, messages=history, max_tokens=12, temperature=0)
    assert follow.output_text == same.choices[0].message.content
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)
    with pytest.raises(openai.BadRequestError):  # OpenAI's status for it
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_unknown", max_output_tokens=2)
    # The input items, as OpenAI lists them (newest first by default).
    items = client.responses.input_items.list(whole.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", question)]
    # Arguments nested deeper than Python's JSON reader goes are passed on as text, not a 500.
    deep = "[" * 1100 + "]" * 1100
    nested = client.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": deep},
        {"type": "function_call_output", "call_id": "c", "output": "x"}])
    assert nested.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input=[{"type": "input_image", "image_url": "x"}])
    assert bad.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as wrong_type:  # pydantic's union members are not fields
        client.responses.create(model=MODEL, input=5)
    assert wrong_type.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as out_of_range:  # the model's refusal, naming the field
        client.responses.create(model=MODEL, input="hi", temperature=-1)
    assert out_of_range.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=100_000)
    assert too_long.value.body["param"] == "max_output_tokens"


@pytest.mark.server
def test_a_named_function_is_called_with_schema_valid_arguments_whole_and_streamed(client):
    question = "What is the weather in Paris?"
    named = {"type": "function", "name": "get_weather"}
    whole = client.responses.create(model=MODEL, input=question, tools=[WEATHER], tool_choice=named,
                                    max_output_tokens=48, temperature=0)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    with client.responses.stream(model=MODEL, input=question, tools=[WEATHER], tool_choice=named,
                                 max_output_tokens=48, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == calls[0].arguments == final.output[-1].arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # A text format beside tools (an Agents SDK output_type with tools): calls, or text in that format.
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"],
              "additionalProperties": False}
    for choice in ("auto", "required"):
        both = client.responses.create(model=MODEL, input=question, tools=[WEATHER], tool_choice=choice,
                                       text={"format": {"type": "json_schema", "name": "a", "schema": schema}},
                                       parallel_tool_calls=False, max_output_tokens=48, temperature=0)
        assert both.status == "completed", both
        texts = [item for item in both.output if item.type == "message"]
        made = [item for item in both.output if item.type == "function_call"]
        assert (made and not texts) or (set(json.loads(both.output_text)) == {"answer"} and choice == "auto")


@pytest.mark.server
def test_langchain_in_responses_mode_runs_a_two_turn_tool_loop(openai_tools_server):
    """LangChain's ChatOpenAI with use_responses_api: a call, the tool's result, then the final answer."""
    import langchain_openai  # the test extra installs it
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool

    seen = []

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        seen.append(city)
        return "Sunny, 21 degrees celsius"

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{openai_tools_server}/v1", api_key="unused", temperature=0,
                                      max_tokens=64, max_retries=0, timeout=600, use_responses_api=True)
    messages = [HumanMessage("What is the weather in Paris?")]
    first = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert len(first.tool_calls) == 1 and first.tool_calls[0]["name"] == "get_weather"
    assert first.response_metadata["id"].startswith("resp_")  # a Responses API answer
    messages += [first, get_weather.invoke(first.tool_calls[0])]
    assert seen and isinstance(seen[0], str)
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert final.tool_calls == [] and final.text.strip()


@pytest.mark.server
def test_the_openai_agents_sdk_runs_a_tool_loop_streams_and_fills_a_structured_output(openai_tools_server):
    """The OpenAI Agents SDK on its default model, the Responses API: the forced call, the tool's result,
    then the answer (the SDK lets the model choose after a call: "auto"); a call streamed; and an
    `output_type`, which the SDK asks for as a JSON schema and parses, streamed."""
    import agents  # the test extra installs it
    from pydantic import BaseModel

    agents.set_tracing_disabled(True)  # its traces would go to OpenAI
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{openai_tools_server}/v1", api_key="unused", timeout=600, max_retries=0))
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        cities.append(city)
        return "Sunny, 21 degrees celsius"

    class Forecast(BaseModel):
        city: str
        sunny: bool

    settings = agents.ModelSettings(tool_choice="get_weather", max_tokens=64, temperature=0)
    agent = agents.Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                         model=model, tools=[get_weather], model_settings=settings)
    # The tool's result is the answer: one model turn, streamed.
    caller = agent.clone(tool_use_behavior="stop_on_first_tool")
    forecaster = agents.Agent(name="forecast", instructions="Fill the forecast.", model=model, output_type=Forecast,
                              model_settings=agents.ModelSettings(max_tokens=64, temperature=0))

    async def streamed(which, question):
        run = agents.Runner.run_streamed(which, question, max_turns=2)
        kinds = [event.data.type async for event in run.stream_events() if event.type == "raw_response_event"]
        return run, kinds

    async def run():
        whole = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        return whole, await streamed(caller, "What is the weather in Lyon?"), await streamed(forecaster, "Paris is sunny.")

    whole, (called, call_kinds), (forecast, forecast_kinds) = asyncio.run(run())
    assert [type(item).__name__ for item in whole.new_items] == ["ToolCallItem", "ToolCallOutputItem",
                                                                 "MessageOutputItem"]
    assert isinstance(whole.final_output, str) and whole.final_output.strip()
    assert called.final_output == "Sunny, 21 degrees celsius" and len(cities) == 2 and all(cities)
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.completed"} <= set(call_kinds)
    assert isinstance(forecast.final_output, Forecast) and forecast.final_output.city
    assert {"response.output_text.delta", "response.output_text.done", "response.completed"} <= set(forecast_kinds)


# ---- background responses ----------------------------------------------------------------------------

def _background(store: ResponseStore, runs, text: str, streamed: bool, pieces: list[str], fail: bool = False):
    """A background response whose generation writes `pieces` one scheduler turn apart (then fails)."""
    from tritonllm.openai.protocol import bad_request
    body = ResponsesRequest.model_validate({"input": text, "background": True, "stream": streamed})
    body.check()
    output = ResponseOutput(body, MODEL)

    async def generate(record):
        for piece in pieces:
            await asyncio.sleep(0)
            record(output.add(Delta(0, piece, None, None)))
        if fail:
            raise bad_request("the model refused", "input")
        record(output.finish("stop", None, {"prompt_tokens": 1, "completion_tokens": len(pieces),
                                            "total_tokens": 1 + len(pieces)}))

    first = runs.start(output, streamed, generate, lambda events: store.put(output, body.input_messages(), None, events))
    return output, first


def test_a_background_response_runs_on_is_followed_from_any_event_and_is_kept_whole():
    from tritonllm.openai.background_responses import BackgroundResponses

    async def scenario():
        store = ResponseStore()
        runs = BackgroundResponses(store)
        output, first = _background(store, runs, "question", True, ["The", " answer", " is", " 42."])
        assert first[0]["response"]["status"] == "queued" and first[0]["response"]["background"] is True
        assert store.get(output.id)["status"] == "in_progress"  # kept from its start
        with pytest.raises(OpenAIError) as running:  # not continued before it ends
            store.history(output.id)
        assert running.value.status == 400 and running.value.param == "previous_response_id"
        while not store.get(output.id)["output"]:
            await asyncio.sleep(0)
        partial = store.get(output.id)  # shown as it stands: the text so far
        assert partial["status"] == "in_progress"
        assert "The answer is 42.".startswith(partial["output"][0]["content"][0]["text"])
        all_events = [e async for e in await runs.follow(output.id, None)]  # follows it to its end
        later = [e async for e in await runs.follow(output.id, 3)]
        parsed = _events_are_the_sdks(all_events)
        assert parsed[-1].type == "response.completed"
        assert parsed[-1].response.output_text == "The answer is 42."
        assert later == all_events[4:]
        assert store.get(output.id)["status"] == "completed"
        assert store.history(output.id)[-1] == {"role": "assistant", "content": "The answer is 42."}
        with pytest.raises(OpenAIError) as ended:
            await runs.cancel(output.id)
        assert ended.value.status == 400 and "already completed" in ended.value.message

        # Created whole: no events kept; a failure is kept as failed.
        whole, _ = _background(store, runs, "q", False, ["a"], fail=True)
        with pytest.raises(OpenAIError) as no_events:
            await runs.follow(whole.id, None)
        assert no_events.value.param == "stream"
        while store.get(whole.id)["status"] == "in_progress":
            await asyncio.sleep(0)
        assert store.get(whole.id)["status"] == "failed"
        assert store.get(whole.id)["error"]["code"] == "invalid_prompt"

        # Cancelled while queued (its task not yet started) and while running; cancelling again gives it back.
        queued, _ = _background(store, runs, "q", True, ["x"] * 50)
        assert (await runs.cancel(queued.id))["status"] == "cancelled"
        running_output, _ = _background(store, runs, "q", True, ["x"] * 50)
        follower = [e async for e in _take(await runs.follow(running_output.id, None), 5)]
        cancelled = await runs.cancel(running_output.id)
        assert cancelled["status"] == "cancelled" and cancelled["output"][0]["status"] == "incomplete"
        assert (await runs.cancel(running_output.id))["status"] == "cancelled"
        rest = [e async for e in await runs.follow(running_output.id, follower[-1]["sequence_number"])]
        assert rest[-1]["type"] == "response.output_item.done"  # the stream just ends after the cancel
        # A response that was not in the background cannot be cancelled.
        body = ResponsesRequest.model_validate({"input": "q"})
        foreground = ResponseOutput(body, MODEL)
        foreground.finish("stop", None, {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1})
        store.put(foreground, [])
        with pytest.raises(OpenAIError) as synchronous:
            await runs.cancel(foreground.id)
        assert synchronous.value.message == "Cannot cancel a synchronous response."
        # Shutting down cancels what still runs.
        last, _ = _background(store, runs, "q", False, ["x"] * 50)
        await runs.close()
        assert store.get(last.id)["status"] == "cancelled"

    asyncio.run(scenario())


async def _take(events, count: int):
    async for event in events:
        yield event
        count -= 1
        if count == 0:
            return


@pytest.mark.server
def test_the_sdk_runs_a_response_in_the_background_resumes_its_stream_and_cancels_one(client, _session_triton_server):
    import time

    from grpc_stream import metric, scrape

    def aborted() -> float:
        return metric(scrape(_session_triton_server.metrics_url), "llm_requests_finished_total", reason="abort")

    question = "What is the capital of France? Answer in one word."
    whole = client.responses.create(model=MODEL, input=question, max_output_tokens=16, temperature=0)
    queued = client.responses.create(model=MODEL, input=question, max_output_tokens=16, temperature=0,
                                     background=True)
    assert queued.status == "queued" and queued.background
    deadline = time.monotonic() + 60
    kept = client.responses.retrieve(queued.id)
    while kept.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        kept = client.responses.retrieve(queued.id)
    assert kept.status == whole.status and kept.output_text == whole.output_text
    assert kept.usage.output_tokens == whole.usage.output_tokens
    # While it runs, created whole too, it shows what it has written so far.
    story = client.responses.create(model=MODEL, input="Tell a long story about a dragon.", max_output_tokens=400,
                                    temperature=0, background=True, extra_body={"ignore_eos": True})
    polled = client.responses.retrieve(story.id)
    while not polled.output_text and polled.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        polled = client.responses.retrieve(story.id)
    assert polled.status == "in_progress" and polled.output_text, polled
    stopped = client.responses.cancel(story.id)
    assert stopped.status == "cancelled" and stopped.output_text.startswith(polled.output_text)

    # Streamed: the client reads a few events and goes; the stream is taken up again after the last seen.
    stream = client.responses.create(model=MODEL, input=question, max_output_tokens=16, temperature=0,
                                     background=True, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 3:
            break
    stream.close()
    assert seen[0].type == "response.created" and seen[0].response.status == "queued"
    rest = list(client.responses.retrieve(seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number))
    assert [e.sequence_number for e in seen + rest] == list(range(len(seen) + len(rest)))
    assert rest[-1].type == f"response.{whole.status}" and rest[-1].response.output_text == whole.output_text
    replayed = list(client.responses.retrieve(seen[0].response.id, stream=True))
    assert [e.sequence_number for e in replayed] == [e.sequence_number for e in seen + rest]

    # A long answer is cancelled while it runs; what it wrote stays.
    long = client.responses.create(model=MODEL, input="Count from 1 to 1000, one number a line.",
                                   max_output_tokens=1500, temperature=0, background=True,
                                   extra_body={"ignore_eos": True})
    aborted_before = aborted()
    time.sleep(0.5)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    while aborted() == aborted_before:  # the engine aborts its Triton request
        assert time.monotonic() < deadline + 60, "the cancelled response's request was never aborted"
        time.sleep(0.1)
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as synchronous:
        client.responses.cancel(whole.id)
    assert "synchronous" in synchronous.value.body["message"]
    with pytest.raises(openai.BadRequestError) as not_streamed:
        list(client.responses.retrieve(queued.id, stream=True))
    assert not_streamed.value.body["param"] == "stream"
    with pytest.raises(openai.BadRequestError) as unstored:
        client.responses.create(model=MODEL, input=question, background=True, store=False)
    assert unstored.value.body["param"] == "background"
