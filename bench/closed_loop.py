"""Closed-loop concurrency sweep: C clients, each sending its next request as soon as one ends.

Works with any pool shaped like tritonllm_client's `ClientPool` (our Triton server, or
openai_stream.OpenAIPool). Each level runs `rounds * C` requests from the scenario's request list
(the same prompts and exact output lengths as the replay), so the work per level is bounded.
Two throughputs are reported: over the whole level (first send to last token; the tail, where
fewer than C requests are left, counts), and `steady`: tokens that arrived while all C clients
were still busy (until the first client found no request left), over that time.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from tritonllm_client.bench import _params_for, _record
from tritonllm_client.report import summarize
from tritonllm_client.stream import GenerationResult
from tritonllm_client.workload import Scenario, build_requests


def run_level(pool, scenario: Scenario, concurrency: int, rounds: int, timeout_s: float,
              progress: bool = True) -> dict:
    """One level of the sweep; returns its summary (same statistics as the replay) and throughputs."""
    specs = build_requests(scenario, concurrency * rounds, interval_s=0.0)
    results: list[Optional[GenerationResult]] = [None] * len(specs)
    errors: list[Optional[str]] = [None] * len(specs)
    lock = threading.Lock()
    state = {"next": 0, "first_idle": None}
    abort = threading.Event()
    t0 = time.perf_counter()

    def take() -> Optional[int]:
        with lock:
            i = state["next"]
            if i >= len(specs):
                if state["first_idle"] is None:  # from now on fewer than C requests are in flight
                    state["first_idle"] = time.perf_counter()
                return None
            state["next"] = i + 1
            return i

    def client_loop(worker: int) -> None:
        client = None
        try:
            client = pool.acquire()
            for _ in range(len(specs)):  # bounded: each pass takes one request or stops
                i = take()
                if i is None:
                    return
                spec = specs[i]
                try:
                    results[i] = client.generate(spec.prompt, _params_for(scenario, spec.max_tokens), timeout_s=timeout_s,
                                                 request_id=f"c{concurrency}-{i}", abort=abort)
                except Exception as e:  # one request must not end the level
                    errors[i] = f"{type(e).__name__}: {e}"
        finally:
            if client is not None:
                pool.release(client)

    threads = [threading.Thread(target=client_loop, args=(w,), name=f"sweep-{w}", daemon=True)
               for w in range(concurrency)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + rounds * (timeout_s + 30)
    for th in threads:
        th.join(timeout=max(deadline - time.monotonic(), 0.1))
    abort.set()  # anything still running past the deadline is cancelled
    for th in threads:
        th.join(timeout=30)

    records = [_record(spec, res, t0, errors[i] or "did not finish") for i, (spec, res) in enumerate(zip(specs, results))]
    summary = summarize(records)
    summary.pop("send_lag_s", None)  # no schedule in a closed loop
    first_idle = state["first_idle"] or time.perf_counter()
    steady_tokens = sum(n for r in results if r is not None for t, n in r.token_times if t <= first_idle)
    row = {
        "concurrency": concurrency,
        "num_requests": len(specs),
        "output_token_throughput": summary["output_token_throughput"],
        "steady_output_token_throughput": steady_tokens / (first_idle - t0) if first_idle > t0 else None,
        "tpot_s": summary["tpot_s"],
        "ttft_s": summary["ttft_s"],
        "e2e_s": summary["e2e_s"],
        "total_time_s": summary["total_time_s"],
        "num_failed": summary["num_failed"],
        "failures": summary["failures"],
    }
    if progress:
        tp, st = row["output_token_throughput"], row["steady_output_token_throughput"]
        tpot = (summary["tpot_s"] or {}).get("p50")
        print(f"  C={concurrency:<4} {len(specs):>4} requests  {tp or 0:7.1f} tok/s (steady {st or 0:7.1f})  "
              f"TPOT p50 {1e3 * (tpot or 0):7.1f} ms  failed {summary['num_failed']}", flush=True)
    return row


def run_sweep(pool, scenario: Scenario, levels: list[int], rounds: int, timeout_s: float,
              progress: bool = True) -> list[dict]:
    """All levels in order, on the same pool (connections are reused across levels)."""
    return [run_level(pool, scenario, c, rounds, timeout_s, progress) for c in levels]
