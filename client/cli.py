"""`tritonllm-client`: stream one generation, or replay a workload scenario as a benchmark.

    tritonllm-client generate "What is the capital of France?"
    tritonllm-client bench --scenario loadtest/scenarios/smoke.yaml --out results/bench.json --plot results/bench.png

Errors (server down, unknown model, error responses) print one line to stderr and exit with 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from .stream import DEFAULT_MODEL, DEFAULT_URL, ClientError, GenerationParams, StreamingClient


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return v


def _positive_float(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return v


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated numbers, e.g. 1,2,4") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be > 0")
    return rates


def _sampling_param(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value  # a plain string (e.g. a stop word)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritonllm-client", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--url", default=DEFAULT_URL, help=f"Triton gRPC address (default {DEFAULT_URL})")
        sp.add_argument("--model", default=DEFAULT_MODEL, help=f"model name (default {DEFAULT_MODEL})")
        sp.add_argument("--timeout", type=_positive_float, default=600.0, metavar="S",
                        help="per-request timeout in seconds (default 600)")

    g = sub.add_parser("generate", help="stream one completion to stdout; TTFT and tokens/s to stderr")
    g.add_argument("prompt")
    common(g)
    g.add_argument("--max-tokens", type=_positive_int, default=128)
    g.add_argument("--min-tokens", type=int, default=None)
    g.add_argument("--stop", nargs="+", default=[], metavar="S", help="stop strings")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template (default on)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the prompt or output (default 1 = off)")
    g.add_argument("--priority", type=int, default=None)
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="after the text, each output token's log-prob and rank and the N most likely tokens")
    g.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="after the text, each prompt token's log-prob and rank and the N most likely tokens "
                        "(the prompt as the model sees it, chat template included)")
    g.add_argument("--param", action="append", type=_sampling_param, default=[], metavar="NAME=VALUE",
                   help="any other sampling parameter, the value as JSON where it parses (repeatable): "
                        "--param top_p=0.9 --param 'logit_bias={\"28\": -100}' --param seed=7")

    b = sub.add_parser("bench", help="replay a YAML scenario and report throughput and latency")
    b.add_argument("--scenario", required=True, help="scenario YAML (see loadtest/scenarios/)")
    common(b)
    b.add_argument("--num-requests", type=_positive_int, default=None, help="override num_requests")
    arrival = b.add_mutually_exclusive_group()
    arrival.add_argument("--interval", type=float, default=None, metavar="S", help="fixed interval between sends")
    arrival.add_argument("--rate", type=_positive_float, default=None, metavar="R", help="Poisson arrivals, req/s")
    arrival.add_argument("--rates", type=_rates, default=None, metavar="R1,R2,...",
                         help="one run per rate (Poisson), for a throughput-latency curve")
    b.add_argument("--fixed-interval-rates", action="store_true",
                   help="with --rates: send at fixed intervals 1/R instead of Poisson")
    b.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests before the runs (default 1)")
    b.add_argument("--max-concurrency", type=_positive_int, default=512,
                   help="most requests in flight at once (default 512; sends wait beyond it)")
    b.add_argument("--out", default=None, help="write the JSON result here (e.g. results/bench.json)")
    b.add_argument("--plot", default=None, help="write a PNG plot here (e.g. results/bench.png)")
    b.add_argument("--save-text", action="store_true", help="keep every generated text in the JSON")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def format_logprobs(title: str, positions: list) -> str:
    """One line per token: its text, log-prob and rank, then the other likely tokens with theirs.

    `positions` holds the server's per-token objects ({token id: {logprob, rank, decoded_token}},
    the token itself first); None (the prompt's first token, which nothing scores) prints as '-'.
    """
    lines = [f"{title} (token, log-prob, rank | other likely tokens):"]
    for i, entries in enumerate(positions):
        if not entries:
            lines.append(f"{i:>5}  -")
            continue
        (own, *others) = entries.values()
        alternatives = ", ".join(f"{e['decoded_token']!r} {e['logprob']:.3f}" for e in others)
        line = f"{i:>5}  {own['decoded_token']!r:<18} {own['logprob']:>9.4f}  #{own['rank']:<6}"
        lines.append(f"{line}| {alternatives}" if alternatives else line.rstrip())
    return "\n".join(lines) + "\n"


def cmd_generate(args) -> int:
    extra = dict(args.param)
    if args.logprobs is not None:
        extra["logprobs"] = args.logprobs
    if args.prompt_logprobs is not None:
        extra["prompt_logprobs"] = args.prompt_logprobs
    params = GenerationParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens, ignore_eos=args.ignore_eos,
                              stop=args.stop, temperature=args.temperature,
                              repetition_penalty=args.repetition_penalty, priority=args.priority, chat=args.chat,
                              return_logprobs="logprobs" in extra, extra=extra)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    several = str(params.extra.get("n", 1)) not in ("1", "None")  # n completions: printed one by one at the end
    with StreamingClient(args.url, args.model) as client:
        res = client.generate(args.prompt, params, on_text=None if several else show, timeout_s=args.timeout)
    for i, text in enumerate(res.texts if several else []):
        sys.stdout.write(f"[completion {i}]\n{text}\n")
    if res.text and not several and not res.text.endswith("\n"):
        sys.stdout.write("\n")
    if res.prompt_logprobs is not None:
        sys.stdout.write(format_logprobs("prompt log-probs", res.prompt_logprobs))
    if res.token_logprobs:
        sys.stdout.write(format_logprobs("output log-probs" + (" (completion 0)" if several else ""),
                                         res.token_logprobs))
    sys.stdout.flush()
    if not res.ok:
        print(f"error: {res.error}", file=sys.stderr)
        return 1
    n = res.num_output_tokens
    decode = (res.end_time - res.first_token_time) if res.first_token_time is not None else None
    parts = [f"ttft {res.ttft * 1000:.1f} ms" if res.ttft is not None else "ttft -",
             f"{n} tokens in {res.e2e:.2f} s",
             f"{n / res.e2e:.1f} tokens/s" if res.e2e else "",
             f"decode {(n - 1) / decode:.1f} tokens/s" if decode and n > 1 else "",
             f"finish {res.finish_reason}" if res.finish_reason else ""]
    print("[" + ", ".join(p for p in parts if p) + "]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench
    from .report import format_summary, plot
    from .workload import load_scenario

    try:
        scenario = load_scenario(args.scenario)
    except (OSError, ValueError) as e:
        raise ClientError(f"scenario: {e}") from None
    if args.interval is not None and args.interval < 0:
        raise ClientError("--interval must be >= 0")
    runs: Optional[list[dict]] = None
    if args.rates:
        runs = [{"interval_s": 1.0 / r} if args.fixed_interval_rates else {"rate": r} for r in args.rates]
    elif args.rate is not None:
        runs = [{"rate": args.rate}]
    elif args.interval is not None:
        runs = [{"interval_s": args.interval}]
    for path in (args.out, args.plot):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)

    result = run_bench(args.url, args.model, scenario, num_requests=args.num_requests, runs=runs,
                       timeout_s=args.timeout, max_concurrency=args.max_concurrency, warmup=max(args.warmup, 0),
                       progress=not args.no_progress, keep_text=args.save_text)
    for run in result["runs"]:
        print(format_summary(run["summary"], f"{scenario.name} ({run['label']}) -> {result['url']} {args.model}"))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    failed = sum(r["summary"]["num_failed"] for r in result["runs"])
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        return cmd_bench(args)
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except Exception as e:  # one line, no traceback; TRITONLLM_CLIENT_DEBUG=1 shows it
        if os.environ.get("TRITONLLM_CLIENT_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
