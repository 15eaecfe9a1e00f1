"""deploy/: the Grafana dashboard queries only series that a live server exports; the Prometheus example scrapes it."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import yaml

from grpc_stream import scrape

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
