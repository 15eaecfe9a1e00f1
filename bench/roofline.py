"""How close the engine runs to this machine's limit: GEMM rates, KV bytes per token, decode step, one stream.

All measured in the benchmark's own process at the same torch thread count, so "% of GEMM rate"
compares numbers taken minutes apart on the same (possibly shared) machine:
- GEMM rate: fp32 at 2048^3 (the machine's practical peak) and at the decode shapes of batch 64
  ([64,576]x[576,1536] as in gate/up, and the LM head [64,576]x[576,49152]), each through torch's
  own F.linear / torch.mm (MKL on x86) and through oneDNN with the weight packed once (what the
  engine uses on CPU, devices/cpu/packed_linear.py). The peak is the better of the two at 2048^3.
- KV bytes per token: layers x 2 x kv_heads x head_dim x dtype bytes from config.json, next to the
  bytes the offline engine's pool really spends per token slot (equal means no padding waste).
- Decode step at batch 64: the offline Engine (warm) with 64 sequences all decoding; `step()`
  wall time, split into `runner.execute` (forward + head + the one device-to-host copy) and the
  rest (scheduling, input preparation, output handling: host time).
- One stream: one sequence alone, its time per output token beside the bytes a token reads (each
  weight once, in the form the kernels read at one row, plus the context's KV) and the memory read rate
  measured in the same process: bytes / rate is the token's floor on this machine.
FLOPs of one decode step: 2 x batch x (every Linear weight of the decoder layers + the LM head),
counted from the loaded model; attention over the context is reported apart (it grows with it).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def _rate(fn, flops: float, chunks: int = 5, min_chunk_s: float = 0.2, max_iters: int = 10_000) -> dict:
    """GFLOPS of `fn` in `chunks` timed chunks of >= min_chunk_s each: best (capability) and median."""
    fn()
    fn()
    rates = []
    for _ in range(chunks):
        iters, start = 0, time.perf_counter()
        while iters < max_iters:
            fn()
            iters += 1
            if time.perf_counter() - start >= min_chunk_s:
                break
        rates.append(flops * iters / (time.perf_counter() - start) / 1e9)
    return {"gflops_best": max(rates), "gflops_median": statistics.median(rates)}


@torch.inference_mode()
def gemm_rates(threads: int, hidden: int = 576, intermediate: int = 1536, vocab: int = 49152, batch: int = 64) -> dict:
    """fp32 GEMM rates at the machine's best shape and at the model's decode shapes."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2048, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)
    x = torch.randn(batch, hidden, generator=gen)
    w_up, w_head = torch.randn(intermediate, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen)
    from tritonllm.devices.cpu import kernels as cpu_kernels
    from tritonllm.devices.cpu.packed_linear import PackedWeight, onednn_packing_supported

    def both(x, w, flops) -> dict:
        """aten's rate, oneDNN's and ours (AVX-512) with the weight packed once, and the best of them (best/median)."""
        rates = {"aten": _rate(lambda: F.linear(x, w), flops)}
        kernels = (["onednn"] if onednn_packing_supported(x.device, x.dtype) else []) + (
            ["avx512"] if x.dtype == torch.float32 and cpu_kernels.packed_gemm_supported() else [])
        for kernel in kernels:
            packed = PackedWeight(w, kernel, x.shape[0])
            rates[kernel] = _rate(lambda: packed(x, None), flops)
        return {**max(rates.values(), key=lambda r: r["gflops_best"]), "by_library": rates}

    return {
        "threads": torch.get_num_threads(),
        "mm_2048": {"shape": "[2048,2048]x[2048,2048]", **both(a, b, 2 * 2048 ** 3)},
        "decode_linear": {"shape": f"[{batch},{hidden}]x[{hidden},{intermediate}]",
                          **both(x, w_up, 2 * batch * hidden * intermediate)},
        "lm_head": {"shape": f"[{batch},{hidden}]x[{hidden},{vocab}]",
                    **both(x, w_head, 2 * batch * hidden * vocab)},
    }


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> dict:
    """layers x 2 (K and V) x kv_heads x head_dim x dtype bytes, from config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers = cfg["num_hidden_layers"]
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype_bytes": dtype_bytes,
            "bytes_per_token": layers * 2 * kv_heads * head_dim * dtype_bytes}


def decode_flops(model: nn.Module, batch: int, context_lens: list[int]) -> dict:
    """FLOPs of one decode step: weights (Linear layers + LM head) and attention (QK^T and PV)."""
    from tritonllm.layers.linear import Linear

    # Every GEMM weight of the layers, counted from the layers' shapes (packed layers keep no plain weight).
    linear = sum(m.in_features * m.out_features for m in model.layers.modules() if isinstance(m, (nn.Linear, Linear)))
    cfg = model.config
    head = cfg.vocab_size * cfg.hidden_size
    head_dim = getattr(model, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    attention = sum(4 * cfg.num_attention_heads * head_dim * ctx for ctx in context_lens) * cfg.num_hidden_layers
    return {"weight_params": linear + head, "weights": 2 * batch * (linear + head), "attention": attention}


def decode_step(model_dir: Path, threads: int, prompt_ids: list[list[int]], batch: int = 64,
                warm_steps: int = 4, steps: int = 16) -> dict:
    """Time `steps` decode steps of the offline Engine with `batch` sequences all decoding."""
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    prompts = [prompt_ids[i % len(prompt_ids)] for i in range(batch)]
    budget = 512
    # Sequences prefilled early decode while the others prefill: leave room for all those
    # tokens, so that none finishes (or is preempted for want of blocks) before the timed steps.
    prefill_steps = -(-sum(map(len, prompts)) // (budget - batch)) + batch
    max_tokens = prefill_steps + warm_steps + steps + 8
    block = 16
    blocks = sum(-(-(len(p) + max_tokens) // block) for p in prompts) + 64
    # No speculative drafts: the step timed is one of `batch` rows (a sequence whose text repeats itself
    # would otherwise earn drafts, and its extra rows would count as the same batch).
    engine = Engine(EngineConfig.from_parameters(model=str(model_dir), device="cpu", dtype="float32", num_threads=threads,
                                 max_num_seqs=batch, max_num_batched_tokens=budget, block_size=block,
                                 num_kv_blocks=blocks, speculative_tokens=0))
    pool_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    context = {rid: len(p) for rid, p in zip(ids, prompts)}
    started = set()

    def step() -> int:
        n = 0
        for out in engine.step():
            context[out.request_id] += len(out.new_token_ids)
            started.add(out.request_id)
            n += 1
        return n

    # Prefill everything (bounded: each step makes progress on at least one prompt chunk).
    prefill_started = time.perf_counter()
    for _ in range(prefill_steps):
        if len(started) == batch:
            break
        step()
    prefill_s = time.perf_counter() - prefill_started
    for _ in range(warm_steps):
        step()

    timed = {"execute": 0.0}
    execute = engine.runner.execute

    def timed_execute(inputs):  # wraps this engine instance only
        t = time.perf_counter()
        try:
            return execute(inputs)
        finally:
            timed["execute"] += time.perf_counter() - t

    engine.runner.execute = timed_execute
    step_times, exec_times, batches, contexts = [], [], [], []
    for _ in range(steps):
        contexts.append(statistics.fmean(context.values()))
        timed["execute"] = 0.0
        t = time.perf_counter()
        batches.append(step())
        step_times.append(time.perf_counter() - t)
        exec_times.append(timed["execute"])
    engine.runner.execute = execute
    flops = decode_flops(engine.runner.model, batch, list(context.values()))
    for rid in ids:
        engine.abort(rid)
    result = {
        "batch": batch,
        "steps": steps,
        "all_steps_full": all(b == batch for b in batches),
        "mean_context": statistics.fmean(contexts),
        "step_s_median": statistics.median(step_times),
        "step_s_mean": statistics.fmean(step_times),
        "step_s_min": min(step_times),
        "execute_s_median": statistics.median(exec_times),
        "host_fraction": statistics.median((s - e) / s for s, e in zip(step_times, exec_times)),
        "prefill_s": prefill_s,
        "flops": flops,
        "kv_pool_bytes_per_token_slot": pool_bytes / (engine.runner.num_blocks * block),
        "engine_kv_bytes_per_token": engine.runner.kv_plan.kv_bytes_per_token,
    }
    del engine
    return result


def read_bandwidth(threads: int, megabytes: int = 1024, repeats: int = 5) -> dict:
    """The machine's memory read rate as the engine's threads see it: GB/s of a sum over a float32 buffer
    far larger than the caches (best and median of `repeats`)."""
    torch.set_num_threads(threads)
    buf = torch.ones(megabytes * (1 << 20) // 4)
    buf.sum()
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        rates.append(buf.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return {"threads": threads, "megabytes": megabytes, "gbps_best": max(rates), "gbps_median": statistics.median(rates)}


def one_row_bytes(engine) -> dict:
    """The bytes one decode row reads from each weight, as the engine's kernels read them: a CPU weight kept
    as exact quantized blocks is read in those blocks at one row, else in its packed or plain form."""
    from tritonllm.layers.linear import Linear

    weights, seen = 0, set()
    for module in engine.runner.model.modules():
        if not isinstance(module, Linear):
            continue
        packed = module.packed
        if packed is not None and getattr(packed, "reads_blocks", None) and packed.reads_blocks(1):
            tensors = list(packed.blocks)
        elif packed is not None and getattr(packed, "data", None) is not None:
            tensors = [packed.data]
        else:
            tensors = [module.weight] if module.weight is not None else []
        for t in tensors:
            if t.data_ptr() not in seen:  # a form two modules share (a fused or tied weight) is read once
                weights += t.numel() * t.element_size()
                seen.add(t.data_ptr())
    return {"weights": weights, "kv_per_context_token": engine.runner.kv_plan.kv_bytes_per_token}


def one_stream(model_dir: Path, threads: int, prompt_ids: list[int], tokens: int = 256) -> dict:
    """One sequence alone, as a single user's request: the offline Engine's time per output token (median of
    its decode steps, speculation as served), beside the bytes a token reads (weights once, plus the KV of
    the context so far) and the memory read rate measured here: the token's lower bound in time, unless
    accepted drafts (`tokens_per_step` above 1) share a step's reads between tokens."""
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    engine = Engine(EngineConfig.from_parameters(model=str(model_dir), device="cpu", dtype="float32",
                                                 num_threads=threads, max_num_seqs=4))
    params = {"max_tokens": tokens, "ignore_eos": True, "temperature": 0.0}
    engine.generate(prompt_token_ids=[prompt_ids], params={**params, "max_tokens": 8})  # warm
    rid = engine.add_request(prompt_token_ids=prompt_ids, params=params)
    times, made, steps, last = [], 0, 0, time.perf_counter()
    while made < tokens:
        outs = engine.step()
        now = time.perf_counter()
        new = sum(len(o.new_token_ids) for o in outs if o.request_id == rid)
        if made and new:  # decode steps only (the first is the prompt's)
            times.append((now - last) / new)
            steps += 1
        made += new
        last = now
        if any(o.finished for o in outs if o.request_id == rid):
            break
    sizes = one_row_bytes(engine)
    mean_context = len(prompt_ids) + made / 2
    per_token = sizes["weights"] + sizes["kv_per_context_token"] * mean_context
    bandwidth = read_bandwidth(threads)
    del engine
    ms = 1e3 * statistics.median(times)
    bound_ms = 1e3 * per_token / (bandwidth["gbps_best"] * 1e9)
    return {"tokens": made, "tokens_per_step": (made - 1) / max(steps, 1), "ms_per_token_median": ms, "ms_per_token_best": 1e3 * min(times),
            "bytes_per_token": per_token, "weight_bytes": sizes["weights"], "mean_context": mean_context,
            "read_bandwidth": bandwidth, "bandwidth_bound_ms": bound_ms, "pct_of_bandwidth": 100 * bound_ms / ms}


def utilisation(step: dict, gemm: dict) -> dict:
    """Achieved GFLOPS of the decode step and its share of the GEMM rates measured in the same run."""
    seconds = step["step_s_median"]
    weights = step["flops"]["weights"] / seconds / 1e9
    total = (step["flops"]["weights"] + step["flops"]["attention"]) / seconds / 1e9
    best = step["flops"]["weights"] / step["step_s_min"] / 1e9  # best step against best GEMM: both capabilities
    peak = gemm["mm_2048"]["gflops_best"]
    shaped = gemm["decode_linear"]["gflops_best"]
    return {"gflops_weights": weights, "gflops_with_attention": total, "gflops_weights_best_step": best,
            "pct_of_mm_2048": 100 * weights / peak, "pct_of_decode_linear": 100 * weights / shaped,
            "pct_of_mm_2048_median": 100 * weights / gemm["mm_2048"]["gflops_median"],
            "pct_of_mm_2048_with_attention": 100 * total / peak, "pct_of_mm_2048_best_step": 100 * best / peak}
