"""The metric families of Triton's vLLM backend, with its names, labels and buckets, beside our llm_* ones.

Dashboards and alerts written for the vLLM backend read `vllm:*` series labelled `model` and
`version`; these give them the same series. The running/waiting/KV-usage gauges are vLLM's own
(the backend does not publish them, but vLLM's dashboards read them); they carry `model_instance`
too, since each instance runs its own engine and would overwrite the others' values.

Histograms and counters are recorded when a request finishes, as our llm_* ones (vLLM records
per engine step); gauges are refreshed with the llm_* gauges.

The families the backend leaves out but vLLM's dashboards read (preemptions, tokens per engine step,
the phases of a request, the prefix cache) come with vLLM's own names and buckets and the backend's
labels. The phases are measured from the timestamps the engine takes where they happen (scheduler:
first scheduled; engine: first token, finish) and observed when the request finishes, as vLLM does.
Preemptions and prefix-cache tokens are the engine's running totals, added as they grow at each
refresh; the tokens of each step are taken from the engine's queue of them (Engine.step_num_tokens).
"""

from __future__ import annotations

import time

# The vLLM backend's buckets (its src/utils/metrics.py, from vLLM's own).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
_E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
_N_BUCKETS = [1, 2, 5, 10, 20]
# vLLM's own (vllm/v1/metrics/loggers.py): the backend does not publish these families.
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_REQUEST_PHASE_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                          120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


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

    def __init__(self, family, kinds, labels: dict, instance_labels: dict, max_model_len: int,
                 step_num_tokens=None):
        """`step_num_tokens`: the engine's queue of tokens per step (a deque; None: no such histogram data)."""
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
        self.preemptions = counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter("vllm:prefix_cache_queries_total",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits_total",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", _ITERATION_TOKEN_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _REQUEST_PHASE_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", _REQUEST_PHASE_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", _REQUEST_PHASE_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", _REQUEST_PHASE_BUCKETS)
        self._step_num_tokens = step_num_tokens
        # vLLM's vllm:lora_requests_info, where adapters are served: one series per (running, waiting, max_lora)
        # label set, set to the time it was last seen; made at the first refresh with LoRA stats.
        self._lora_family = lambda: family("vllm:lora_requests_info", "Running stats on lora requests.", kinds.GAUGE)
        self._lora_labels = instance_labels
        self._lora_info = None  # (the family, its series by label values)
        # The engine's running totals already added to the counters above.
        self._seen = {"preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}

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
        # vLLM's phases: queued until first scheduled, prefill until the first token, decode until the
        # last, inference = prefill + decode. A request aborted before it ran has none of them.
        if t.get("scheduled"):
            self.queue_time.observe(t["scheduled"] - t["arrival"])
            self.inference_time.observe(t["finished"] - t["scheduled"])
            if t.get("first_token"):
                self.prefill_time.observe(t["first_token"] - t["scheduled"])
                self.decode_time.observe(t["finished"] - t["first_token"])

    def refresh(self, stats: dict) -> None:
        for key, counter in (("preemptions", self.preemptions), ("prefix_cache_queries", self.prefix_queries),
                             ("prefix_cache_hits", self.prefix_hits)):
            new = stats.get(key, 0) - self._seen[key]
            if new > 0:
                counter.increment(new)
                self._seen[key] += new
        queue = self._step_num_tokens
        # Each step's tokens once. The engine thread appends meanwhile (a deque is thread-safe); what
        # arrives after the length is read waits for the next refresh.
        for _ in range(len(queue) if queue is not None else 0):
            self.iteration_tokens.observe(queue.popleft())
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        kv = stats["kv_blocks"]
        # vLLM's usage: blocks held by requests over all blocks (cached free blocks count as free).
        self.kv_usage.set(kv["used"] / kv["total"] if kv["total"] else 0.0)
        if "lora" in stats:
            self._refresh_lora(stats["lora"])

    def _refresh_lora(self, lora: dict) -> None:
        """vLLM's gauge: labels name the running and waiting adapters (comma-separated) and max_lora; the
        value is the time, so the newest series is the current state."""
        if self._lora_info is None:
            self._lora_info = (self._lora_family(), {})
        fam, series = self._lora_info
        key = (",".join(lora["running"]), ",".join(lora["waiting"]), str(lora["max_lora"]))
        if key not in series:
            series[key] = fam.Metric(labels={**self._lora_labels, "running_lora_adapters": key[0],
                                             "waiting_lora_adapters": key[1], "max_lora": key[2]})
        series[key].set(time.time())
