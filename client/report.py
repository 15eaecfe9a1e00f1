"""Benchmark statistics, the printed table and the PNG plot."""

from __future__ import annotations

import math
from typing import Iterable, Optional

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an already sorted, non-empty list."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def describe(values: Iterable[Optional[float]]) -> Optional[dict]:
    """count, mean, min, max and p50/p90/p99 of the non-None values; None when there are none."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    out = {"count": len(vals), "mean": sum(vals) / len(vals), "min": vals[0], "max": vals[-1]}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(vals, q)
    return out


def summarize(records: list[dict], max_failure_messages: int = 5) -> dict:
    """Summary of one run from its per-request records (see bench.run_requests)."""
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    sends = [r["send_time_s"] for r in records if r.get("send_time_s") is not None]
    ends = [r["end_time_s"] for r in ok]
    total_time = (max(ends) - min(sends)) if ends and sends else None
    out_tokens = sum(r["num_output_tokens"] for r in ok)
    mismatched = [r["index"] for r in ok if r["num_output_tokens"] != r["expected_output_tokens"]]
    messages: list[str] = []
    for r in failed:
        if r["error"] not in messages:
            messages.append(r["error"])
        if len(messages) >= max_failure_messages:
            break
    server = {}
    keys = sorted({k for r in ok for k in (r.get("server_timings") or {})})
    for k in keys:
        d = describe(r["server_timings"].get(k) for r in ok if isinstance(r["server_timings"].get(k), (int, float)))
        if d:
            server[k] = d
    return {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_failed": len(failed),
        "failures": {"count": len(failed), "first_messages": messages},
        "total_time_s": total_time,
        "request_throughput": (len(ok) / total_time) if total_time else None,
        "output_token_throughput": (out_tokens / total_time) if total_time else None,
        "total_output_tokens": out_tokens,
        "expected_output_tokens": sum(r["expected_output_tokens"] for r in records),
        "num_output_length_mismatch": len(mismatched),
        "output_length_mismatch_indices": mismatched[:20],
        "ttft_s": describe(r["ttft_s"] for r in ok),
        "tpot_s": describe(r["tpot_s"] for r in ok),
        "e2e_s": describe(r["e2e_s"] for r in ok),
        "itl_s": describe(x for r in ok for x in r.get("itl_s", [])),
        "send_lag_s": describe(r.get("send_lag_s") for r in records),
        "server_timings": server,
    }


def _ms(d: Optional[dict], key: str) -> str:
    return "-" if not d else f"{d[key] * 1000:9.1f}"


def format_summary(s: dict, title: str = "") -> str:
    """A plain-text table for the terminal."""
    lines = []
    if title:
        lines.append(title)

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines.append(f"  requests          : {s['num_completed']}/{s['num_requests']} completed, {s['num_failed']} failed")
    lines.append(f"  total time        : {num(s['total_time_s'], '.2f')} s")
    lines.append(f"  request throughput: {num(s['request_throughput'], '.3f')} req/s")
    lines.append(f"  output throughput : {num(s['output_token_throughput'], '.1f')} tok/s"
                 f" ({s['total_output_tokens']} of {s['expected_output_tokens']} expected tokens)")
    if s["num_output_length_mismatch"]:
        lines.append(f"  length mismatches : {s['num_output_length_mismatch']} requests "
                     f"(indices {s['output_length_mismatch_indices']})")
    lines.append(f"  {'ms':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        d = s.get(key)
        lines.append(f"  {label:<8}" + "".join(f"{_ms(d, k):>10}" for k in ("mean", "p50", "p90", "p99", "max")))
    lag = s.get("send_lag_s")
    if lag and lag["max"] > 0.05:
        lines.append(f"  note: sends lagged the schedule by up to {lag['max'] * 1000:.0f} ms")
    for msg in s["failures"]["first_messages"]:
        lines.append(f"  failure: {msg}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> str:
    """Throughput-latency curve for several runs, latency CDFs for one. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    title = f"{result.get('model', '')} - {result.get('scenario', {}).get('name', '')}"
    if len(runs) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        pts = [(r["summary"]["output_token_throughput"], r["summary"]) for r in runs
               if r["summary"]["output_token_throughput"]]
        for ax, key, label in ((axes[0], "e2e_s", "end-to-end latency (s)"), (axes[1], "ttft_s", "TTFT (s)")):
            for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
                xs = [x for x, s in pts if s[key]]
                ys = [s[key][q] for x, s in pts if s[key]]
                ax.plot(xs, ys, style, label=q)
            for r in runs:
                s = r["summary"]
                if s["output_token_throughput"] and s[key]:
                    ax.annotate(f"{r.get('rate', '')} req/s", (s["output_token_throughput"], s[key]["p50"]),
                                fontsize=7, textcoords="offset points", xytext=(3, 3))
            ax.set_xlabel("output throughput (tokens/s)")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"throughput vs latency: {title}")
    else:
        reqs = [r for r in runs[0]["requests"] if r["ok"]]
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        for ax, key, label in ((axes[0], "ttft_s", "TTFT (ms)"), (axes[1], "tpot_s", "TPOT (ms)"),
                               (axes[2], "e2e_s", "end-to-end latency (ms)")):
            vals = sorted(r[key] * 1000 for r in reqs if r[key] is not None)
            if vals:
                ys = [(i + 1) / len(vals) for i in range(len(vals))]
                ax.step(vals, ys, where="post")
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.02)
            ax.grid(True, alpha=0.3)
        s = runs[0]["summary"]
        tp = s["output_token_throughput"]
        fig.suptitle(f"latency CDFs: {title} ({s['num_completed']}/{s['num_requests']} ok"
                     + (f", {tp:.1f} tok/s" if tp else "") + ")")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
