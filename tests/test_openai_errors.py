"""The OpenAI server's errors: bodies that are no JSON, the field each error names (in the words of the
endpoint the client called), and failures of the server's own answered in OpenAI's shape."""

from __future__ import annotations

import pytest

from tritonllm.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, parse_body
from tritonllm.openai.responses_api import ResponsesRequest
from tritonllm.openai.triton import error_in_stream

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("body, words", [
    (b'{"model": "m", "prompt": "hi", "temperature": NaN}', "not valid JSON"),
    (b'{"model": "m", "prompt": "hi", "metadata": {"a": Infinity}}', "not valid JSON"),
    (b'{"model": "m", "prompt": "hi"', "not valid JSON"),
    (b'{"model": "m", "prompt": "hi", "metadata": {"a": [1, 1e400]}}', "too large for a float"),
])
def test_what_json_has_not_is_a_400(body, words):
    with pytest.raises(OpenAIError) as info:
        parse_body(CompletionRequest, body)
    assert info.value.status == 400 and words in info.value.message


def test_a_wrong_type_names_the_field_not_the_union_member_pydantic_tried():
    with pytest.raises(OpenAIError) as info:
        parse_body(ResponsesRequest, b'{"input": 5}')
    assert info.value.param == "input" and "input.str" not in info.value.message
    with pytest.raises(OpenAIError) as info:
        parse_body(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "hi"}], "n": "many"}')
    assert info.value.param == "n"


def test_the_models_refusals_name_the_field_each_endpoint_takes():
    def param(body, message: str) -> str | None:
        return body.named(error_in_stream("[invalid_argument] " + message)).param

    hi = [{"role": "user", "content": "hi"}]
    top = "logprobs (top_logprobs: how many top log-probs) must be an integer in [0, 20], got 25"
    assert param(CompletionRequest(prompt="hi", logprobs=25), top) == "logprobs"
    assert param(ChatCompletionRequest(messages=hi, logprobs=True, top_logprobs=25), top) == "top_logprobs"
    assert param(ResponsesRequest(input="hi", top_logprobs=25), top) == "top_logprobs"
    length = "max_tokens must be at least 1, got 0"
    assert param(ChatCompletionRequest(messages=hi, max_tokens=0), length) == "max_tokens"
    assert param(ChatCompletionRequest(messages=hi, max_completion_tokens=0), length) == "max_completion_tokens"
    assert param(ResponsesRequest(input="hi"), length) == "max_output_tokens"
    assert param(CompletionRequest(prompt="hi"), "temperature must be a number in [0.0, 100.0], got -1") == "temperature"
    # A message that names no field names none; nor does one that is not the client's fault.
    assert param(CompletionRequest(prompt="hi"), "the prompt is too long") is None
    assert error_in_stream("[internal] max_tokens broke").param is None


def test_a_responses_error_speaks_of_the_responses_fields():
    body = ResponsesRequest(input="hi", max_output_tokens=10**6)
    error = body.named(OpenAIError(400, "tools[0].function.parameters (f) is not a JSON schema", "invalid_request",
                                   "tools"))
    assert error.message == "tools[0].parameters (f) is not a JSON schema"
    error = body.named(OpenAIError(400, "'max_tokens' or 'max_completion_tokens' is too large: 1000000.",
                                   "invalid_request", "max_tokens"))
    assert error.param == "max_output_tokens" and error.message.startswith("'max_output_tokens' is too large")


def test_a_failure_of_the_servers_own_is_a_500_in_openais_shape_and_the_app_goes_on():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tritonllm.openai.server import _AnswerUnexpected

    app = FastAPI()
    app.add_middleware(_AnswerUnexpected)

    @app.get("/broken")
    async def broken():
        raise RecursionError("maximum recursion depth exceeded")

    @app.get("/fine")
    async def fine():
        return {"ok": True}

    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.get("/broken")
        assert answer.status_code == 500
        assert answer.json()["error"] == {"message": "RecursionError: maximum recursion depth exceeded",
                                          "type": "internal_server_error", "param": None, "code": "internal_error"}
        assert client.get("/fine").json() == {"ok": True}
