"""Admission that holds KV blocks back for outputs of known length, against admitting whatever fits now.

    python bench/admission.py [--requests 48] [--max-tokens 384] [--kv-blocks 600] [--rounds 2]
                              [--workloads fixed,eos]

The packaged default model, offline engine, KV memory too short for the requests' outputs (by
default 600 blocks of 16 tokens: 9,600 tokens for 48 requests of up to ~450), every request arriving
at once, greedy. Workloads: `fixed`, synthetic 64-token prompts with ignore_eos (every output is
max_tokens long, so its length is known); `eos`, the seed replay's chat prompts that stop at EOS or
max_tokens (lengths unknown in advance: nothing is held back for them, so both settings should
match). reserve_known_growth false, then true, once per round, the order alternated, a fresh engine
each run.

Prints per run: preemptions, tokens computed (prompts plus every recomputed prefix), the most and
the mean sequences running, the time to first token (median and worst), the longest wait a stream sees between two of its tokens (median and
worst over the requests: a preempted stream waits until it is let in again and its prefix is
recomputed), total time and output tok/s; then each setting's median time, the speedup of holding
back, and whether every run's outputs are the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tritonllm.core.config import EngineConfig
from tritonllm.engine.engine import Engine
from tritonllm.models.model_files import resolve_model_dir
from tritonllm.core.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_tokens import chat_token_ids  # noqa: E402

SCENARIO = Path(__file__).resolve().parent.parent / "loadtest" / "scenarios" / "seed_replay.yaml"


def workload(name: str, requests: int, max_tokens: int) -> tuple[list[list[int]], SamplingParams]:
    if name == "fixed":
        prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(64)] for i in range(requests)]
        return prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    from transformers import AutoTokenizer
    from tritonllm_client.workload import build_requests, load_scenario
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("default"))
    specs = build_requests(load_scenario(SCENARIO), num_requests=requests)
    return [chat_token_ids(tokenizer, spec.prompt) for spec in specs], SamplingParams(max_tokens=max_tokens)


def run(prompts: list[list[int]], params: SamplingParams, kv_blocks: int, reserve: bool):
    engine = Engine(EngineConfig.from_parameters(model="default", num_kv_blocks=kv_blocks, max_num_seqs=len(prompts),
                                 reserve_known_growth=reserve))
    computed = 0
    schedule = engine.scheduler.schedule

    def counted_schedule():
        nonlocal computed
        out = schedule()
        computed += out.num_batched_tokens
        return out

    engine.scheduler.schedule = counted_schedule
    started = time.perf_counter()
    seqs = [engine._seqs[engine.add_request(prompt_token_ids=p, params=params)] for p in prompts]
    steps = running = peak = 0
    last_token = [started] * len(seqs)  # when each sequence last got a token (or arrived)
    counts = [0] * len(seqs)
    gaps: list[float] = []  # each sequence's longest wait between two tokens after its first
    longest = [0.0] * len(seqs)
    ttft = [0.0] * len(seqs)
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter()
        steps += 1
        running += engine.scheduler.num_running
        peak = max(peak, engine.scheduler.num_running)
        for i, s in enumerate(seqs):
            if s.num_output_tokens > counts[i]:
                if counts[i]:
                    longest[i] = max(longest[i], now - last_token[i])
                else:
                    ttft[i] = now - started
                counts[i], last_token[i] = s.num_output_tokens, now
    elapsed = time.perf_counter() - started
    gaps = sorted(longest)
    tokens = sum(s.num_output_tokens for s in seqs)
    return {"reserve_known_growth": reserve, "preemptions": engine.scheduler.num_preemptions,
            "tokens_computed": computed, "tokens_needed": sum(len(p) + s.num_output_tokens - 1 for p, s in zip(prompts, seqs)),
            "peak_running": peak, "mean_running": round(running / steps, 1),
            "ttft_s_p50_max": [round(statistics.median(ttft), 2), round(max(ttft), 2)],
            "longest_stall_s_p50_max": [round(statistics.median(gaps), 2), round(gaps[-1], 2)], "total_s": round(elapsed, 1),
            "output_tokens": tokens, "output_tok_s": round(tokens / elapsed, 1)}, [s.output_token_ids for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--kv-blocks", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="fixed,eos")
    args = ap.parse_args()
    settings = [False, True]
    for name in args.workloads.split(","):
        prompts, params = workload(name, args.requests, args.max_tokens)
        times: dict[bool, list[float]] = {c: [] for c in settings}
        outputs = []
        for r in range(args.rounds):
            for c in (settings if r % 2 == 0 else settings[::-1]):
                result, outs = run(prompts, params, args.kv_blocks, c)
                times[c].append(result["total_s"])
                outputs.append(outs)
                print(json.dumps({"workload": name, "round": r, **result}), flush=True)
        base = statistics.median(times[settings[0]])
        print(json.dumps({"workload": name, "median_total_s": {str(c): statistics.median(t) for c, t in times.items()},
                          "speedup": round(base / statistics.median(times[True]), 2),
                          "outputs_identical": all(o == outputs[0] for o in outputs)}), flush=True)


if __name__ == "__main__":
    main()
