"""AIPerf and `tritonllm-client bench` over the same concurrency sweep, against one running server.

    bash scripts/serve.sh                                  # tritonserver, and the OpenAI API on 9000
    python bench/aiperf_sweep.py --levels 1,4,16 --out results/aiperf-sweep

At each concurrency C, one after the other:
  - AIPerf (its own venv, scripts/install_aiperf.sh): streamed requests to the OpenAI API,
    `--concurrency C`, token counts from the server's `usage`;
  - `tritonllm-client bench`: Triton's gRPC streaming straight, every request queued at once and
    `--max-concurrency C` in flight, which is AIPerf's closed loop of C clients.
Both send the same lengths: prompts of about `--isl` tokens (AIPerf's synthetic text; ours `--isl / 1.1`
words of its built-in sentences), in the chat template for `chat`, and exactly `--osl` output tokens
(`ignore_eos`), greedy. Prints one markdown table (output tok/s, TTFT, TPOT / inter-token latency and
request latency p50 of each tool) with the load average before each run; writes every result under
`--out`. Both load generators share the machine with the server, as the clients of docs/PERFORMANCE.md do.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_average() -> float:
    return os.getloadavg()[0]


def run_aiperf(args, level: int, requests: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [args.aiperf, "profile", "--model", args.model, "--url", args.openai_url,
           "--endpoint-type", args.endpoint_type, "--streaming", "--tokenizer", args.tokenizer,
           "--concurrency", str(level), "--request-count", str(requests), "--warmup-request-count", "1",
           "--isl", str(args.isl), "--osl", str(args.osl), "--random-seed", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--use-server-token-count", "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--artifact-dir", str(out)]
    # HF_HUB_OFFLINE set makes AIPerf's tokenizer check refuse a local folder path.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    with open(out / "aiperf.out", "w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out)
    r = json.loads((out / "profile_export_aiperf.json").read_text())
    return {"completed": r["completed_request_count"]["avg"], "errors": len(r.get("error_summary") or []),
            "tok_s": r["output_token_throughput"]["avg"], "ttft_ms": r["time_to_first_token"]["p50"],
            "tpot_ms": r["inter_token_latency"]["p50"], "e2e_ms": r["request_latency"]["p50"],
            "prompt_tokens": r["usage_prompt_tokens"]["avg"], "output_tokens": r["output_sequence_length"]["avg"]}


def run_client(args, level: int, requests: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    scenario = out / "scenario.yaml"
    scenario.write_text(
        "name: aiperf_sweep\n"
        f"num_requests: {requests}\ninterval_s: 0.0\nseed: 0\n"
        f"prompt_len: {{dist: fixed, value: {round(args.isl / 1.1)}}}\n"
        f"output_len: {{dist: fixed, value: {args.osl}}}\n"
        f"chat_template: {'true' if args.endpoint_type == 'chat' else 'false'}\nignore_eos: true\ntemperature: 0.0\n")
    client = shutil.which("tritonllm-client") or str(Path(sys.executable).parent / "tritonllm-client")
    cmd = [client, "bench", "--scenario", str(scenario), "--url", args.grpc_url, "--model", args.model,
           "--max-concurrency", str(level), "--warmup", "1", "--no-progress", "--out", str(out / "bench.json")]
    with open(out / "bench.out", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    run = json.loads((out / "bench.json").read_text())["runs"][0]
    s = run["summary"]
    prompts = [r["num_input_tokens"] for r in run["requests"] if r.get("num_input_tokens")]
    return {"completed": s["num_completed"], "errors": s["num_failed"], "tok_s": s["output_token_throughput"],
            "ttft_ms": s["ttft_s"]["p50"] * 1e3, "tpot_ms": s["tpot_s"]["p50"] * 1e3, "e2e_ms": s["e2e_s"]["p50"] * 1e3,
            "prompt_tokens": statistics.mean(prompts) if prompts else float("nan"),
            "output_tokens": s["total_output_tokens"] / max(s["num_completed"], 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--endpoint-type", choices=("chat", "completions"), default="chat")
    parser.add_argument("--levels", default="1,4,16", help="concurrency levels")
    parser.add_argument("--requests-per-client", type=int, default=4, help="requests per level: this x C, at least 8")
    parser.add_argument("--isl", type=int, default=110, help="prompt tokens (before the chat template)")
    parser.add_argument("--osl", type=int, default=128, help="output tokens, exact")
    parser.add_argument("--aiperf", default=str(REPO / ".venv-aiperf" / "bin" / "aiperf"))
    parser.add_argument("--tokenizer", default=None, help="the model folder (default: the prepared default model)")
    parser.add_argument("--out", default="results/aiperf-sweep")
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        from tritonllm.models.model_files import resolve_model_dir

        args.tokenizer = str(resolve_model_dir("default"))
    out = Path(args.out)
    rows = []
    for level in (int(x) for x in args.levels.split(",")):
        requests = max(8, args.requests_per_client * level)
        for tool, run in (("AIPerf (OpenAI API)", run_aiperf), ("tritonllm-client (gRPC)", run_client)):
            load = load_average()
            result = run(args, level, requests, out / f"c{level}" / ("aiperf" if run is run_aiperf else "client"))
            rows.append((level, tool, load, result))
            print(f"c={level} {tool}: {json.dumps(result)}", file=sys.stderr, flush=True)
    lines = ["| concurrency | tool | load before | requests | prompt tokens | output tokens | output tok/s | "
             "TTFT p50 (ms) | TPOT p50 (ms) | latency p50 (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for level, tool, load, r in rows:
        lines.append(f"| {level} | {tool} | {load:.1f} | {r['completed']:.0f} ({r['errors']} failed) | "
                     f"{r['prompt_tokens']:.0f} | {r['output_tokens']:.0f} | {r['tok_s']:.1f} | {r['ttft_ms']:.0f} | "
                     f"{r['tpot_ms']:.1f} | {r['e2e_ms']:.0f} |")
    table = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
