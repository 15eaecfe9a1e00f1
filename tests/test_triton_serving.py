"""The model repository on a real tritonserver: streaming, batching, cancellation, bad input, HTTP."""

from __future__ import annotations

import itertools
import json
import math
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from grpc_stream import StreamClient, make_inputs, metric, scrape, wait_for_kv_blocks_in_use
from prompts import CHAT_PROMPTS, LONG_TEXT, PLAIN_PROMPTS
from tritonllm.core.sampling_params import SamplingParams

pytestmark = pytest.mark.server


@pytest.fixture
def stream(triton_server):
    client = StreamClient(triton_server.grpc_url)
    yield client
    client.close()


def _wait_idle(triton_server, timeout: float = 15.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is used."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(triton_server.metrics_url)
        busy = (metric(samples, "llm_requests", state="running") + metric(samples, "llm_requests", state="waiting")
                + metric(samples, "llm_kv_cache_blocks", state="used"))
        if busy == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_stream_sends_partials_then_final_with_the_offline_engine_ids(stream, engine):
    prompt = CHAT_PROMPTS[0]
    stream.send("a", make_inputs(prompt, stream=True, chat=True, sampling={"max_tokens": 24}))
    got = stream.wait(["a"])["a"]
    assert got.error is None and got.final
    assert got.num_responses >= 3  # one response per step that produced text
    [ref] = engine.generate([prompt], SamplingParams(max_tokens=24), apply_chat_template=True)
    assert got.ids == ref.token_ids
    assert got.text == ref.text
    assert got.finish_reason == ref.finish_reason
    assert got.num_output_tokens == len(ref.token_ids)
    # num_output_tokens counts each response's own tokens (the vLLM backend's meaning), not a running total.
    assert got.output_token_counts == got.response_id_counts and max(got.output_token_counts) < len(ref.token_ids)
    assert len(got.logprobs) == len(got.ids) and all(lp <= 0 for lp in got.logprobs)
    # cumulative_logprob: the request's so far, in every response.
    sums = [math.fsum(got.logprobs[:n]) for n in itertools.accumulate(got.response_id_counts)]
    assert got.cumulative_logprobs == pytest.approx(sums, rel=1e-5, abs=1e-5) and len(sums) == got.num_responses


def test_not_streaming_sends_exactly_one_response(stream):
    prompt = "Paris is a city in"
    stream.send("full", make_inputs(prompt, stream=False, sampling={"max_tokens": 8}))
    stream.send("excl", make_inputs(prompt, stream=False, exclude_input=True, sampling={"max_tokens": 8}))
    got = stream.wait()
    assert got["full"].num_responses == 1 and got["excl"].num_responses == 1
    assert got["full"].text == prompt + got["excl"].text  # vLLM-backend semantics
    assert got["excl"].num_output_tokens == 8 and got["excl"].finish_reason == "length"
    assert got["excl"].cumulative_logprobs == pytest.approx([math.fsum(got["excl"].logprobs)], rel=1e-5)


def test_sixteen_concurrent_streams_match_the_offline_engine(stream, engine):
    prompts = (CHAT_PROMPTS + PLAIN_PROMPTS)[:16]
    for i, p in enumerate(prompts):
        stream.send(f"r{i}", make_inputs(p, stream=True, sampling={"max_tokens": 16}))
    got = stream.wait(timeout=180)
    refs = engine.generate(prompts, SamplingParams(max_tokens=16))
    for i, ref in enumerate(refs):
        assert got[f"r{i}"].error is None
        assert got[f"r{i}"].ids == ref.token_ids, f"prompt {i}"


def test_cancelled_stream_is_aborted_and_its_blocks_come_back(triton_server):
    client = StreamClient(triton_server.grpc_url)
    client.send("long", make_inputs("Count from one to one thousand:", stream=True,
                                    sampling={"max_tokens": 1500, "ignore_eos": True}))
    deadline = time.monotonic() + 60
    while client.results["long"].num_responses < 5 and time.monotonic() < deadline:
        result, error = client.events.get(timeout=30)
        client._apply(result, error)
    assert client.results["long"].num_responses >= 5
    wait_for_kv_blocks_in_use(triton_server.metrics_url)
    client.close(cancel=True)
    samples = _wait_idle(triton_server)
    assert metric(samples, "llm_requests", state="running") == 0
    assert metric(samples, "llm_kv_cache_blocks", state="used") == 0
    assert metric(samples, "llm_requests_finished_total", reason="abort") >= 1
    # The lines the vLLM backend's cancellation test looks for in the server log
    log = triton_server.log_text()
    assert "[vllm] Cancelling the request" in log and "[vllm] Successfully cancelled the request" in log


BAD_REQUESTS = {
    "missing text_input": (dict(text=None), "no text_input"),
    "empty text_input": (dict(text=""), "empty"),
    "invalid JSON": (dict(text="hi", sampling="{max_tokens: 3"), "not valid JSON"),
    "wrong type": (dict(text="hi", sampling={"max_tokens": "many"}), "max_tokens"),
    "negative max_tokens": (dict(text="hi", sampling={"max_tokens": -1}), "max_tokens"),
    "unknown parameter": (dict(text="hi", sampling={"max_tokenz": 3}), "max_tokenz"),
    "prompt over max_model_len": (dict(text=LONG_TEXT * 4), "max_model_len"),
    "input_ids out of range": (dict(input_ids=[1, 2, 10**8]), "input_ids"),
    "input_ids with apply_chat_template": (dict(input_ids=[1, 2, 3], chat=True), "apply_chat_template"),
    "temperature out of range": (dict(text="hi", sampling={"temperature": -1}), "temperature"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_gets_invalid_arg_while_another_stream_completes(triton_server, case):
    good = StreamClient(triton_server.grpc_url)
    good.send("good", make_inputs("The three laws of thermodynamics are", sampling={"max_tokens": 24, "ignore_eos": True}))
    bad = StreamClient(triton_server.grpc_url)
    kwargs, expected = BAD_REQUESTS[case]
    bad.send("bad", make_inputs(**kwargs))
    got_bad = bad.wait(timeout=60)["bad"]
    got_good = good.wait(timeout=120)["good"]
    bad.close()
    good.close()
    assert got_bad.error is not None, case
    assert expected in got_bad.error, got_bad.error
    assert "INVALID_ARG" in got_bad.error or "invalid" in got_bad.error.lower() or expected in got_bad.error
    assert got_good.error is None and len(got_good.ids) == 24


def _post(url: str, body: dict, timeout: float = 60) -> str:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


def test_http_generate_and_generate_stream(triton_server):
    base = f"http://{triton_server.http_url}/v2/models/smollm2"
    body = {"text_input": "What is the capital of France?", "apply_chat_template": True,
            "exclude_input_in_output": True, "max_tokens": 12}
    full = json.loads(_post(f"{base}/generate", body))
    assert "Paris" in full["text_output"]
    events = [json.loads(line[len("data:"):]) for line in
              _post(f"{base}/generate_stream", {**body, "stream": True}).splitlines() if line.startswith("data:")]
    assert len(events) >= 3
    assert "".join(e.get("text_output", "") for e in events) == full["text_output"]
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(f"{base}/generate", {"text_input": "hi", "sampling_parameters": "{oops"})
    assert "not valid JSON" in info.value.read().decode()


def test_http_generate_takes_logit_bias_as_json_text(triton_server, model_dir):
    from transformers import AutoTokenizer

    paris = AutoTokenizer.from_pretrained(model_dir).encode(" Paris")
    assert len(paris) == 1
    base = f"http://{triton_server.http_url}/v2/models/smollm2"
    body = {"text_input": "What is the capital of France?", "apply_chat_template": True,
            "exclude_input_in_output": True, "max_tokens": 12}
    # Request parameters are scalars, so the object comes as its JSON text.
    banned = json.loads(_post(f"{base}/generate", {**body, "logit_bias": json.dumps({paris[0]: -100})}))
    assert " Paris" in json.loads(_post(f"{base}/generate", body))["text_output"]
    assert " Paris" not in banned["text_output"]


def test_http_generate_stop_token_ids_as_json_text_with_and_without_its_text(triton_server, model_dir):
    from transformers import AutoTokenizer

    [period] = AutoTokenizer.from_pretrained(model_dir).encode(".")
    base = f"http://{triton_server.http_url}/v2/models/smollm2"
    body = {"text_input": "What is the capital of France?", "apply_chat_template": True,
            "exclude_input_in_output": True, "max_tokens": 24, "stop_token_ids": json.dumps([period]),
            "return_logprobs": True, "logprobs": 0}
    cut = json.loads(_post(f"{base}/generate", body))
    kept = json.loads(_post(f"{base}/generate", {**body, "include_stop_str_in_output": True}))
    assert cut["output_ids"][-1] == period and kept["output_ids"] == cut["output_ids"]
    assert kept["text_output"] == cut["text_output"] + "." and not cut["text_output"].endswith(".")
    # The stop token's log-probs name it by its text either way, as vLLM's do.
    for answer in (cut, kept):
        [last] = json.loads(answer["logprobs"])[-1].values()
        assert last["decoded_token"] == "."


def test_metrics_move_as_requests_flow(triton_server, stream):
    before = scrape(triton_server.metrics_url)
    stream.send("m", make_inputs("Hello", sampling={"max_tokens": 6, "ignore_eos": True}))
    assert stream.wait(["m"])["m"].error is None
    after = _wait_idle(triton_server)
    for name in ("llm_time_to_first_token_seconds_count", "llm_e2e_request_latency_seconds_count",
                 "llm_time_per_output_token_seconds_count", "llm_queue_time_seconds_count"):
        assert metric(after, name) == metric(before, name) + 1, name
    assert metric(after, "llm_generation_tokens_total") >= metric(before, "llm_generation_tokens_total") + 6
    # at least a prompt step and five decodes, each with time in every phase it has on the CPU (counted
    # when the gauges are refreshed, twice a second: the idle gauges above may predate the request)
    deadline = time.monotonic() + 10
    while metric(after, "llm_engine_steps_total") < metric(before, "llm_engine_steps_total") + 6:
        assert time.monotonic() < deadline, "the engine's steps were not counted"
        time.sleep(0.2)
        after = scrape(triton_server.metrics_url)
    for phase in ("schedule", "inputs", "launch", "apply"):
        assert metric(after, "llm_engine_step_seconds_total", phase=phase) > metric(
            before, "llm_engine_step_seconds_total", phase=phase), phase
    assert metric(after, "llm_kv_cache_blocks", state="total") > 0
    assert metric(after, "llm_requests", state="running") == 0


_VLLM_FAMILIES = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                  "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                  "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                  "vllm:request_params_n_count", "vllm:request_params_n_sum")


def test_the_vllm_backends_metric_families_with_its_labels(triton_server, stream):
    """Its eight families labelled model and version only, as its dashboards read them; vLLM's own
    running/waiting/KV-usage gauges per instance."""
    before = scrape(triton_server.metrics_url)
    stream.send("v", make_inputs("Hello", sampling={"max_tokens": 5, "ignore_eos": True, "n": 2}))
    got = stream.wait(["v"])["v"]
    assert got.error is None
    after = _wait_idle(triton_server)
    labels = '{model="smollm2",version="1"}'
    for name in _VLLM_FAMILIES:
        assert name + labels in after, f"{name}{labels} not among {[k for k in after if k.startswith(name)]}"
    delta = {name: after[name + labels] - before.get(name + labels, 0.0) for name in _VLLM_FAMILIES}
    assert delta["vllm:generation_tokens_total"] == 10  # both completions' tokens
    assert delta["vllm:prompt_tokens_total"] == 2 * got.num_input_tokens  # per completion, as the llm_ counter
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta[f"vllm:{name}_count"] == 2, name
    assert delta["vllm:request_params_n_count"] == 1 and delta["vllm:request_params_n_sum"] == 2
    # The largest token bucket is the 1-2-5 step at or below max_model_len (2048 here), then +Inf.
    assert 'vllm:request_prompt_tokens_bucket{model="smollm2",version="1",le="2000"}' in after
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        [key] = [k for k in after if k.startswith(name + "{")]  # one instance: one series
        assert 'model="smollm2"' in key and 'version="1"' in key and 'model_instance="' in key, key
        assert after[key] == 0.0, key  # idle


def test_sigusr1_writes_the_stub_threads_stacks_into_the_server_log(triton_server):
    """`kill -USR1 <stub pid>` (serving/generate_model.py): where a model that stopped answering waits, in the log."""
    from server_watch import python_stacks, stub_pids

    (pid,) = stub_pids(triton_server)
    stacks = python_stacks(triton_server, pid)
    assert "most recent call first" in stacks and "_respond_loop" in stacks, stacks
    assert triton_server.process.poll() is None

