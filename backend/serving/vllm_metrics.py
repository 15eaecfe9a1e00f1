"""The metric families of Triton's vLLM backend, with its names, labels and buckets, beside our llm_* ones.

Dashboards and alerts written for the vLLM backend read `vllm:*` series labelled `model` and
`version`; these give them the same series. The running/waiting/KV-usage gauges are vLLM's own
(the backend does not publish them, but vLLM's dashboards read them); they carry `model_instance`
too, since each instance runs its own engine and would overwrite the others' values.

Histograms and counters are recorded when a request finishes, as our llm_* ones (vLLM records
per engine step); gauges are refreshed with the llm_* gauges.
"""

from __future__ import annotations

# The vLLM backend's buckets (its src/utils/metrics.py, from vLLM's own).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
_E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
_N_BUCKETS = [1, 2, 5, 10, 20]


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return buckets
            buckets.append(value)
        exponent += 1


class VllmMetrics:
    """`family(name, description, kind)` makes a family that its owner (EngineMetrics) keeps and releases."""

    def __init__(self, family, kinds, labels: dict, instance_labels: dict, max_model_len: int):
        def histogram(name, description, buckets):
            return family(name, description, kinds.HISTOGRAM).Metric(labels=labels, buckets=buckets)

        def counter(name, description):
            return family(name, description, kinds.COUNTER).Metric(labels=labels)

        def gauge(name, description):
            return family(name, description, kinds.GAUGE).Metric(labels=instance_labels)

        self.prompt_tokens = counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens_total", "Number of generation tokens processed.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              _TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", _E2E_BUCKETS)
        token_buckets = one_two_five_buckets(max_model_len)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.generation_len = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                        token_buckets)
        self.n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

    def record_finished(self, out, n: int) -> None:
        """One finished completion (engine RequestOutput); `n` is observed once per request."""
        t = out.times
        self.prompt_tokens.increment(out.num_prompt_tokens)
        self.generation_tokens.increment(out.num_output_tokens)
        self.prompt_len.observe(out.num_prompt_tokens)
        self.generation_len.observe(out.num_output_tokens)
        if out.index == 0:
            self.n.observe(n)
        if t.get("first_token"):
            self.ttft.observe(t["first_token"] - t["arrival"])
            self.e2e.observe(t["finished"] - t["arrival"])
            if out.num_output_tokens > 1:
                self.tpot.observe((t["finished"] - t["first_token"]) / (out.num_output_tokens - 1))

    def refresh(self, stats: dict) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        kv = stats["kv_blocks"]
        # vLLM's usage: blocks held by requests over all blocks (cached free blocks count as free).
        self.kv_usage.set(kv["used"] / kv["total"] if kv["total"] else 0.0)
