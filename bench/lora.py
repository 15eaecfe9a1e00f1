"""Multi-LoRA's cost: a scenario's requests spread over N adapters against the base model alone.

Both runs are our engine offline on this machine, in this process, with the same prompts and exact
output lengths (greedy, `min_tokens` = `max_tokens`, EOS ignored), every request submitted at once as
in bench/offline_engine.py: the batch stays full, as under the saturating replay. The LoRA run serves
N adapters (random weights of the given rank on q, k, v, o, gate, up and down, written in PEFT's
format to a temporary folder) and gives request i adapter i mod N. Printed: each run's seconds and
output tokens/s, and the ratio LoRA / base (the issue's target: at most 1.15).

  python bench/lora.py                                   # the saturating replay, 4 rank-16 adapters
  python bench/lora.py --num-requests 16 --max-tokens 32 # a short check that it runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from prompt_tokens import prompt_token_ids
from tritonllm.core.config import EngineConfig
from tritonllm.engine.engine import Engine
from tritonllm.models.model_files import resolve_model_dir
from tritonllm_client.workload import build_requests, load_scenario

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, model_dir: str, rank: int, seed: int) -> None:
    """A random adapter for the model in PEFT's save_pretrained format (what multi_lora.json points at)."""
    from safetensors.torch import save_file

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv, h, inter = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim, cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))


def run(config: EngineConfig, ids, maxes, adapters: list[str]) -> tuple[float, str]:
    engine = Engine(config)
    names = adapters or [None]
    engine.generate(prompt_token_ids=ids[:8], params=[{"max_tokens": 16, "ignore_eos": True, "lora_name": names[i % len(names)]}
                                                       for i in range(min(8, len(ids)))])  # warm-up
    start = time.perf_counter()
    engine.generate(prompt_token_ids=ids, params=[{"max_tokens": m, "min_tokens": m, "ignore_eos": True,
                                                   "lora_name": names[i % len(names)]} for i, m in enumerate(maxes)])
    seconds = time.perf_counter() - start
    backend = engine.runner.backend.describe()
    engine.close()
    return seconds, backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario", nargs="?", default="loadtest/scenarios/seed_replay_saturating.yaml")
    ap.add_argument("--model", default="default")
    ap.add_argument("--adapters", type=int, default=4, help="how many adapters the requests are spread over")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=0, help="the scenario's first N requests only (0: all)")
    ap.add_argument("--max-tokens", type=int, default=0, help="cap each request's output length (0: the scenario's)")
    ap.add_argument("--repeats", type=int, default=1, help="base and LoRA runs, alternating, this many times each")
    ap.add_argument("--param", action="append", default=[], help="engine parameter for both runs, name=value")
    args = ap.parse_args()
    model_dir = str(resolve_model_dir(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scenario = load_scenario(args.scenario)
    specs = build_requests(scenario)[:args.num_requests or None]
    ids = [prompt_token_ids(tokenizer, s.prompt, scenario.chat_template) for s in specs]
    maxes = [min(s.max_tokens, args.max_tokens) if args.max_tokens else s.max_tokens for s in specs]
    params = dict(model=model_dir, max_num_seqs=256, max_model_len=2048, max_num_batched_tokens=4096,
                  **dict(pair.split("=", 1) for pair in args.param))
    base_config = EngineConfig.from_parameters(params)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(args.adapters):
            write_adapter(Path(tmp) / f"adapter{i}", model_dir, args.rank, seed=i)
            adapters.append((f"adapter{i}", str(Path(tmp) / f"adapter{i}")))
        lora_config = EngineConfig.from_parameters(params, max_loras=str(max(args.adapters, 1)))
        lora_config = dataclasses.replace(lora_config, lora=dataclasses.replace(lora_config.lora, adapters=tuple(adapters)))
        total = sum(maxes)
        print(f"== {scenario.name}: {len(ids)} requests at once, {sum(map(len, ids))} prompt tokens, {total} output "
              f"tokens; LoRA: {args.adapters} adapters of rank {args.rank}", flush=True)
        base_times, lora_times = [], []
        for _ in range(args.repeats):
            seconds, backend = run(base_config, ids, maxes, [])
            base_times.append(seconds)
            print(f"  base          {seconds:8.3f} s {total / seconds:8.0f} tok/s  [{backend}]", flush=True)
            seconds, _ = run(lora_config, ids, maxes, [name for name, _ in adapters])
            lora_times.append(seconds)
            print(f"  {args.adapters} adapters    {seconds:8.3f} s {total / seconds:8.0f} tok/s", flush=True)
        print(f"  LoRA / base: {min(lora_times) / min(base_times):.3f}x (best of {args.repeats} each; target <= 1.15x)")


if __name__ == "__main__":
    main()
