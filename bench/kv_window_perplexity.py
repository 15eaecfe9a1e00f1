"""Accuracy cost of recent-window KV pruning: perplexity of a fixed text, token by token.

    python bench/kv_window_perplexity.py [--tokens 1024] [--windows 0,128,256,512] [--sinks 0,4]

The text is Python's own reference documentation (pydoc_data, in every CPython install), so the
figure is reproducible offline. Each token is fed as a decode step through the engine's scheduler
pruning, block manager and paged attention; the log-probability of the true next token is taken
from the logits. Window 0 is the unpruned baseline.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from tritonllm.scheduling.block_manager import PrefixMatch
from tritonllm.core.config import EngineConfig
from tritonllm.engine.engine import Engine
from tritonllm.core.sampling_params import SamplingParams
from tritonllm.scheduling.scheduler import ScheduledSeq
from tritonllm.core.sequence import Sequence


def fixed_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in ("assignment", "compound", "class", "function", "exceptions"))


@torch.inference_mode()
def perplexity(engine: Engine, ids: list[int]) -> tuple[float, int]:
    """Returns (perplexity, peak KV blocks held)."""
    bm, sched, runner = engine.block_manager, engine.scheduler, engine.runner
    seq = Sequence("ppl", ids[:1], SamplingParams(max_tokens=len(ids), ignore_eos=True))
    bm.allocate(seq, PrefixMatch(), 1)
    nll, peak = 0.0, 0
    for i in range(len(ids) - 1):
        bm.append_slots(seq, i + 1)
        sched._prune_window(seq)
        step = runner.prepare([ScheduledSeq(seq, 1)]).device
        hidden = runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta)
        logits = runner.model.compute_logits(hidden[step.logits_rows]).float()
        nll -= torch.log_softmax(logits, dim=-1)[0, ids[i + 1]].item()
        seq.num_computed_tokens += 1
        seq.token_ids.append(ids[i + 1])
        peak = max(peak, sum(1 for b in seq.block_table if b >= 0))
    bm.free(seq)
    return math.exp(nll / (len(ids) - 1)), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--windows", default="0,128,256,512")
    ap.add_argument("--sinks", default="0,4")
    args = ap.parse_args()
    rows = []
    base = Engine(EngineConfig.from_parameters(num_kv_blocks=256, enable_prefix_caching=False, warmup=False))
    ids = base.tokenizer.encode(fixed_text())[:args.tokens]
    for window in [int(w) for w in args.windows.split(",")]:
        for sinks in ([0] if window == 0 else [int(s) for s in args.sinks.split(",")]):
            base.scheduler.kv_window = window
            base.scheduler.kv_sink_tokens = sinks
            started = time.perf_counter()
            ppl, peak = perplexity(base, ids)
            rows.append((window, sinks, ppl, peak, time.perf_counter() - started))
            print(f"window={window or 'off':>5} sinks={sinks}: perplexity {ppl:.3f}, peak KV blocks {peak}, "
                  f"{rows[-1][4]:.0f} s", flush=True)
    print(f"\n| kv_window | kv_sink_tokens | perplexity ({len(ids)} tokens) | peak KV blocks |\n|---|---|---|---|")
    for window, sinks, ppl, peak, _ in rows:
        print(f"| {window or 'off'} | {sinks} | {ppl:.3f} | {peak} |")


if __name__ == "__main__":
    main()
