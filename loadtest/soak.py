"""The soak: mixed Locust traffic against a running server, then a report of what it left behind.

    python loadtest/soak.py --grpc 127.0.0.1:8001 --http 127.0.0.1:8000 --metrics 127.0.0.1:8002 \
        --duration 1800 --users 8 --max-model-len 2048 --out results/soak

Runs loadtest/soak_locustfile.py for --duration seconds, samples the server's memory while it runs,
waits for the engine to go idle, and writes <out>.json (and prints it):

- requests by kind and outcome; `lost` counts requests without exactly one FINAL or one error;
- KV blocks still used once the server is idle (must be 0: nothing leaked by cancellations,
  refusals, or requests that ended at max_model_len);
- the server's RSS (tritonserver and its stub processes, the process tree that owns the HTTP port)
  at the end of the warm-up and at the end, and its growth;
- p99 time to first token of the streamed requests in the first and the last quarter after warm-up.

Exit code 0 when the run passes: no request lost, none ended with an error it did not ask for,
KV blocks back to 0, RSS growth under --max-rss-growth (5 %).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


# ---- the server's processes ---------------------------------------------------------------------------
def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(fields[9])
    return inodes


def pid_listening_on(port: int) -> int | None:
    """The process that listens on `port` (one this user may inspect), or None."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}") in wanted:
                    return int(entry)
        except OSError:
            continue
    return None


def _parents() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parents


def tree_rss_mb(root: int) -> float:
    """Resident memory of `root` and all its descendants, in MiB."""
    parents = _parents()
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == pid and p not in tree]
        tree.update(kids)
        frontier.extend(kids)
    total = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


# ---- metrics -----------------------------------------------------------------------------------------
def metric_sum(metrics_url: str, name: str, **labels) -> float | None:
    """The sum of a family's samples that carry `labels` (None when the endpoint does not answer)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(?P<labels>[^}}]*)\}} (?P<value>\S+)$", line)
        if match and all(f'{k}="{v}"' in match["labels"] for k, v in labels.items()):
            total += float(match["value"])
    return total


def wait_idle(metrics_url: str, timeout_s: float) -> dict:
    """Until no request is running or waiting in smollm2's engine, bounded; the gauges then."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {"running": metric_sum(metrics_url, "llm_requests", model="smollm2", state="running"),
                 "waiting": metric_sum(metrics_url, "llm_requests", model="smollm2", state="waiting"),
                 "kv_blocks_used": metric_sum(metrics_url, "llm_kv_cache_blocks", model="smollm2", state="used")}
        if (not any(state.values()) and None not in state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


# ---- the report --------------------------------------------------------------------------------------
def p99(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def summarize(records: list[dict], run_start: float, warmup_s: float, duration_s: float) -> dict:
    by_kind: dict = collections.defaultdict(collections.Counter)
    for r in records:
        by_kind[r["kind"]][r["outcome"]] += 1
    outcomes = collections.Counter(r["outcome"] for r in records)
    measured = duration_s - warmup_s
    first = [r["ttft_s"] for r in records if r["kind"] == "stream" and r["ttft_s"] is not None
             and warmup_s <= r["start"] - run_start < warmup_s + measured / 4]
    last = [r["ttft_s"] for r in records if r["kind"] == "stream" and r["ttft_s"] is not None
            and r["start"] - run_start >= duration_s - measured / 4]
    errors = collections.Counter(r["error"][:200] for r in records if r["outcome"] in ("error", "lost", "extra"))
    return {"requests": len(records), "by_outcome": dict(outcomes), "by_kind": {k: dict(v) for k, v in by_kind.items()},
            "lost": outcomes["lost"] + outcomes["extra"], "unexpected_errors": outcomes["error"],
            "errors": dict(errors.most_common(10)),
            "p99_ttft_s": {"start": p99(first), "end": p99(last), "samples": [len(first), len(last)]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    parser.add_argument("--http", default="127.0.0.1:8000")
    parser.add_argument("--metrics", default="127.0.0.1:8002")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before the start RSS is taken (default: a tenth of --duration, at least 30)")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=2048, help="the model's max_model_len")
    parser.add_argument("--no-embed", action="store_true", help="the server has no minilm: no embeddings")
    parser.add_argument("--max-rss-growth", type=float, default=5.0, help="percent, warm-up to end")
    parser.add_argument("--out", default="results/soak", help="prefix of the report, request log and Locust CSVs")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = Path(f"{out}_requests.jsonl")
    log.unlink(missing_ok=True)
    warmup = args.warmup if args.warmup is not None else max(30.0, args.duration / 10)
    server = pid_listening_on(int(args.http.rsplit(":", 1)[1]))
    metrics_url = f"http://{args.metrics}/metrics"

    samples: list[tuple[float, float]] = []  # (seconds into the run, MiB)
    stop = threading.Event()

    def sample() -> None:
        while server is not None and not stop.is_set():
            samples.append((time.time() - run_start, tree_rss_mb(server)))
            stop.wait(5.0)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "soak_locustfile.py"), "--headless", "--host", args.grpc,
           "-u", str(args.users), "-r", str(args.users), "-t", f"{int(args.duration)}s", "--stop-timeout", "150",
           "--soak-http", args.http, "--soak-log", str(log), "--soak-max-model-len", str(args.max_model_len),
           "--csv", str(out), "--only-summary", "--loglevel", "WARNING",
           *(["--soak-kinds", "stream,whole,cancel,invalid,long,n2,guided"] if args.no_embed else [])]
    run_start = time.time()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    locust = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.duration + 600)
    stop.set()
    sampler.join()
    idle = wait_idle(metrics_url, 60)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    report = summarize(records, run_start, warmup, args.duration)
    rss_start = next((mb for t, mb in samples if t >= warmup), None)
    rss_end = tree_rss_mb(server) if server is not None else None
    growth = None if not rss_start or rss_end is None else 100.0 * (rss_end - rss_start) / rss_start
    report.update(duration_s=args.duration, warmup_s=warmup, users=args.users, idle_after=idle,
                  server_pid=server, rss_mb={"after_warmup": rss_start, "end": rss_end, "growth_pct": growth,
                                             "peak": max((mb for _, mb in samples), default=None)},
                  locust_exit_code=locust.returncode)
    checks = {"no_request_lost": report["lost"] == 0, "no_unexpected_error": report["unexpected_errors"] == 0,
              "kv_blocks_back_to_0": idle["kv_blocks_used"] == 0,
              "rss_growth_ok": growth is not None and growth < args.max_rss_growth,
              "every_kind_ran": all(sum(v.values()) > 0 for v in report["by_kind"].values())
              and len(report["by_kind"]) >= (7 if args.no_embed else 8)}
    report["checks"] = checks
    report["passed"] = all(checks.values())
    Path(f"{out}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if locust.returncode not in (0, 1):  # 1: some request failed, which the report shows
        print(locust.stdout[-3000:] + locust.stderr[-3000:], file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
