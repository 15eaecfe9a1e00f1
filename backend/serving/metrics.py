"""LLM metrics on Triton's own /metrics endpoint (pb_utils.MetricFamily), labelled by model, version and model_instance.

Every model instance (instance_group count > 1) runs its own engine in its own stub process, so
each writes its own series under its `model_instance` label; without it the instances would
overwrite each other's gauges. (Not `instance`: Prometheus sets that label to the scrape target.)

Per-request histograms and counters are recorded when a request finishes; gauges (queue
lengths, KV blocks) are refreshed from the engine thread's latest snapshot a few times a second.
Each metric call crosses to the Triton process, so nothing here runs per token.
"""

from __future__ import annotations

from tritonllm.serving.vllm_metrics import VllmMetrics

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
_TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# engine.StepTimings' fields -> the `phase` label of llm_engine_step_seconds_total
STEP_PHASES = {"schedule": "schedule", "prepare": "inputs", "launch": "launch", "wait": "wait", "apply": "apply"}


class EngineMetrics:
    """Names are stable and documented in docs/METRICS.md."""

    def __init__(self, pb_utils, model_name: str, model_version: str, instance_name: str, max_model_len: int = 8192,
                 step_num_tokens=None):
        """`step_num_tokens`: the engine's queue of tokens per step (Engine.step_num_tokens), for vLLM's
        iteration_tokens histogram."""
        labels = {"model": model_name, "version": str(model_version), "model_instance": instance_name}
        F = pb_utils.MetricFamily

        # Families must outlive their metrics (the stub refuses metric calls otherwise).
        self._families = []

        def family(name, description, kind):
            fam = F(name=name, description=description, kind=kind)
            self._families.append(fam)
            return fam

        def histogram(name, description, buckets):
            return family(name, description, F.HISTOGRAM).Metric(labels=labels, buckets=buckets)

        self.ttft = histogram("llm_time_to_first_token_seconds", "Time from arrival to the first output token", _LATENCY_BUCKETS)
        self.tpot = histogram("llm_time_per_output_token_seconds", "Mean time between output tokens of a request", _TPOT_BUCKETS)
        self.e2e = histogram("llm_e2e_request_latency_seconds", "Time from arrival to the last output token", _LATENCY_BUCKETS)
        self.queue = histogram("llm_queue_time_seconds", "Time from arrival to first being scheduled", _LATENCY_BUCKETS)
        self.prompt_len = histogram("llm_request_prompt_tokens", "Prompt length of finished requests", _TOKEN_BUCKETS)
        self.output_len = histogram("llm_request_output_tokens", "Output length of finished requests", _TOKEN_BUCKETS)

        self.prompt_tokens = family("llm_prompt_tokens_total", "Prompt tokens of finished requests", F.COUNTER).Metric(labels=labels)
        self.output_tokens = family("llm_generation_tokens_total", "Generated tokens", F.COUNTER).Metric(labels=labels)
        self.cached_tokens = family("llm_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache",
                                    F.COUNTER).Metric(labels=labels)
        finished = family("llm_requests_finished_total", "Finished requests by finish reason", F.COUNTER)
        self.finished = {r: finished.Metric(labels={**labels, "reason": r}) for r in ("stop", "length", "abort")}
        errors = family("llm_request_errors_total", "Requests answered with an error, by kind", F.COUNTER)
        self.errors = {k: errors.Metric(labels={**labels, "kind": k}) for k in ("invalid_argument", "unavailable", "internal")}
        self.preemptions = family("llm_preemptions_total", "Sequences preempted for lack of KV blocks", F.COUNTER).Metric(labels=labels)

        requests = family("llm_requests", "Requests in the engine by state", F.GAUGE)
        self.requests = {s: requests.Metric(labels={**labels, "state": s}) for s in ("running", "waiting")}
        blocks = family("llm_kv_cache_blocks", "KV cache blocks by state", F.GAUGE)
        self.blocks = {s: blocks.Metric(labels={**labels, "state": s}) for s in ("used", "cached", "free", "total")}
        self.hit_rate = family("llm_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens",
                               F.GAUGE).Metric(labels=labels)
        self.alive = family("llm_engine_alive", "1 while the engine thread serves; 0 after it died or stopped",
                            F.GAUGE).Metric(labels=labels)
        self._preemptions_seen = 0
        # Where the engine thread's steps go (engine.StepTimings): with the steps' count, what a step costs
        # on the host in each phase; the rest of a served step's wall time is the engine thread waiting
        # for the GIL or a core, or idle.
        self.steps = family("llm_engine_steps_total", "Engine steps run", F.COUNTER).Metric(labels=labels)
        step_seconds = family("llm_engine_step_seconds_total", "Engine thread's time in its steps, by phase", F.COUNTER)
        self.step_seconds = {p: step_seconds.Metric(labels={**labels, "phase": p}) for p in STEP_PHASES.values()}
        self._timings_seen = {"steps": 0, **{k: 0.0 for k in STEP_PHASES}}
        # The vLLM backend's families beside ours (vllm_metrics.py): dashboards built for it work unchanged.
        self.vllm = VllmMetrics(family, F, {"model": model_name, "version": str(model_version)}, labels, max_model_len,
                                step_num_tokens)

    def record_finished(self, out, n: int = 1) -> None:
        """One finished completion (engine RequestOutput with `times`) of a request of `n` completions."""
        self.vllm.record_finished(out, n)
        t = out.times
        self.finished.get(out.finish_reason, self.finished["abort"]).increment(1)
        self.prompt_tokens.increment(out.num_prompt_tokens)
        self.output_tokens.increment(out.num_output_tokens)
        self.cached_tokens.increment(out.num_cached_prompt_tokens)
        self.prompt_len.observe(out.num_prompt_tokens)
        self.output_len.observe(out.num_output_tokens)
        if t.get("scheduled"):
            self.queue.observe(t["scheduled"] - t["arrival"])
        if t.get("first_token"):
            self.ttft.observe(t["first_token"] - t["arrival"])
            self.e2e.observe(t["finished"] - t["arrival"])
            if out.num_output_tokens > 1:
                self.tpot.observe((t["finished"] - t["first_token"]) / (out.num_output_tokens - 1))

    def record_error(self, kind: str) -> None:
        self.errors[kind].increment(1)

    def refresh(self, stats: dict, alive: bool) -> None:
        """Gauges from the engine's latest stats snapshot."""
        self.alive.set(1 if alive else 0)
        self.requests["running"].set(stats["running"])
        self.requests["waiting"].set(stats["waiting"])
        kv = stats["kv_blocks"]
        for state in ("used", "cached", "free", "total"):
            self.blocks[state].set(kv[state])
        self.hit_rate.set(kv["prefix_hit_rate"])
        self.vllm.refresh(stats)
        new = stats["preemptions"] - self._preemptions_seen
        if new > 0:
            self.preemptions.increment(new)
            self._preemptions_seen = stats["preemptions"]
        self._count_step_timings(stats.get("step_timings"))

    def _count_step_timings(self, timings: dict | None) -> None:
        if not timings:
            return
        seen = self._timings_seen
        if timings["steps"] < seen["steps"]:  # the engine's timings were started again
            seen.update({k: 0 for k in seen})
        # Each increment is its own call to tritonserver, so a scrape can fall between two of them: the
        # phases' seconds go first, so that a scrape that counts a step also holds that step's time.
        for key, phase in STEP_PHASES.items():
            if timings[key] > seen[key]:
                self.step_seconds[phase].increment(timings[key] - seen[key])
        if timings["steps"] > seen["steps"]:
            self.steps.increment(timings["steps"] - seen["steps"])
        seen.update({k: timings[k] for k in seen})

    def close(self) -> None:
        """Release every metric, then the families, while the stub can still reach tritonserver (from
        `finalize`); the object is unusable afterwards.

        Left to Python's exit, they would be freed after the stub's link to the server is gone, and the
        stub of tritonserver 2.51 crashes there (a segfault in Metric::Clear, fixed upstream in
        python_backend #429): a crash at every server stop, in the kernel log and the server log.
        """
        families = self._families
        self.__dict__.clear()  # the metrics first: a family must outlive its metrics
        families.clear()
