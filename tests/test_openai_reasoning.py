"""A reasoning model's thinking apart from its answer (`--reasoning-parser`): the reader over pieces of
any size, chat's `reasoning` (whole and streamed), the Responses API's reasoning item, and end to end
through the OpenAI server in front of a real tritonserver: guides that hold after the thinking (the
default model does not think by itself; shown answers that do, it thinks too)."""

from __future__ import annotations

import json
import typing

import pytest

from tritonllm.openai.reasoning import ReasoningStream, answer_starts_thinking, prompt_opens_thinking
from tritonllm.openai.choices import Choices, Delta
from tritonllm.openai.responses_api import ResponseOutput, ResponsesRequest
from tritonllm.openai.triton import TritonOutput

openai = pytest.importorskip("openai")  # the test extra installs it
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

pytestmark = pytest.mark.unit

MODEL = "smollm2"
EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
          for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


def _read(text: str, thinking: bool, size: int) -> tuple[str, str]:
    stream = ReasoningStream(thinking=thinking)
    reasoning, answer = [], []
    for start in range(0, len(text), size):
        r, a = stream.feed(text[start:start + size])
        reasoning.append(r)
        answer.append(a)
    r, a = stream.finish()
    return "".join(reasoning + [r]), "".join(answer + [a])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text, thinking, expected", [
    ("<think>hmm, ok</think>\n\nThe answer.", False, ("hmm, ok", "\n\nThe answer.")),  # Qwen3: opened in the output
    ("hmm</think>Answer", True, ("hmm", "Answer")),  # DeepSeek-R1, Qwen3.5: opened in the prompt
    ("\n<think>\nhmm</think>Answer", True, ("\nhmm", "Answer")),  # ... and written again
    ("Plain answer <think> not here", False, ("", "Plain answer <think> not here")),
    ("still thinking </thi", True, ("still thinking </thi", "")),  # cut while thinking
    ("<thi", False, ("", "<thi")),
])
def test_thinking_and_answer_are_told_apart_in_pieces_of_any_size(text, thinking, expected, size):
    assert _read(text, thinking, size) == expected


# A ChatML template that opens the thinking block in its generation prompt (as DeepSeek-R1's and Qwen3.5's
# do), and closes it at once where asked not to think (Qwen3's enable_thinking=False).
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
                     "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}{% endif %}")


def test_what_the_template_writes_after_the_conversation_says_whether_the_answer_starts_thinking(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    asked = [{"role": "user", "content": "What is 2 + 2?"}]
    kwargs = {"add_generation_prompt": True, "continue_final_message": False}
    assert answer_starts_thinking(tokenizer, asked, {**kwargs, "chat_template": THINKING_TEMPLATE})
    assert not answer_starts_thinking(tokenizer, asked, {**kwargs, "chat_template": THINKING_TEMPLATE,
                                                         "enable_thinking": False})
    assert not answer_starts_thinking(tokenizer, asked, kwargs)  # smollm2's own template opens none
    # A `<think>` the user wrote is no block the model is in.
    assert not answer_starts_thinking(tokenizer, [{"role": "user", "content": "Explain <think>"}], kwargs)
    # An assistant message being continued is the answer's start.
    prefill = [*asked, {"role": "assistant", "content": "<think>" + " and then" * 20}]
    assert answer_starts_thinking(tokenizer, prefill, {"add_generation_prompt": False, "continue_final_message": True})
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def _outputs(pieces: list[str]) -> list[TritonOutput]:
    return [TritonOutput(texts=[p], token_counts=[1], finish_reasons=["stop" if k == len(pieces) - 1 else None],
                         num_input_tokens=3, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]


def test_chat_gives_reasoning_beside_content_whole_and_streamed():
    pieces = ["Let me ", "see.</th", "ink>\n\nIt is ", "Paris."]
    choices = Choices(chat=True, n=1, num_prompts=1, top_logprobs=None, thinking=True)
    chunks = [choices.delta_choice(d)["delta"] for out in _outputs(pieces) for d in choices.add(0, out)]
    assert "".join(c.get("reasoning", "") for c in chunks) == "Let me see."
    assert "".join(c.get("content", "") for c in chunks) == "\n\nIt is Paris."
    assert all(c.get("reasoning") == c.get("reasoning_content") for c in chunks)
    message = choices.response("id", MODEL, False)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "\n\nIt is Paris.", "reasoning": "Let me see.",
                       "reasoning_content": "Let me see."}
    plain = Choices(chat=True, n=1, num_prompts=1, top_logprobs=None, thinking=False)
    for out in _outputs(["Just ", "Paris."]):
        plain.add(0, out)
    assert plain.response("id", MODEL, False)["choices"][0]["message"]["reasoning"] is None


VOCAB = ["<", "think", ">", "Let", " me", " see.", "</", "{\"", "city", "\"}", "</think>", "<|eos|>"]


def _usage(pieces: list[tuple[list[str], str]], thinking: bool) -> dict:
    """Usage after responses that each carry these tokens (of VOCAB) and this text (which may lag them)."""
    choices = Choices(chat=True, n=1, num_prompts=1, top_logprobs=None, thinking=thinking,
                      decode=lambda ids: "".join(VOCAB[i] for i in ids))
    for k, (tokens, text) in enumerate(pieces):
        last = k == len(pieces) - 1
        choices.add(0, TritonOutput(texts=[text], token_counts=[len(tokens)], ids=[[VOCAB.index(t) for t in tokens]],
                                    num_input_tokens=3, final=last, finish_reasons=["stop"] if last else None))
    return choices.usage()


@pytest.mark.parametrize("pieces, thinking, expected", [
    # The prompt opened the block; one token a response, the end-of-sequence token last (no text).
    ([(["Let"], "Let"), ([" me"], " me"), (["</"], "</"), (["think"], "think"), ([">"], ">"), (["{\""], "{\""),
      (["<|eos|>"], "")], True, 5),
    # The same whole, in one response.
    ([(["Let", " me", "</", "think", ">", "{\"", "<|eos|>"], 'Let me</think>{"')], True, 5),
    # The text lags the tokens (held back while a stop string may be forming).
    ([(["Let", " me"], "Let me"), (["</", "think"], ""), ([">", "{\""], ""), (["city"], '</think>{"city')], True, 5),
    # The output opens the block, spelled in pieces; `</think>` is one token, the answer's first in its response.
    ([(["<"], "<"), (["think"], "think"), ([">"], ">"), (["Let"], "Let"), (["</think>", "{\""], '</think>{"'),
      (["<|eos|>"], "")], False, 5),
    # Cut while thinking: every token.
    ([(["Let", " me"], "Let me"), (["</"], "</")], True, 3),
    # No block: none.
    ([(["{\""], '{"'), (["city", "<|eos|>"], "city")], False, 0),
    ([(["<"], "<"), (["city"], "city")], False, 0),
])
def test_usage_counts_the_tokens_spent_thinking_on_the_token_ids(pieces, thinking, expected):
    """OpenAI's `completion_tokens_details.reasoning_tokens`: the tokens up to and including the one whose
    text completes `</think>`, all of them while the block is open, whatever the responses' sizes and
    however far their text lags their tokens."""
    usage = _usage(pieces, thinking)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": expected}
    assert usage["completion_tokens"] == sum(len(tokens) for tokens, _ in pieces)


def test_usage_has_no_thinking_count_without_the_token_ids():
    without_ids = Choices(chat=True, n=1, num_prompts=1, top_logprobs=None, thinking=True, decode=str)
    without_ids.add(0, TritonOutput(texts=["hm</think>x"], token_counts=[3], num_input_tokens=3, final=True,
                                    finish_reasons=["stop"]))
    assert "completion_tokens_details" not in without_ids.usage()  # a model that sends no ids: not counted
    assert "completion_tokens_details" not in Choices(chat=True, n=1, num_prompts=1, top_logprobs=None).usage()


def test_the_responses_api_gives_a_reasoning_item_before_the_message():
    choices = Choices(chat=True, n=1, num_prompts=1, top_logprobs=None, thinking=False)
    output = ResponseOutput(ResponsesRequest(input="hi"), MODEL)
    events = output.start()
    for out in _outputs(["<think>Hmm", ", France.</think>", "Paris."]):
        for delta in choices.add(0, out):
            events += output.add(delta)
    events += output.finish("stop", None, choices.usage())
    for event in events:
        EVENTS[event["type"]].model_validate(event)
    response = Response.model_validate(output.response)
    thought, message = response.output
    assert thought.type == "reasoning" and thought.content[0].text == "Hmm, France." and thought.summary == []
    assert response.output_text == "Paris."
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Hmm, France."
    kinds = [e["type"] for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    assert kinds.index("response.content_part.done") > kinds.index("response.reasoning_text.done")
    assert output.as_messages() == [{"role": "assistant", "content": "Paris."}]  # thinking is not carried on


def test_thinking_then_a_call_is_a_reasoning_item_and_a_call_with_no_message_between():
    from tritonllm.openai.protocol import ChatCompletionRequest
    from tritonllm.openai.tools import ToolSettings, plan_tools

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    plan = plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[weather]),
                      ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    choices = Choices(chat=True, n=1, num_prompts=1, top_logprobs=None, tools=plan, thinking=False)
    output = ResponseOutput(ResponsesRequest(input="hi"), MODEL)
    pieces = ["<think>Paris, so", " the tool.</think>\n", '<tool_call>\n{"name": "get_weather", ',
              '"arguments": {"city": "Paris"}}\n</tool_call>']
    for out in _outputs(pieces):
        for delta in choices.add(0, out):
            output.add(delta)
    output.finish("stop", choices.tool_calls(0), choices.usage())
    assert [item["type"] for item in output.response["output"]] == ["reasoning", "function_call"]


def test_a_pieces_log_probs_go_to_the_text_its_last_tokens_spell():
    def token(text: str) -> dict:
        return {"token": text, "logprob": -0.1, "bytes": list(text.encode()), "top_logprobs": []}

    output = ResponseOutput(ResponsesRequest(input="hi", include=["message.output_text.logprobs"]), MODEL)
    tokens = [token("<think>"), token("hm"), token("</think>"), token("Par"), token("is")]
    output.add(Delta(0, "Paris", tokens, "stop", reasoning="hm"))
    output.finish("stop", None, {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6})
    message = output.response["output"][1]
    assert [t["token"] for t in message["content"][0]["logprobs"]] == ["Par", "is"]


# ---- end to end ------------------------------------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
# Two answers that think first: the default model, shown them, thinks before its next answer too.
FEW_SHOT = [{"role": "user", "content": "What is the capital of Italy?"},
            {"role": "assistant", "content": "<think>Italy's capital is Rome.</think>{\"city\": \"Rome\"}"},
            {"role": "user", "content": "What is the capital of Spain?"},
            {"role": "assistant", "content": "<think>Spain's capital is Madrid.</think>{\"city\": \"Madrid\"}"},
            {"role": "user", "content": "What is the capital of France?"}]
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
# The prompt opens the block (an assistant answer being continued), as DeepSeek-R1's template does.
OPENED = {"continue_final_message": True, "add_generation_prompt": False}
THINKING = FEW_SHOT + [{"role": "assistant", "content": "<think>"}]


@pytest.mark.server
def test_a_guided_answer_comes_after_free_thinking(openai_tools_client):
    """A guide holds after the thinking (vLLM's structured outputs under a reasoning parser): the model
    thinks in its own words, then writes JSON the schema accepts; whole and streamed."""
    client = openai_tools_client
    # Log-probs too: where the guide allows fewer tokens than asked, the rest are ruled out (-inf), which
    # the answer writes as vLLM does (-9999.0): JSON has no infinity.
    whole = client.chat.completions.create(model=MODEL, messages=THINKING, max_tokens=48, temperature=0,
                                           response_format=CITY_FORMAT, logprobs=True, top_logprobs=3,
                                           extra_body=OPENED)
    assert any(alt.logprob == -9999.0 for t in whole.choices[0].logprobs.content for alt in t.top_logprobs)
    message = whole.choices[0].message.model_dump()
    assert message["reasoning_content"] == message["reasoning"]
    assert message["reasoning"] == "France's capital is Paris."  # free text, which the schema would refuse
    assert message["content"] == '{"city": "Paris"}' and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens_details.reasoning_tokens == _thinking_tokens(whole)
    streamed = client.chat.completions.create(model=MODEL, messages=THINKING, max_tokens=48, temperature=0,
                                              response_format=CITY_FORMAT, stream=True, extra_body=OPENED)
    deltas = [c.choices[0].delta.model_dump() for c in streamed if c.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def _thinking_tokens(completion) -> int:
    """The tokens up to and including the one whose text completes `</think>` (by the answer's log-probs)."""
    spelled = [t.token for t in completion.choices[0].logprobs.content]
    return next(k + 1 for k in range(len(spelled)) if "</think>" in "".join(spelled[:k + 1]))


@pytest.mark.server
@pytest.mark.parametrize("messages, extra", [
    (THINKING, {**OPENED}),  # ends with the end-of-sequence token
    (THINKING, {**OPENED, "stop": ['Paris"']}),  # the text is held back while the stop string may be forming
    (FEW_SHOT, {}),  # the model opens the block itself, spelling `<think>` in pieces
], ids=["prompt-opened", "stop-string", "output-opened"])
def test_usage_counts_the_thinking_tokens_whole_and_streamed(openai_tools_client, messages, extra):
    client = openai_tools_client
    stop = extra.pop("stop", None)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0, stop=stop,
                                           logprobs=True, extra_body=extra)
    thinking = _thinking_tokens(whole)
    assert 0 < thinking < whole.usage.completion_tokens
    assert whole.usage.completion_tokens_details.reasoning_tokens == thinking
    for logprobs in (True, False):  # one token a response, and whatever the server's pieces are
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=48, temperature=0, stop=stop, logprobs=logprobs, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body=extra))
        counts = [c.usage.completion_tokens_details.reasoning_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == thinking, counts
    if not extra:  # /v1/responses: no prompt opening the block there
        response = client.responses.create(model=MODEL, input=messages, max_output_tokens=48, temperature=0)
        assert response.usage.output_tokens_details.reasoning_tokens == thinking
        streamed = client.responses.create(model=MODEL, input=messages, max_output_tokens=48, temperature=0,
                                           stream=True)
        completed = [e for e in streamed if e.type == "response.completed"]
        assert completed[0].response.usage.output_tokens_details.reasoning_tokens == thinking


@pytest.mark.server
@pytest.mark.parametrize("messages", [FEW_SHOT, [FEW_SHOT[-1]]], ids=["shown-thinking", "plain"])
def test_a_model_without_a_think_token_is_guided_from_its_first_token(openai_tools_client, messages):
    """The default model has no `<think>` token, so where the prompt opens no block the guide holds from
    the first token: the mask cannot push it into spelling `<think>` and ending there with no answer."""
    client = openai_tools_client
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                           response_format=CITY_FORMAT)
    message = whole.choices[0].message.model_dump()
    assert message["reasoning"] is None and json.loads(message["content"]).keys() == {"city"}
    response = client.responses.create(
        model=MODEL, input=messages, max_output_tokens=48, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
    assert [item.type for item in response.output] == ["message"] and response.output_text == message["content"]


@pytest.mark.server
def test_a_required_tool_call_comes_after_free_thinking(openai_tools_client):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    shown = [{"role": "user", "content": "What is the weather in Rome?"},
             {"role": "assistant", "content": "<think>The user wants Rome's weather.</think>"
                                              "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"},
             {"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "<think>"}]
    answer = openai_tools_client.chat.completions.create(model=MODEL, messages=shown, tools=[weather],
                                                         tool_choice="required", max_tokens=64, temperature=0,
                                                         extra_body=OPENED)
    message = answer.choices[0].message
    assert message.model_dump()["reasoning"] and "Paris" in message.model_dump()["reasoning"]
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
