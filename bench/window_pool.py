"""The sliding layers' own KV pool on versus off, same run, same memory: a Gemma 3 shaped model.

    python bench/window_pool.py [--requests 32] [--prompt-tokens 64] [--max-tokens 960] [--kv-mib 160]
                                [--window-blocks 0,200]

A model with Gemma 3's layer pattern (five sliding layers to one full, window 64) and random
weights, written by transformers into a temporary folder (nothing is downloaded). Every setting gets
the same KV memory (`kv_cache_max_bytes`) and the same requests, all arriving at once, greedy with
ignore_eos: one pool (window_pool=false), then the window pool at each `--window-blocks`
(num_window_kv_blocks; 0: its default size). Prints per setting: the pools' blocks, how many sequences
of max_model_len they hold, the most sequences running at once, preemptions, total time, output
tok/s, and whether every setting's outputs are the first one's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
import transformers

from tritonllm.core.config import EngineConfig
from tritonllm.engine.engine import Engine
from tritonllm.models.model_files import resolve_model_dir
from tritonllm.core.sampling_params import SamplingParams


def write_model(folder: str, window: int, layers: int) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir("default"))
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        sliding_window=window, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run(folder: str, window_pool: bool, window_blocks: int, prompts: list[list[int]], max_tokens: int, kv_bytes: int,
        max_model_len: int) -> tuple[dict, list[list[int]]]:
    engine = Engine(EngineConfig.from_parameters(model=folder, window_pool=window_pool, num_window_kv_blocks=window_blocks,
                                 kv_cache_max_bytes=kv_bytes, max_model_len=max_model_len, max_num_seqs=len(prompts),
                                 max_num_batched_tokens=128))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    rids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    seqs = [engine._seqs[r] for r in rids]
    peak_running = 0
    while engine.has_unfinished():
        engine.step()
        peak_running = max(peak_running, engine.scheduler.num_running)
    elapsed = time.perf_counter() - started
    runner = engine.runner
    tokens = sum(s.num_output_tokens for s in seqs)
    return {"window_pool": window_pool, "num_window_kv_blocks": window_blocks, "main_pool_blocks": runner.num_blocks,
            "window_pool_blocks": runner.num_window_blocks,
            "sequences_of_max_model_len_held": round(runner.kv_plan.max_concurrency, 1),
            "peak_running": peak_running, "preemptions": engine.scheduler.num_preemptions,
            "total_s": round(elapsed, 2), "output_tok_s": round(tokens / elapsed, 1)}, [s.output_token_ids for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=960)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12, help="a multiple of 6")
    ap.add_argument("--kv-mib", type=int, default=160, help="KV memory for every setting (activations' reserve included)")
    ap.add_argument("--window-blocks", default="0", help="window pool sizes to run (num_window_kv_blocks; 0: default)")
    args = ap.parse_args()
    max_model_len = args.prompt_tokens + args.max_tokens
    prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(args.prompt_tokens)] for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as folder:
        write_model(folder, args.window, args.layers)
        settings = [(False, 0)] + [(True, int(b)) for b in args.window_blocks.split(",")]
        results, outputs = [], []
        for window_pool, window_blocks in settings:
            result, outs = run(folder, window_pool, window_blocks, prompts, args.max_tokens, args.kv_mib << 20,
                               max_model_len)
            base = results[0] if results else result
            result["sequences_held_ratio"] = round(result["sequences_of_max_model_len_held"]
                                                   / base["sequences_of_max_model_len_held"], 2)
            result["speedup"] = round(base["total_s"] / result["total_s"], 2)
            result["outputs_identical_to_one_pool"] = outs == (outputs[0] if outputs else outs)
            results.append(result)
            outputs.append(outs)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
