"""The OpenAI-compatible API, end to end: `tritonllm-serve --openai-port` starts a real tritonserver and
the API beside it; requests go through the real `openai` SDK, curl and AIPerf.

One server for the module (starting one takes a minute or more on a busy 2-core machine). Its smollm2
runs at most 2 sequences with a waiting queue of 4, so that the queue-full test can fill it; the
repository also holds minilm, an embedding model: listed by /v1/models, refused by the generate endpoints,
and `slowload`, a model not loaded at start whose load waits for a file, to be seen while it loads.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, write_variant_repo
from grpc_stream import metric, scrape

openai = pytest.importorskip("openai")  # the test extra installs it (scripts/install.sh test)

pytestmark = pytest.mark.server

MODEL = "smollm2"
QUESTION = "What is the capital of France?"
START_TIMEOUT_S = 900  # a cold tritonserver with two models on a loaded 2-core machine
LONG = {"max_tokens": 1500, "ignore_eos": True}  # a request that runs until it is cancelled


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


SLOW = "slowload"
_SLOW_MODEL_PY = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # Loading lasts until the test creates the file `release` beside config.pbtxt.
        release = os.path.join(args["model_repository"], "release")
        deadline = time.monotonic() + 300
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.1)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.zeros(1, np.float32))]) for _ in requests]
"""


def _write_slow_loading_model(folder: Path) -> None:
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(_SLOW_MODEL_PY)
    (folder / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\ninstance_group [ { count: 1, kind: KIND_CPU } ]\n'
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]\n')


@dataclass
class Served:
    process: subprocess.Popen
    log: Path
    http: str
    grpc: str
    metrics: str
    openai_port: int
    model_dir: Path
    repo: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("openai")
    # A pool for its 2 sequences (not 2 GB sized from memory: zeroed at load) and no exact blocks, a quicker load:
    # the tests compare the API's answers with Triton's own endpoints of the same server, not with another engine.
    repo = write_variant_repo(root / "repo", max_num_seqs=2, max_queue_size=4, num_kv_blocks=512,
                              exact_block_weights="false")
    shutil.copytree(REPO / "model_repository" / "minilm", repo / "minilm", ignore=shutil.ignore_patterns("__pycache__"))
    _write_slow_loading_model(repo / SLOW)
    http_port, grpc_port, metrics_port, openai_port = _free_ports(4)
    log = root / "serve.log"
    serve = Path(sys.executable).parent / "tritonllm-serve"
    cmd = [str(serve), "--model-repository", str(repo), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
           "--metrics-port", str(metrics_port), "--openai-port", str(openai_port), "--no-prepare", "--",
           "--model-control-mode=explicit", "--load-model=smollm2", "--load-model=minilm"]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    s = Served(process, log, f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}",
               f"http://127.0.0.1:{metrics_port}/metrics", openai_port, model_dir, repo)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"tritonllm-serve exited with {process.returncode}:\n{s.log_tail()}")
            status, body = _get(f"{s.base}/v1/models")
            if (status == 200 and MODEL in body.decode() and _get(f"http://{s.http}/v2/health/ready")[0] == 200
                    and _get(s.metrics)[0] == 200):
                break
            assert time.monotonic() < deadline, f"not ready after {START_TIMEOUT_S} s:\n{s.log_tail()}"
            time.sleep(0.2)
        yield s
    finally:
        process.send_signal(signal.SIGTERM)  # tritonserver (the launcher execs it)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    # The API process stops by itself once tritonserver is gone: its port must be free again.
    deadline = time.monotonic() + 30
    while _get(f"{s.base}/health", timeout=2)[0] != 0:
        assert time.monotonic() < deadline, "the OpenAI server outlived tritonserver"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def client(served):
    # No retries: a 503 must reach the test as it is.
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(served):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served.model_dir)


def _triton_generate(served: Served, body: dict) -> dict:
    """Triton's own HTTP generate endpoint (not streaming): text_output and output_ids."""
    request = urllib.request.Request(f"http://{served.http}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def _wait_idle(served: Served, timeout: float = 60.0) -> dict:
    """Until no request runs or waits and no KV block is in use (gauges refresh twice a second)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(served.metrics)
        busy = (metric(samples, "llm_requests", state="running") + metric(samples, "llm_requests", state="waiting")
                + metric(samples, "llm_kv_cache_blocks", state="used"))
        if busy == 0:
            return samples
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {busy}"
        time.sleep(0.25)


def _wait_metric(served: Served, name: str, value: float, timeout: float = 120.0, **labels) -> None:
    deadline = time.monotonic() + timeout
    while metric(scrape(served.metrics), name, **labels) != value:
        assert time.monotonic() < deadline, f"{name}{labels} never reached {value}"
        time.sleep(0.2)


# ---- models --------------------------------------------------------------------------------------

def test_models_lists_the_generate_and_embedding_models(served, client):
    assert _get(f"http://{served.http}/v2/models/minilm/ready")[0] == 200
    models = client.models.list().data
    assert [m.id for m in models] == ["minilm", MODEL]  # minilm serves /v1/embeddings (test_openai_embeddings.py)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):  # not a generate model
        client.completions.create(model="minilm", prompt="hi", max_tokens=1)


# ---- chat ----------------------------------------------------------------------------------------

def test_chat_streams_with_usage_in_the_last_chunk(client, hf_tokenizer):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (["stop"],
                                                                                                         ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    prompt_ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert 0 < chunks[-1].usage.completion_tokens <= 24
    assert len({c.id for c in chunks}) == 1
    # vLLM's continuous usage: the usage so far in every chunk, where the last chunk's is asked for too.
    for include_usage in (True, False):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": include_usage, "continuous_usage_stats": True}))
        counts = [c.usage.completion_tokens if c.usage else None for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 8 if include_usage else set(counts) == {None}, counts


def test_greedy_outputs_are_the_tokens_of_tritons_generate_endpoint(served, client, hf_tokenizer):
    triton = _triton_generate(served, {"text_input": QUESTION, "apply_chat_template": True, "max_tokens": 32,
                                       "temperature": 0, "exclude_input_in_output": True})
    # Each chosen token spells what it added to the text: the EOS that ends the answer adds nothing.
    expected_tokens = [hf_tokenizer.decode([t], skip_special_tokens=True) for t in triton["output_ids"]]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_completion_tokens=32, temperature=0, logprobs=True, top_logprobs=2)
    choice = chat.choices[0]
    assert choice.message.content == triton["text_output"]
    assert [t.token for t in choice.logprobs.content] == expected_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
               for t in choice.logprobs.content)
    assert chat.usage.completion_tokens == len(triton["output_ids"])

    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=32, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == triton["text_output"]

    prompt = "The capital of France is"
    triton = _triton_generate(served, {"text_input": prompt, "max_tokens": 12, "temperature": 0,
                                       "exclude_input_in_output": True})
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
    assert completion.choices[0].text == triton["text_output"]
    assert completion.choices[0].logprobs.tokens == [hf_tokenizer.decode([t]) for t in triton["output_ids"]]
    # Greedy: the sampled token is the most likely one, so logprobs=1 names it alone; logprobs=0 names it too.
    assert [list(top) for top in completion.choices[0].logprobs.top_logprobs] == [[t] for t in completion.choices[0].logprobs.tokens]
    none_beside = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=0)
    lp = none_beside.choices[0].logprobs
    assert [list(top.items()) for top in lp.top_logprobs] == [[(t, v)] for t, v in zip(lp.tokens, lp.token_logprobs)]
    # The prompt as token ids gives the same completion.
    by_ids = client.completions.create(model=MODEL, prompt=hf_tokenizer.encode(prompt), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == triton["text_output"]


def test_multi_turn_chat_renders_the_whole_conversation(served, client, hf_tokenizer):
    from grpc_stream import StreamClient, make_inputs

    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Capital of Italy?"},
                {"role": "assistant", "content": "Rome."},
                {"role": "developer", "content": "Stay brief."},
                {"role": "user", "content": [{"type": "text", "text": "And of Spain?"}]}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    rendered = [{**m, "role": "system" if m["role"] == "developer" else m["role"],
                 "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
                for m in messages]
    ids = hf_tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.usage.prompt_tokens == len(ids)
    stream = StreamClient(served.grpc)  # the same ids straight to the Triton model
    try:
        stream.send("ids", make_inputs(input_ids=ids, stream=False, exclude_input=True,
                                       sampling={"max_tokens": 16, "temperature": 0}))
        result = stream.wait(["ids"], timeout=600)["ids"]
    finally:
        stream.close()
    assert result.error is None and chat.choices[0].message.content == result.text


def test_the_token_a_stop_string_cuts_reads_whole_in_log_probs(client):
    """As vLLM's: the token completing a stop string is named whole in log-probs, though the text ends
    before the stop string (completions' tokens, top_logprobs and chat's token alike)."""
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    tokens = whole.choices[0].logprobs.tokens
    k = next(i for i, t in enumerate(tokens) if len(t.strip()) >= 4)
    stop = tokens[k][2:]
    assert whole.choices[0].text.find(stop) == len("".join(tokens[:k])) + 2
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0, stop=[stop])
    assert cut.choices[0].text == "".join(tokens[:k]) + tokens[k][:2] and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].logprobs.tokens == tokens[:k + 1]
    assert [list(top) for top in cut.choices[0].logprobs.top_logprobs] == [[t] for t in tokens[:k + 1]]

    messages = [{"role": "user", "content": QUESTION}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True)
    tokens = [t.token for t in answer.choices[0].logprobs.content]
    k = next(i for i, t in enumerate(tokens) if len(t.strip()) >= 4 and answer.choices[0].message.content.find(
        t[2:]) == len("".join(tokens[:i])) + 2)
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True,
                                         stop=[tokens[k][2:]])
    assert cut.choices[0].message.content == "".join(tokens[:k]) + tokens[k][:2]
    assert [t.token for t in cut.choices[0].logprobs.content] == tokens[:k + 1]


# ---- completions and the sampling fields -----------------------------------------------------------

def test_completions_fields_reach_the_model(client, hf_tokenizer):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert plain.object == "text_completion" and plain.choices[0].text.startswith(" Paris")
    first = hf_tokenizer.encode(" Paris")[0]
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                       logit_bias={str(first): -100})
    assert not banned.choices[0].text.startswith(" Paris")
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[" Paris"])
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    exact = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0,
                                      extra_body={"ignore_eos": True, "min_tokens": 7, "top_k": 5,
                                                  "repetition_penalty": 1.1})
    assert exact.usage.completion_tokens == 7 and exact.choices[0].finish_reason == "length"
    # n completions of each prompt; a seed makes them repeatable.
    kwargs = dict(model=MODEL, prompt=[prompt, "Once upon a time"], max_tokens=8, n=2, temperature=1.0, top_p=0.9,
                  seed=11, presence_penalty=0.5, frequency_penalty=0.5)
    one, two = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in one.choices] == [0, 1, 2, 3]
    assert [c.text for c in one.choices] == [c.text for c in two.choices]
    assert 0 < one.usage.completion_tokens <= 4 * 8 and one.usage.prompt_tokens == sum(
        len(hf_tokenizer.encode(p)) for p in kwargs["prompt"])
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(prompt)
    assert plain.choices[0].text.startswith(echoed.choices[0].text[len(prompt):])


def test_response_format_json_schema_guides_the_output(client):
    # Bounded, so that a small model's endless digits still end within max_tokens.
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"]}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    value = json.loads(chat.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=8, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")


# ---- errors --------------------------------------------------------------------------------------

def test_errors_have_openais_shape_and_status(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404 and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:  # the engine's own INVALID_ARG, passed on
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=500)
    assert "temperature" in info.value.body["message"] and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:  # INVALID_ARG of a stream: still a 400 before any chunk
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True, top_p=0)
    assert "top_p" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # "auto" (the default with tools) needs the parser options
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert info.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):  # a field of the wrong type
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"max_tokens": "many"})


def test_limits_and_roles_get_vllms_400s(client, hf_tokenizer):
    messages = [{"role": "user", "content": QUESTION}]
    prompt_tokens = len(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False))
    with pytest.raises(openai.BadRequestError) as info:  # vLLM's words, which clients match to shorten a request
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100_000_000)
    assert info.value.body["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 100000000. This model's maximum context length is "
        f"2048 tokens and your request has {prompt_tokens} input tokens (100000000 > 2048 - {prompt_tokens}).")
    assert info.value.body["param"] == "max_tokens"
    prompt = "The capital of France is"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2048 - len(hf_tokenizer.encode(prompt)) + 1)
    assert "is too large" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
    assert info.value.body["param"] == "messages" and "unknown role 'wizard'" in info.value.body["message"]
    # What max_model_len leaves is allowed (greedy, so the answer ends long before).
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2048 - prompt_tokens,
                                          temperature=0)
    assert chat.choices[0].finish_reason == "stop"


def _post(served: Served, path: str, body: dict | None, method: str = "POST") -> tuple[int, dict]:
    request = urllib.request.Request(f"{served.base}{path}", method=method, headers={"Content-Type": "application/json"},
                                     data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_front_refuses_what_it_would_build_too_much_for_and_takes_nulls_as_unset(served):
    hi = [{"role": "user", "content": "hi"}]
    started = time.monotonic()
    status, body = _post(served, "/v1/chat/completions", {"model": MODEL, "messages": hi, "n": 10**12})
    assert status == 400 and body["error"]["param"] == "n" and "n must be at most 64" in body["error"]["message"], body
    assert time.monotonic() - started < 5  # refused before a choice is built for each
    assert _post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0})[1]["error"]["param"] == "n"
    status, body = _post(served, "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 2000, "n": 10, "max_tokens": 1})
    assert status == 400 and "20000 completions; at most 16384" in body["error"]["message"], body
    status, body = _post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}})
    assert status == 400 and body["error"]["param"] == "stream_options", body
    # Explicit nulls (what OpenAI's clients send for unset fields) are the fields' defaults.
    status, body = _post(served, "/v1/chat/completions", {"model": MODEL, "messages": hi, "max_tokens": 2, "n": None,
                                                          "stream": None, "logprobs": None, "temperature": None})
    assert status == 200 and len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None, body
    # An assistant's refusal part in the history is its text.
    history = [*hi, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]}, *hi]
    assert _post(served, "/v1/chat/completions", {"model": MODEL, "messages": history, "max_tokens": 2})[0] == 200
    # Unknown paths and methods answer in OpenAI's error shape too.
    status, body = _post(served, "/v1/chat/completions", None, method="GET")
    assert status == 405 and body["error"]["code"] == "method_not_allowed", body
    status, body = _post(served, "/v1/audio/speech", {"model": MODEL})
    assert status == 404 and body["error"]["message"].startswith("POST /v1/audio/speech"), body


def _repository_state(served: Served, name: str) -> str:
    # Over gRPC: tritonserver's HTTP threads each serve their connections, and the one blocked in the load
    # request holds up any other request that lands on it.
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(served.grpc)
    try:
        index = client.get_model_repository_index(as_json=True, client_timeout=10)
    finally:
        client.close()
    return next((m.get("state", "") for m in index.get("models", []) if m["name"] == name), "")


def test_a_model_still_loading_gets_503_and_is_not_listed(served, client):
    """While `slowload` loads: 503 saying so (retryable), absent from /v1/models. Once loaded it is no
    generate model: 404."""
    assert _repository_state(served, SLOW) != "LOADING"

    def load():
        request = urllib.request.Request(f"http://{served.http}/v2/repository/models/{SLOW}/load", data=b"{}",
                                         method="POST")
        urllib.request.urlopen(request, timeout=600).read()

    loading = threading.Thread(target=load, daemon=True)
    loading.start()
    try:
        deadline = time.monotonic() + 120
        while _repository_state(served, SLOW) != "LOADING":
            assert time.monotonic() < deadline, "slowload never showed as LOADING"
            time.sleep(0.2)
        assert SLOW not in [m.id for m in client.models.list().data]
        for call in (lambda: client.chat.completions.create(model=SLOW, messages=[{"role": "user", "content": "hi"}]),
                     lambda: client.completions.create(model=SLOW, prompt="hi"),
                     lambda: client.models.retrieve(SLOW)):
            with pytest.raises(openai.APIStatusError) as info:
                call()
            assert info.value.status_code == 503, info.value.body
            assert info.value.body["code"] == "model_not_ready" and "is loading" in info.value.body["message"]
    finally:
        (served.repo / SLOW / "release").touch()
        loading.join(timeout=120)
    assert _repository_state(served, SLOW) == "READY"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=SLOW, prompt="hi")
    assert [m.id for m in client.models.list().data] == ["minilm", MODEL]
    unload = urllib.request.Request(f"http://{served.http}/v2/repository/models/{SLOW}/unload", data=b"{}",
                                    method="POST")
    urllib.request.urlopen(unload, timeout=120).read()


def test_queue_full_is_503_and_disconnects_cancel_their_triton_requests(served, client):
    """Two long requests run (max_num_seqs 2), a third with n=4 fills the queue (max_queue_size 4): a fourth
    gets 503. Then every client goes away, streamed or not, and the engine aborts them all and frees their
    KV blocks."""
    before = _wait_idle(served)
    aborted_before = metric(before, "llm_requests_finished_total", reason="abort")
    connections = []

    def open_request(path: str, body: dict, read_first_chunk: bool) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection("127.0.0.1", served.openai_port, timeout=600)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        connections.append(conn)
        if read_first_chunk:
            response = conn.getresponse()
            assert response.status == 200
            assert response.readline().startswith(b"data: ")
        return conn

    try:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
                **LONG}
        open_request("/v1/chat/completions", chat, read_first_chunk=True)
        open_request("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "stream": True, **LONG},
                     read_first_chunk=True)
        _wait_metric(served, "llm_requests", 2, state="running")
        # Not streamed: no byte comes back before the end, so it is sent from a thread.
        waiting = threading.Thread(target=open_request, daemon=True,
                                   args=("/v1/completions", {"model": MODEL, "prompt": "Hello", "n": 4, **LONG}, False))
        waiting.start()
        deadline = time.monotonic() + 120
        while metric(scrape(served.metrics), "llm_requests", state="waiting") == 0:
            assert time.monotonic() < deadline, "the n=4 request never showed as waiting"
            time.sleep(0.2)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt="one more", max_tokens=4)
        assert info.value.status_code == 503
        assert info.value.body["code"] == "unavailable" and "queue is full" in info.value.body["message"]
        waiting.join(timeout=60)
    finally:
        for conn in connections:  # the clients go away without reading on
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)  # whatever else still holds the socket open
            conn.close()
    after = _wait_idle(served, timeout=120)
    assert metric(after, "llm_requests_finished_total", reason="abort") - aborted_before == 2 + 4  # per completion
    assert metric(after, "llm_kv_cache_blocks", state="used") == 0


# ---- curl ----------------------------------------------------------------------------------------

def test_curl_streams_server_sent_events_and_gets_json(served):
    curl = shutil.which("curl")
    assert curl, "curl is needed (apt-get install curl)"
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    out = subprocess.run([curl, "-sN", "--max-time", "600", f"{served.base}/v1/chat/completions", "-d", body],
                         capture_output=True, text=True, timeout=660, check=True).stdout
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]" and len(events) >= 4, out
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "Paris" in "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    # Not streamed, with a JSON content type; an error comes back as OpenAI's error object.
    result = subprocess.run([curl, "-s", "--max-time", "600", f"{served.base}/v1/completions",
                             "-H", "Content-Type: application/json",
                             "-d", json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                                               "temperature": 0})],
                            capture_output=True, text=True, timeout=660, check=True).stdout
    assert json.loads(result)["choices"][0]["text"].startswith(" Paris")
    error = subprocess.run([curl, "-s", "-w", "\n%{http_code}", f"{served.base}/v1/completions", "-d", "{not json"],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    body, status = error.rsplit("\n", 1)
    assert status == "400" and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


# ---- AIPerf --------------------------------------------------------------------------------------

def test_aiperf_profiles_the_openai_endpoint(served, tmp_path):
    """A short AIPerf run (streamed chat, 2 at a time) completes every request without an error.

    AIPerf lives in its own virtual environment (scripts/install_aiperf.sh): it needs numpy 2."""
    aiperf = REPO / ".venv-aiperf" / "bin" / "aiperf"
    assert aiperf.is_file(), "AIPerf is not installed: bash scripts/install_aiperf.sh"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # set, it breaks AIPerf's local paths
    cmd = [str(aiperf), "profile", "--model", MODEL, "--url", served.base, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(served.model_dir), "--concurrency", "2", "--request-count", "4", "--isl", "16",
           "--osl", "8", "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--ui-type", "none",
           "--no-gpu-telemetry", "--no-server-metrics", "--artifact-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert result["completed_request_count"]["avg"] == 4 and result["error_summary"] == []
    assert result["request_error_rate"]["avg"] == 0
    assert result["output_sequence_length"]["avg"] == 8  # counted from usage: ignore_eos reached the model


def test_fuzzed_bodies_get_an_answer_or_an_openai_error_and_the_server_serves_on(served):
    """Valid requests with a few fields set to arbitrary JSON (any type, any size, nested): each gets 200 or a 4xx
    in OpenAI's error shape, never a 500 or a dropped connection; the server answers a plain request after."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                               | st.text(max_size=20),
                               lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=3), max_leaves=6)
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                               "content": json_values}), max_size=3)
    endpoints = {
        "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                                 ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                                  "top_k", "n", "stop", "seed", "logprobs", "top_logprobs", "logit_bias", "response_format",
                                  "tools", "tool_choice", "stream", "stream_options", "min_tokens", "stop_token_ids",
                                  "guided_json", "guided_regex", "guided_choice", "chat_template_kwargs", "prompt_logprobs"]),
        "/v1/completions": ({"model": MODEL, "prompt": "Hi", "max_tokens": 3},
                            ["model", "prompt", "max_tokens", "temperature", "n", "stop", "seed", "logprobs", "echo",
                             "suffix", "best_of", "stream", "logit_bias", "ignore_eos", "guided_choice"]),
        "/v1/responses": ({"model": MODEL, "input": "Hi", "max_output_tokens": 3},
                          ["model", "input", "instructions", "max_output_tokens", "temperature", "tools", "tool_choice",
                           "text", "stream", "store", "background", "previous_response_id", "reasoning", "include"]),
    }
    answered: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, database=None, derandomize=True, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(sorted(endpoints)), data=st.data())
    def run(path, data):
        body, fields = endpoints[path]
        body = dict(body)
        for name in data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
            body[name] = data.draw(messages | json_values if name == "messages" else json_values)
        for name, most in (("max_tokens", 8), ("max_output_tokens", 8), ("n", 2)):  # bounded work when valid
            if isinstance(body.get(name), int) and body[name] > most:
                body[name] = most
        request = urllib.request.Request(f"{served.base}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                status, text = r.status, r.read()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read()
        answered[status] = answered.get(status, 0) + 1
        assert status == 200 or (400 <= status < 500 and "message" in json.loads(text)["error"]), (status, body, text)

    run()
    assert answered.get(200) and answered.get(400), answered  # both kinds were tried
    status, _ = _post(served, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert status == 200


# ---- last: the OpenAI server killed -----------------------------------------------------------------

def test_a_killed_openai_server_is_started_again(served, client):
    """tritonllm-serve watches the OpenAI server beside tritonserver: killed (as an OOM kill would), it is
    started again, and the death is logged with its cause."""
    from supervised import children

    (pid,) = [pid for pid, argv in children(served.process.pid) if "tritonllm.openai" in argv]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while _get(f"{served.base}/v1/models", timeout=2)[0] != 200:
        assert time.monotonic() < deadline, "the OpenAI server was not started again:\n" + served.log_tail()
        time.sleep(0.1)
    assert f"the OpenAI server (pid {pid}) killed by SIGKILL" in served.log.read_text(errors="replace")
    assert [p for p, argv in children(served.process.pid) if "tritonllm.openai" in argv] != [pid]
    assert client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2).choices[0].text


WARM_UP_BEFORE_READY = """
import asyncio, socket, sys
from tritonllm.openai.server import _load_tokenizers
from tritonllm.openai.triton import TritonBackend

assert "torch" not in sys.modules and "transformers.activations" not in sys.modules
with socket.socket() as s:  # a port nothing listens on: a tritonserver not up yet
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]

async def main():
    backend = TritonBackend(f"127.0.0.1:{port}")
    await backend.start()
    try:
        await _load_tokenizers(backend, wait_s=1.0)
    finally:
        await backend.close()

asyncio.run(main())
print(sorted(m for m in ("torch", "transformers.activations") if m in sys.modules))
"""


@pytest.mark.unit
def test_the_tokenizers_libraries_are_imported_before_tritonserver_is_ready():
    # Else the first chat request after start waits for transformers' import, seconds on a small machine
    # (docs/HISTORY.md); the OpenAI server imports it while the models load.
    done = subprocess.run([sys.executable, "-c", WARM_UP_BEFORE_READY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "['torch', 'transformers.activations']", done.stdout
