"""Open-loop replay benchmark: send a scenario's requests on schedule, stream them all concurrently.

Each request runs on its own gRPC stream from a pool of reusable connections, in a thread pool
large enough that sends never wait for earlier requests to finish (open loop, as in SEEDS 000: a
load generator sends requests at a fixed interval and the score is the time to finish them all).
If `max_concurrency` is reached, sends are delayed and the delay shows up as `send_lag_s`.
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Optional

from .report import summarize
from .stream import ClientPool, GenerationParams, GenerationResult
from .workload import RequestSpec, Scenario, build_requests


def _params_for(scenario: Scenario, max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, ignore_eos=scenario.ignore_eos,
                            temperature=scenario.temperature, chat=scenario.chat_template)


def _record(spec: RequestSpec, res: Optional[GenerationResult], t0: float, error: Optional[str] = None,
            keep_text: bool = False) -> dict:
    def rel(t):
        return None if t is None else t - t0

    rec = {
        "index": spec.index,
        "prompt_words": spec.prompt_words,
        "expected_output_tokens": spec.max_tokens,
        "send_offset_s": spec.send_offset_s,
    }
    if res is None:
        rec.update(ok=False, error=error or "not sent", request_id=None, num_output_tokens=0,
                   num_input_tokens=None, finish_reason=None, send_time_s=None, send_lag_s=None,
                   first_token_s=None, end_time_s=None, ttft_s=None, tpot_s=None, e2e_s=None,
                   itl_s=[], server_timings={})
        return rec
    send = rel(res.send_time) if res.send_time else None
    rec.update(
        ok=res.ok,
        error=res.error,
        request_id=res.request_id,
        num_output_tokens=res.num_output_tokens,
        num_input_tokens=res.num_input_tokens,
        finish_reason=res.finish_reason,
        send_time_s=send,
        send_lag_s=None if send is None else max(send - spec.send_offset_s, 0.0),
        first_token_s=rel(res.first_token_time),
        end_time_s=rel(res.end_time),
        ttft_s=res.ttft,
        tpot_s=res.tpot,
        e2e_s=res.e2e,
        itl_s=res.inter_token_latencies(),
        server_timings=res.server_timings,
    )
    if keep_text:
        rec["text"] = res.text
    return rec


def run_requests(pool: ClientPool, scenario: Scenario, specs: list[RequestSpec], timeout_s: float = 600.0,
                 max_concurrency: int = 512, progress: bool = True, desc: str = "bench",
                 keep_text: bool = False) -> list[dict]:
    """Send `specs` on their schedule and wait for all of them; one record per request, in order."""
    from tqdm import tqdm

    n = len(specs)
    records: list[Optional[dict]] = [None] * n
    abort = threading.Event()
    bar = tqdm(total=n, desc=desc, unit="req", disable=not progress, dynamic_ncols=True, leave=True)
    bar_lock = threading.Lock()
    out_tokens = [0]
    t0 = time.perf_counter() + 0.05  # a moment to start the pool before the first send

    def one(spec: RequestSpec) -> None:
        res, err = None, None
        client = None
        try:
            client = pool.acquire()
            res = client.generate(spec.prompt, _params_for(scenario, spec.max_tokens), timeout_s=timeout_s,
                                  request_id=f"{desc}-{spec.index}", abort=abort)
        except Exception as e:  # a request must never take the benchmark down
            err = f"{type(e).__name__}: {e}"
        finally:
            if client is not None:
                pool.release(client)
        records[spec.index - specs[0].index] = _record(spec, res, t0, err, keep_text)
        with bar_lock:
            if res is not None and res.ok:
                out_tokens[0] += res.num_output_tokens
            failed = sum(1 for r in records if r is not None and not r["ok"])
            bar.set_postfix(tok=out_tokens[0], failed=failed, refresh=False)
            bar.update(1)

    workers = max(1, min(n, scenario.max_concurrency or max_concurrency))
    ex = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench")
    futures = []
    try:
        for spec in specs:
            delay = t0 + spec.send_offset_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(ex.submit(one, spec))
        # Every request ends by itself within timeout_s of its send (stream deadline); allow slack.
        last_send = t0 + (specs[-1].send_offset_s if specs else 0.0)
        wait(futures, timeout=max(last_send - time.perf_counter(), 0) + timeout_s + 30)
    except BaseException:
        abort.set()
        raise
    finally:
        abort.set()
        ex.shutdown(wait=True, cancel_futures=True)
        bar.close()
    for i, spec in enumerate(specs):
        if records[i] is None:
            records[i] = _record(spec, None, t0, "did not finish before the benchmark deadline")
    return records  # type: ignore[return-value]


def run_bench(url: str, model: str, scenario: Scenario, num_requests: Optional[int] = None,
              runs: Optional[list[dict]] = None, timeout_s: float = 600.0, max_concurrency: int = 512,
              warmup: int = 1, progress: bool = True, keep_text: bool = False) -> dict:
    """Run the scenario once per entry of `runs` ({"interval_s": x} or {"rate": r}; default: as
    the file says) and return the JSON-ready result. Raises ClientError if the server is not ready."""
    pool = ClientPool(url, model)
    try:
        client = pool.acquire()  # checks server + model readiness with a clear error
        try:
            for i in range(warmup):
                client.generate("Hello! Warm-up request.", _params_for(scenario, 4), timeout_s=min(timeout_s, 120),
                                request_id=f"warmup-{i}")
        finally:
            pool.release(client)
        runs = runs or [{}]
        out_runs = []
        for k, run in enumerate(runs):
            specs = build_requests(scenario, num_requests, interval_s=run.get("interval_s"), rate=run.get("rate"))
            interval, rate = run.get("interval_s"), run.get("rate")
            if interval is None and rate is None:
                interval, rate = scenario.interval_s, scenario.rate
            label = f"rate {rate:g}/s" if rate is not None else f"interval {interval:g}s"
            desc = f"run{k}" if len(runs) > 1 else "bench"
            if progress and len(runs) > 1:
                print(f"[{k + 1}/{len(runs)}] {label}", flush=True)
            records = run_requests(pool, scenario, specs, timeout_s=timeout_s, max_concurrency=max_concurrency,
                                   progress=progress, desc=desc, keep_text=keep_text)
            out_runs.append({
                "arrival": "poisson" if rate is not None else "fixed",
                "interval_s": interval,
                "rate": rate,
                "label": label,
                "summary": summarize(records),
                "requests": records,
            })
    finally:
        pool.close()
    return {
        "tool": "tritonllm-client bench",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "url": pool.url,
        "model": model,
        "scenario": scenario.to_dict(),
        "settings": {"num_requests": num_requests or scenario.num_requests, "warmup": warmup,
                     "timeout_s": timeout_s, "max_concurrency": max_concurrency},
        "runs": out_runs,
    }
