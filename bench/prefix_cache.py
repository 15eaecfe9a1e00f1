"""Prefix caching on versus off, same run: a shared system prompt of a few hundred tokens.

    python bench/prefix_cache.py [--requests 32] [--system-words 300] [--max-tokens 32]

Each configuration runs in a fresh engine: all requests arrive at once, in waves that share the
system prompt. Prints TTFT (mean, p50, p90), total time, output tok/s and the prefix hit rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tritonllm.core.config import EngineConfig
from tritonllm.engine.engine import Engine
from tritonllm.core.sampling_params import SamplingParams

SYSTEM = ("You are a careful assistant for a public library. You answer questions about opening hours, "
          "borrowing rules, late fees, events, study rooms, printing, accessibility services and the "
          "catalogue. Be brief, friendly and precise; if you do not know, say so and suggest asking staff. ")


def system_prompt(words: int) -> str:
    base = SYSTEM.split()
    return " ".join((base * (words // len(base) + 1))[:words])


def run(enable_prefix_caching: bool, prompts: list[str], max_tokens: int, waves: int) -> dict:
    engine = Engine(EngineConfig.from_parameters(enable_prefix_caching=enable_prefix_caching, num_kv_blocks=2048,
                                 max_num_seqs=64, max_num_batched_tokens=512))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    per_wave = len(prompts) // waves
    ttfts, tokens = [], 0
    started = time.perf_counter()
    for w in range(waves):
        outs = engine.generate(prompts[w * per_wave:(w + 1) * per_wave], params)
        ttfts += [o.times["first_token"] - o.times["arrival"] for o in outs]
        tokens += sum(len(o.token_ids) for o in outs)
    elapsed = time.perf_counter() - started
    ttfts.sort()
    return {"prefix_caching": enable_prefix_caching, "total_s": round(elapsed, 2),
            "output_tok_s": round(tokens / elapsed, 1),
            "ttft_mean_s": round(statistics.mean(ttfts), 3), "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
            "ttft_p90_s": round(ttfts[int(len(ttfts) * 0.9)], 3),
            "prefix_hit_rate": round(engine.block_manager.prefix_hit_rate, 3),
            "prompt_tokens": len(engine.tokenizer.encode(prompts[0]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--waves", type=int, default=4, help="requests arrive in this many waves")
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    system = system_prompt(args.system_words)
    prompts = [f"{system}\nQuestion {i}: can I renew a book for the {i}th time, and what does it cost?"
               for i in range(args.requests)]
    results = [run(False, prompts, args.max_tokens, args.waves), run(True, prompts, args.max_tokens, args.waves)]
    off, on = results
    print(json.dumps(results, indent=2))
    print(f"prefix caching: TTFT mean {off['ttft_mean_s']:.3f}s -> {on['ttft_mean_s']:.3f}s "
          f"({off['ttft_mean_s'] / on['ttft_mean_s']:.2f}x), throughput {off['output_tok_s']} -> "
          f"{on['output_tok_s']} tok/s ({on['output_tok_s'] / off['output_tok_s']:.2f}x), "
          f"hit rate {on['prefix_hit_rate']:.0%}")


if __name__ == "__main__":
    main()
