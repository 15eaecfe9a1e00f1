"""deploy/: the Grafana dashboard queries only series that a live server exports; the Prometheus example scrapes it."""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from pathlib import Path

import pytest
import yaml

from grpc_stream import metric, scrape
from prompts import LONG_TEXT

PROMPT = LONG_TEXT[:400]  # several KV blocks of 16 tokens

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
_SELECTOR = re.compile(r"\b(llm_[a-z0-9_]+|vllm:[a-z0-9_:]+)(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def _dashboard_queries() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "tritonllm.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


def _selectors(queries: list[str]) -> set[tuple[str, tuple]]:
    """(metric, ((label, value), ...)) for each series a query selects; a regex matcher's alternatives
    each count as a value that must exist; matchers on dashboard variables ($model) are left out."""
    found = set()
    for query in queries:
        for name, braces in _SELECTOR.findall(query):
            choices = [[(label, v) for v in (value.split("|") if op == "=~" else [value])]
                       for label, op, value in _MATCHER.findall(braces or "") if "$" not in value and not op.startswith("!")]
            found.update((name, labels) for labels in itertools.product(*choices))
    return found


def test_the_dashboard_covers_latency_throughput_queue_kv_cache_and_errors():
    names = {name for name, _ in _selectors(_dashboard_queries())}
    assert {"llm_time_to_first_token_seconds_bucket", "llm_time_per_output_token_seconds_bucket",
            "llm_e2e_request_latency_seconds_bucket", "llm_generation_tokens_total", "llm_requests",
            "llm_kv_cache_blocks", "llm_prefix_cache_hit_tokens_total", "llm_prefix_cache_hit_rate",
            "llm_request_errors_total"} <= names
    # vLLM's families that its dashboards read and the vLLM backend leaves out
    assert {"vllm:num_preemptions_total", "vllm:iteration_tokens_total_bucket", "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total", *(f"vllm:request_{phase}_time_seconds_{part}" for phase in
                                                ("queue", "prefill", "decode", "inference") for part in ("sum", "count"))
            } <= names


@pytest.mark.server
def test_every_series_the_dashboard_queries_is_on_a_live_servers_metrics(triton_server):
    samples = scrape(triton_server.metrics_url)
    series = [(key.partition("{")[0], key.partition("{")[2]) for key in samples]
    missing = [(name, labels) for name, labels in sorted(_selectors(_dashboard_queries()))
               if not any(n == name and all(f'{k}="{v}"' in rest for k, v in labels) for n, rest in series)]
    assert not missing, f"the dashboard queries series the server does not export: {missing}"


def test_the_prometheus_example_scrapes_the_metrics_port():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert [t.rpartition(":")[2] for c in job["static_configs"] for t in c["targets"]] == ["8002"]


_VLLM_LABELS = '{model="smollm2",version="1"}'
_PHASES = ("queue", "prefill", "decode", "inference")


def _wait_for(predicate, metrics_url: str, timeout: float = 15.0) -> dict[str, float]:
    """Scrape until `predicate(samples)` holds (counters follow the engine's totals twice a second)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(metrics_url)
        if predicate(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


@pytest.mark.server
def test_vllm_preemption_step_phase_and_prefix_cache_families_follow_real_requests(triton_server):
    """The same prompt twice, one request after the other: the second finds its blocks in the prefix cache.
    Sampled (temperature 1), so that no speculative draft adds tokens to a step: every step then feeds
    the prompt tokens not found cached, or one token."""
    from grpc_stream import StreamClient, make_inputs

    url = triton_server.metrics_url
    idle = lambda s: metric(s, "llm_requests", state="running") + metric(s, "llm_requests", state="waiting") == 0
    _wait_for(idle, url)
    time.sleep(1.0)  # the steps of earlier requests observed by a refresh before `before`
    before = scrape(url)
    num_output = 8
    # A prompt no other test of the session sends (the server is shared): the first request finds no whole
    # block cached (its first tokens may still match the start of another prompt's block: a partial hit).
    prompt = f"{uuid.uuid4().hex} {PROMPT}"

    def delta(samples, name, since=before):
        return samples.get(name + _VLLM_LABELS, 0.0) - since.get(name + _VLLM_LABELS, 0.0)

    client = StreamClient(triton_server.grpc_url)
    try:
        prompt_tokens = []
        for k in range(2):
            client.send(f"p{k}", make_inputs(prompt, stream=False, sampling={
                "max_tokens": num_output, "ignore_eos": True, "temperature": 1.0, "seed": k}))
            got = client.wait([f"p{k}"])[f"p{k}"]
            assert got.error is None and got.num_output_tokens == num_output, got.error
            prompt_tokens.append(got.num_input_tokens)
            if k == 0:  # the first request's lookup, counted before the second is sent
                _wait_for(lambda s: delta(s, "vllm:prefix_cache_queries_total") >= prompt_tokens[0], url)
                time.sleep(1.0)  # its hits too: one refresh moves the two counters one after the other
                between = scrape(url)
    finally:
        client.close()

    steps = 2 * num_output  # a prefill step that samples the first token, then one step per further token
    after = _wait_for(lambda s: delta(s, "vllm:iteration_tokens_total_count") >= steps
                      and delta(s, "vllm:prefix_cache_queries_total") >= sum(prompt_tokens), url)
    for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum",
                 *(f"vllm:request_{phase}_time_seconds_{part}" for phase in _PHASES for part in ("count", "sum"))):
        assert name + _VLLM_LABELS in after, f"{name}{_VLLM_LABELS} not among {[k for k in after if name in k]}"
    # vLLM's buckets: tokens per step up to 16384, request phases up to 7680 s
    assert 'vllm:iteration_tokens_total_bucket{model="smollm2",version="1",le="16384"}' in after
    assert 'vllm:request_prefill_time_seconds_bucket{model="smollm2",version="1",le="7680"}' in after

    queries, hits = delta(after, "vllm:prefix_cache_queries_total"), delta(after, "vllm:prefix_cache_hits_total")
    assert queries == sum(prompt_tokens)  # each prompt looked up once at admission
    first_hits = delta(between, "vllm:prefix_cache_hits_total")
    repeat_hits = delta(after, "vllm:prefix_cache_hits_total", since=between)
    assert first_hits < 16  # no whole block of a prompt no one sent before
    assert 16 <= repeat_hits < prompt_tokens[1]  # the repeat found whole blocks, never its last token's
    assert delta(after, "vllm:num_preemptions_total") == 0  # a KV pool with room for both
    assert delta(after, "vllm:iteration_tokens_total_count") == steps
    assert delta(after, "vllm:iteration_tokens_total_sum") == queries - hits + 2 * (num_output - 1)

    sums = {phase: delta(after, f"vllm:request_{phase}_time_seconds_sum") for phase in _PHASES}
    for phase in _PHASES:
        assert delta(after, f"vllm:request_{phase}_time_seconds_count") == 2, phase
    assert sums["prefill"] > 0 and sums["decode"] > 0 and sums["queue"] >= 0
    assert sums["prefill"] + sums["decode"] == pytest.approx(sums["inference"], abs=1e-3)
    # queued + running = arrival to the last token, the e2e latency
    assert sums["queue"] + sums["inference"] == pytest.approx(delta(after, "vllm:e2e_request_latency_seconds_sum"),
                                                              abs=1e-3)


@pytest.mark.server
def test_vllm_preemption_counter_moves_when_the_kv_pool_is_too_small(variant_server):
    """4 blocks of 16 tokens for three requests (prompts of 4 tokens) that each grow to 2 blocks: the newest
    is preempted."""
    from grpc_stream import StreamClient, make_inputs

    server = variant_server("four_kv_blocks", num_kv_blocks=4, max_model_len=64, warmup="false",
                            speculative_tokens=0)
    before = scrape(server.metrics_url)
    client = StreamClient(server.grpc_url)
    try:
        for k in range(3):
            client.send(f"q{k}", make_inputs(f"Story {k}:", sampling={
                "max_tokens": 28, "ignore_eos": True, "temperature": 1.0, "seed": k}))
        results = client.wait([f"q{k}" for k in range(3)], timeout=300)
    finally:
        client.close()
    assert all(r.error is None and r.num_output_tokens == 28 for r in results.values()), results
    prompts = sum(r.num_input_tokens for r in results.values())

    def delta(samples, name, labels=_VLLM_LABELS):
        return samples.get(name + labels, 0.0) - before.get(name + labels, 0.0)

    # The counters are published a few times a second: the preempted request, resumed alone at the end,
    # can finish before its second lookup is (so wait for that too, bounded).
    after = _wait_for(lambda s: delta(s, "vllm:num_preemptions_total") > 0
                      and delta(s, "vllm:num_preemptions_total") == metric(s, "llm_preemptions_total")
                      - metric(before, "llm_preemptions_total")
                      and delta(s, "vllm:prefix_cache_queries_total") > prompts, server.metrics_url)
    preempted = delta(after, "vllm:num_preemptions_total")
    ours = metric(after, "llm_preemptions_total") - metric(before, "llm_preemptions_total")
    assert preempted > 0 and preempted == ours
    # A preempted request is looked up again when it is admitted again, its outputs so far included.
    assert delta(after, "vllm:prefix_cache_queries_total") > prompts
