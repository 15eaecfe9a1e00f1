"""Two model instances on one tritonserver: each its own engine, greedy output unchanged, metrics per instance."""

from __future__ import annotations

import re
import time

import pytest

from grpc_stream import StreamClient, make_inputs, metric, scrape

pytestmark = pytest.mark.unit

# Small limits so two engines start fast and share the two cores without a fight.
TWO_INSTANCES = dict(instance_count=2, warmup="false", exact_block_weights="false", num_kv_blocks=128, max_model_len=512,
                     num_threads=1)
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = ["Once upon a time, in a small village by the river,", "The three laws of thermodynamics are",
           "def fibonacci(n):\n    ", "Q: What color is the sky on a clear day?\nA:"]


@pytest.fixture(scope="module")
def server(variant_server):
    return variant_server("two_instances", **TWO_INSTANCES)


def _instances(samples: dict[str, float], name: str) -> dict[str, float]:
    """{model_instance label: value} of the samples of `name` (summed over their other labels)."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        found = re.search(r'model_instance="([^"]*)"', rest)
        if base == name and found:
            out[found.group(1)] = out.get(found.group(1), 0.0) + value
    return out


def _run(server, requests: dict[str, str]) -> dict:
    client = StreamClient(server.grpc_url)
    try:
        for request_id, prompt in requests.items():
            client.send(request_id, make_inputs(prompt, stream=True, sampling=GREEDY))
        return client.wait(timeout=120)
    finally:
        client.close()


@pytest.mark.parametrize("args, label", [
    ({"model_instance_name": "smollm2_0_1", "model_instance_kind": "CPU", "model_instance_device_id": "0"},
     "smollm2_0_1"),
    # Triton names the instances of one KIND_GPU group on GPUs 0 and 1 alike: the GPU tells them apart.
    ({"model_instance_name": "smollm2_0_0", "model_instance_kind": "GPU", "model_instance_device_id": "1"},
     "smollm2_0_0_gpu1"),
    ({"model_instance_name": "smollm2_0_0", "model_instance_kind": "MODEL", "model_instance_device_id": "0"},
     "smollm2_0_0"),
    ({}, "smollm2_0"),
])
def test_instance_label_is_unique_per_instance(args, label):
    from tritonllm.serving.generate_model import instance_label

    assert instance_label(args, "smollm2") == label


@pytest.mark.server
def test_two_instances_serve_concurrent_streams_with_per_instance_metrics(server):
    deadline = time.monotonic() + 10
    while True:  # each instance sets its gauges as it starts; the poll only guards a slow scrape
        before = scrape(server.metrics_url)
        alive = _instances(before, "llm_engine_alive")
        if set(alive.values()) == {1.0} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(alive) == 2 and set(alive.values()) == {1.0}, alive
    assert _instances(before, "llm_kv_cache_blocks").keys() == alive.keys()

    # Eight streams at once (each prompt twice), then each prompt alone.
    together = _run(server, {f"c{i}": PROMPTS[i % len(PROMPTS)] for i in range(8)})
    alone = {}
    for i, prompt in enumerate(PROMPTS):
        alone.update(_run(server, {f"a{i}": prompt}))

    for i in range(8):
        got, ref = together[f"c{i}"], alone[f"a{i % len(PROMPTS)}"]
        assert got.error is None and ref.error is None, (got.error, ref.error)
        assert got.num_output_tokens == len(got.ids) == GREEDY["max_tokens"]
        assert got.ids == ref.ids and got.text == ref.text, f"request c{i} differs from its prompt served alone"

    generated = sum(len(c.ids) for c in (*together.values(), *alone.values()))
    deadline = time.monotonic() + 10
    while True:  # the counters move before each final response; the poll only guards the scrape
        after = scrape(server.metrics_url)
        delta = {k: v - _instances(before, "llm_generation_tokens_total").get(k, 0.0)
                 for k, v in _instances(after, "llm_generation_tokens_total").items()}
        if sum(delta.values()) >= generated or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delta.keys() == alive.keys(), delta
    assert sum(delta.values()) == generated, delta
    # Triton hands each request to an idle instance: eight arriving at once reach both engines.
    assert all(tokens > 0 for tokens in delta.values()), delta
    assert metric(after, "llm_requests_finished_total") - metric(before, "llm_requests_finished_total") == 12
    # The vLLM backend's families have no instance label: both engines add into the one series.
    vllm = 'vllm:generation_tokens_total{model="smollm2",version="1"}'
    assert after[vllm] - before.get(vllm, 0.0) == generated
    assert len(_instances(after, "vllm:num_requests_running")) == 2  # vLLM's gauges: one per engine
