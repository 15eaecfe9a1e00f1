"""Our engine offline (no server) against transformers on the same device, dtype and prompt tokens.

For a machine where no tritonserver runs (a GPU machine without the Triton wheel, say): a scenario's
requests all submitted at once to `Engine.generate`, timed from submission to the last token, beside
- our engine again with other parameters (`--variant`, e.g. `cuda_attention=torch` for the torch
  reference attention on a GPU),
- transformers' static batching: every prompt in one left-padded `generate` call,
- transformers' serial `generate`, one request at a time, measured on every `--serial-every`-th request
  and extrapolated per output token to all of them.
Greedy, exact lengths (`min_tokens` = `max_tokens`, EOS banned as transformers' `min_new_tokens` bans it).
Each system runs once warm. Printed: seconds, output tokens/s, ratios, and how many outputs agree
token for token with transformers' static batch; for each run of ours, where its steps' time went
(per step: scheduling, building the inputs, launching the forward and head, waiting for the ids,
applying them; on a GPU or NPU also the forward and head's own time on the device, from events; with
decode graphs, how many steps replayed one and the host's time around each replay). `--profile` runs
ours under torch's profiler and prints its tables.

  python bench/offline_engine.py --device cuda --dtype bfloat16 --variant cuda_attention=torch \\
      loadtest/scenarios/burst.yaml loadtest/scenarios/seed_replay_saturating.yaml
  # async scheduling against the synchronous loop, ours only (a CPU: --device cpu --dtype float32)
  python bench/offline_engine.py --device cuda --dtype bfloat16 --variant async_scheduling=false \\
      --no-transformers loadtest/scenarios/burst.yaml loadtest/scenarios/seed_replay_saturating.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prompt_tokens import prompt_token_ids
from tritonllm.core import tracing
from tritonllm.engine.engine import Engine, StepTimings
from tritonllm.models.model_files import resolve_model_dir
from tritonllm_client.workload import build_requests, load_scenario


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_ours(model_dir: str, device: str, dtype: str, ids, maxes, params: dict,
             profile: bool = False) -> tuple[float, list, str, str]:
    """(seconds, tokens per request, the backend's plan, where the steps' time went). `profile`: under
    torch's profiler, whose tables (the host's ops, then the device's kernels) are printed."""
    engine = Engine(model=model_dir, device=device, dtype=dtype, max_num_seqs=256, max_model_len=2048,
                    max_num_batched_tokens=4096, **params)
    backend = engine.runner.backend.describe() + ("; async scheduling" if engine.async_scheduling else "")
    engine.generate(prompt_token_ids=ids[:8], params={"max_tokens": 16, "ignore_eos": True})  # warm-up
    _sync(device)
    engine.runner.time_device = True
    engine.step_timings = StepTimings()
    graphs = getattr(engine.runner.backend, "graphs", None)
    if graphs is not None:
        graphs.replays, graphs.load_seconds, graphs.replay_seconds = 0, 0.0, 0.0
    profiler = _profiler(device) if profile else contextlib.nullcontext()
    tracing.enable(profile)
    with profiler:
        start = time.perf_counter()
        outs = engine.generate(prompt_token_ids=ids,
                               params=[{"max_tokens": m, "min_tokens": m, "ignore_eos": True} for m in maxes])
        _sync(device)
        seconds = time.perf_counter() - start
    breakdown = step_breakdown(engine.step_timings, seconds, engine.device.type == "cpu")
    if graphs is not None:
        n = max(graphs.replays, 1)
        breakdown += (f"\n      decode graphs replayed in {graphs.replays} of {engine.step_timings.steps} steps; per "
                      f"replay on the host: load and plan {1000 * graphs.load_seconds / n:.2f} ms, "
                      f"replay {1000 * graphs.replay_seconds / n:.2f} ms")
    if profile:
        tracing.enable(False)
        _print_profile(profiler, device)
    engine.close()
    del engine
    _free(device)
    return seconds, [o.token_ids for o in outs], backend, breakdown


def _profiler(device: str):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _print_profile(profiler, device: str, rows: int = 25) -> None:
    """The ops that took the host's time, then (on a GPU) the kernels that took the device's."""
    averages = profiler.key_averages()
    print("      profile, the engine's named ranges (tritonllm.*), host time per call and in all:")
    for event in sorted((e for e in averages if e.key.startswith("tritonllm.")), key=lambda e: -e.cpu_time_total):
        print(f"        {event.key:34s} {event.count:7d} calls {event.cpu_time_total / max(event.count, 1) / 1000:9.3f} ms "
              f"{event.cpu_time_total / 1e6:8.3f} s")
    print("      profile, by the host's own time (the profiler's overhead included):")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)
    if device.startswith("cuda"):
        print("      profile, by the device's own time:")
        print(averages.table(sort_by="self_device_time_total", row_limit=rows), flush=True)


def step_breakdown(t: StepTimings, seconds: float, host_device: bool) -> str:
    """Per step, in ms: the wall time, then where the engine's thread spent it."""
    n = max(t.steps, 1)
    ms = lambda s: f"{1000 * s / n:.2f}"  # noqa: E731
    parts = [f"{t.steps} steps, {ms(seconds)} ms each: host prepare {ms(t.schedule + t.prepare)} "
             f"(schedule {ms(t.schedule)}, inputs {ms(t.prepare)})",
             f"{'forward (on the host)' if host_device else 'launch'} {ms(t.launch)}", f"wait {ms(t.wait)}",
             f"apply {ms(t.apply)}"]
    if not host_device and t.device:
        parts.append(f"device forward+head {ms(t.device)}")
    return ", ".join(parts)


def run_transformers(model_dir: str, device: str, dtype: str, ids, maxes, serial_every: int):
    """(static batch seconds, its tokens per request, serial seconds extrapolated to every request)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(rows: list[int]) -> dict[int, list[int]]:
        width = max(len(ids[i]) for i in rows)
        x = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in rows], device=device)
        mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in rows], device=device)
        new = max(maxes[i] for i in rows)  # static batching: the longest output for every row
        with torch.inference_mode():
            y = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=pad)
        return {i: y[r, width:width + maxes[i]].tolist() for r, i in enumerate(rows)}

    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    generate(order[:8])  # warm-up
    _sync(device)
    start = time.perf_counter()
    got = generate(order)
    _sync(device)
    static = time.perf_counter() - start
    sample = order[::serial_every]
    start = time.perf_counter()
    for i in sample:
        generate([i])
    _sync(device)
    per_token = (time.perf_counter() - start) / sum(maxes[i] for i in sample)
    return static, [got[i] for i in range(len(ids))], per_token * sum(maxes)


def _params(pairs: list[str]) -> dict:
    return dict(pair.split("=", 1) for pair in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenarios", nargs="+", help="loadtest/scenarios/*.yaml")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--param", action="append", default=[], help="engine parameter for ours, name=value")
    ap.add_argument("--variant", action="append", default=[],
                    help="a second run of ours with this parameter changed, name=value (repeatable, all in one run)")
    ap.add_argument("--serial-every", type=int, default=16)
    ap.add_argument("--profile", action="store_true",
                    help="run ours (not its variants) under torch's profiler and print where the time went")
    ap.add_argument("--no-transformers", action="store_true",
                    help="ours only (with --variant: the two runs of ours against each other)")
    args = ap.parse_args()
    model_dir = str(resolve_model_dir(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for path in args.scenarios:
        scenario = load_scenario(path)
        specs = build_requests(scenario)
        ids = [prompt_token_ids(tokenizer, s.prompt, scenario.chat_template) for s in specs]
        maxes = [s.max_tokens for s in specs]
        total = sum(maxes)
        print(f"== {scenario.name} on {args.device} ({args.dtype}): {len(ids)} requests at once, "
              f"{sum(map(len, ids))} prompt tokens, {total} output tokens", flush=True)
        base = _params(args.param)
        runs = {"ours": run_ours(model_dir, args.device, args.dtype, ids, maxes, base, profile=args.profile)}
        if args.variant:
            runs["ours " + " ".join(args.variant)] = run_ours(model_dir, args.device, args.dtype, ids, maxes,
                                                            {**base, **_params(args.variant)})
        if args.no_transformers:
            first = next(iter(runs.values()))[1]
            for name, (seconds, tokens, backend, breakdown) in runs.items():
                same = sum(a == b for a, b in zip(tokens, first))
                print(f"  {name:32s} {seconds:8.3f} s {total / seconds:8.0f} tok/s   "
                      f"{same}/{len(ids)} equal to ours  [{backend}]\n      {breakdown}", flush=True)
            continue
        static, static_tokens, serial = run_transformers(model_dir, args.device, args.dtype, ids, maxes,
                                                         args.serial_every)
        _free(args.device)  # the transformers model is gone with run_transformers' frame
        for name, (seconds, tokens, backend, breakdown) in runs.items():
            same = sum(a == b for a, b in zip(tokens, static_tokens))
            print(f"  {name:32s} {seconds:8.3f} s {total / seconds:8.0f} tok/s   {static / seconds:5.2f}x static, "
                  f"{serial / seconds:6.1f}x serial; {same}/{len(ids)} equal to static  [{backend}]\n"
                  f"      {breakdown}", flush=True)
        print(f"  {'transformers static batch':32s} {static:8.3f} s {total / static:8.0f} tok/s")
        print(f"  {'transformers serial (sampled)':32s} {serial:8.3f} s {total / serial:8.0f} tok/s")


if __name__ == "__main__":
    main()
