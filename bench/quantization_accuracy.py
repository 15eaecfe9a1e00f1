"""What a lossy number format costs in accuracy: our engine with `--variant` parameters (FP8 weights, an FP8
KV cache) against the same engine without them, on the same device, dtype and prompts.

For each variant, printed:
- greedy agreement: of the base's greedy outputs, how many the variant reproduces token for token, and
  the mean share of each output before the first differing token;
- teacher-forced: the base's outputs scored by both engines after the same tokens (`prompt_logprobs`), so
  one early difference does not change everything after it: per token, |log-prob difference| (mean,
  99th percentile, max) and how often the variant's own greedy choice there is the base's token.

  python bench/quantization_accuracy.py --device cpu --dtype float32
  python bench/quantization_accuracy.py --device cuda --dtype bfloat16 --variant quantization=fp8 \
      --variant kv_cache_dtype=fp8 --variant quantization=fp8,kv_cache_dtype=fp8
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from prompt_tokens import prompt_token_ids
from tritonllm.engine.engine import Engine
from tritonllm.models.model_files import resolve_model_dir
from tritonllm_client.workload import build_requests, load_scenario

SCENARIO = Path(__file__).resolve().parent.parent / "loadtest" / "scenarios" / "burst.yaml"
# FP8 weights, an FP8 KV cache, both; and, for scale, what bfloat16 alone costs against float32.
VARIANTS = ("quantization=fp8", "kv_cache_dtype=fp8", "quantization=fp8,kv_cache_dtype=fp8", "dtype=bfloat16")


def _params(text: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in text.split(",") if pair)


def run(model_dir: str, device: str, dtype: str, prompts: list[list[int]], tokens: int, params: dict,
        outputs: list[list[int]] | None) -> tuple[list[list[int]], list[np.ndarray], list[np.ndarray], str]:
    """(greedy outputs, per prompt the log-probs of `outputs` (default: its own) teacher-forced, whether each was
    this engine's own greedy choice there, the backend's plan)."""
    engine = Engine(model=model_dir, device=device, max_num_seqs=64, max_model_len=2048, max_num_batched_tokens=2048,
                    **{"dtype": dtype, "enable_prefix_caching": "false", **params})
    plan = engine.runner.backend.describe()
    greedy = [o.token_ids for o in engine.generate(
        prompt_token_ids=prompts, params={"max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True})]
    outputs = outputs or greedy
    scored = engine.generate(prompt_token_ids=[p + o for p, o in zip(prompts, outputs)],
                             params={"max_tokens": 1, "prompt_logprobs": 1})
    logprobs, top1 = [], []
    for prompt, output, s in zip(prompts, outputs, scored):
        entries = s.prompt_logprobs[len(prompt):]
        logprobs.append(np.array([e[0][1] for e in entries]))
        top1.append(np.array([e[0][2] == 1 for e in entries]))
        assert [e[0][0] for e in entries] == output
    del engine
    gc.collect()
    return greedy, logprobs, top1, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=32, help="the first N prompts of the burst scenario")
    ap.add_argument("--tokens", type=int, default=48, help="greedy output tokens per prompt")
    ap.add_argument("--variant", action="append", default=[],
                    help=f"engine parameters name=value[,name=value] (default: {' | '.join(VARIANTS)})")
    args = ap.parse_args()
    model_dir = str(resolve_model_dir(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scenario = load_scenario(SCENARIO)
    prompts = [prompt_token_ids(tokenizer, s.prompt, scenario.chat_template)
               for s in build_requests(scenario)[:args.prompts]]
    base, base_lp, _, plan = run(model_dir, args.device, args.dtype, prompts, args.tokens, {}, None)
    print(f"{args.model} on {args.device} ({args.dtype}): {len(prompts)} prompts x {args.tokens} greedy tokens\n"
          f"  base: {plan}")
    print("| variant | greedy outputs equal | share before the first difference | "
          "teacher-forced |d log-prob| mean / p99 / max | variant's greedy = base token |")
    print("|---|---|---|---|---|")
    for variant in args.variant or VARIANTS:
        greedy, lp, top1, plan = run(model_dir, args.device, args.dtype, prompts, args.tokens, _params(variant), base)
        same = sum(g == b for g, b in zip(greedy, base))
        prefix = np.mean([next((i for i, (x, y) in enumerate(zip(g, b)) if x != y), len(b)) / len(b)
                          for g, b in zip(greedy, base)])
        diff = np.abs(np.concatenate(lp) - np.concatenate(base_lp))
        agree = np.concatenate(top1).mean()
        print(f"| {variant} | {same}/{len(base)} | {prefix:.0%} | {diff.mean():.4f} / {np.percentile(diff, 99):.3f} / "
              f"{diff.max():.3f} | {agree:.1%} |", flush=True)
        print(f"    plan: {plan}")


if __name__ == "__main__":
    main()
