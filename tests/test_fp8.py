"""FP8 weights (`quantization=fp8`) and an FP8 KV cache (`kv_cache_dtype=fp8`), layers/fp8.py: the rounding,
the product's scales (torch._scaled_mm on the CPU here, and on a CUDA device where one is present), the
KV pool's writes and copies, and the engine's accuracy against itself without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tritonllm.core.parameters import ConfigError
from tritonllm.layers.fp8 import FP8, FP8_MAX, Fp8Weight, quantize_rows, to_fp8_saturated
from tritonllm.layers.kv_layout import HEAD_MAJOR, TOKEN_MAJOR, copy_slots, pool_shape, write_kv

pytestmark = pytest.mark.unit


def test_rounding_to_fp8_saturates_instead_of_making_nan():
    t = torch.tensor([1000.0, -1e6, 448.0, 0.0, 1e-12, float("inf")])
    out = to_fp8_saturated(t).float()
    assert out.tolist()[:5] == [FP8_MAX, -FP8_MAX, FP8_MAX, 0.0, 0.0]
    assert not out.isnan().any()


def test_rows_are_quantized_with_their_own_scale():
    torch.manual_seed(0)
    t = torch.randn(64, 300) * torch.logspace(-3, 3, 64)[:, None]  # rows six orders of magnitude apart
    t[5] = 0
    q, scale = quantize_rows(t)
    assert q.dtype == FP8 and scale.shape == (64, 1)
    assert torch.equal(q.float().abs().amax(dim=1)[torch.arange(64) != 5], torch.full((63,), FP8_MAX))
    assert scale[5].item() == 1.0 and torch.all(q[5].float() == 0)
    back = q.float() * scale
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, or a subnormal step of its row's scale.
    assert torch.all((back - t).abs() <= t.abs() / 16 + scale * 2.0 ** -9)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_scaled_product_matches_the_widened_operands(rows):
    """`torch._scaled_mm` with our per-row scales (the CUDA form) computes what the widened FP8 values
    multiplied in float32 give: checks which scale goes with which operand, on the CPU's implementation."""
    torch.manual_seed(1)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    w = Fp8Weight(weight)
    assert not w.fused and w.wide.dtype == torch.float32  # on a CPU: the widened form
    x = torch.randn(rows, 64) * 3
    xq, xs = quantize_rows(x)
    expected = F.linear(xq.float() * xs, w.q.float() * w.scale_t.t(), bias)
    torch.testing.assert_close(w(x, bias), expected, rtol=1e-5, atol=1e-5)
    # and the weight it stands for, within FP8's rounding
    assert (w(x, None) - x @ weight.t()).abs().mean() < 0.1 * (x @ weight.t()).abs().mean()
    try:
        fused = w._fused(x, bias)  # the CUDA path's call, on torch's CPU implementation (bfloat16 result)
    except RuntimeError as exc:
        if "per-tensor scaling" not in str(exc):
            raise
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only "
                    "(test_the_fused_fp8_product_on_cuda checks the call on a GPU)")
    torch.testing.assert_close(fused, expected, rtol=2e-2, atol=2e-2)


def test_an_fp8_weight_takes_batched_and_empty_inputs():
    w = Fp8Weight(torch.randn(32, 16))
    assert w(torch.randn(2, 3, 16), None).shape == (2, 3, 32)
    assert w(torch.randn(0, 16), None).shape == (0, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_the_fused_fp8_product_on_cuda():
    """On a GPU with FP8 tensor cores (sm89+) the layer takes torch._scaled_mm; elsewhere the widened form."""
    torch.manual_seed(2)
    weight = torch.randn(1536, 576, device="cuda", dtype=torch.bfloat16)
    w = Fp8Weight(weight)
    assert w.fused == (torch.cuda.get_device_capability() >= (8, 9))
    x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_rows(x)
    expected = F.linear(xq.float() * xs, w.q.float() * w.scale_t.t())
    torch.testing.assert_close(w(x, None).float(), expected, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("layout", [HEAD_MAJOR, TOKEN_MAJOR])
def test_an_fp8_pool_stores_rounded_k_v_and_copies_them(layout):
    torch.manual_seed(3)
    k_cache = torch.zeros(pool_shape(layout, 8, 4, 2, 16), dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(5, 2, 16) * 100, torch.randn(5, 2, 16)
    k[0, 0, 0] = 1e4  # past e4m3's range: saturates
    slots = torch.tensor([3, 17, 0, 30, 9])
    write_kv(k_cache, v_cache, k, v, slots, layout)

    def read(cache, slot):
        return cache[:, slot // 4, slot % 4] if layout == HEAD_MAJOR else cache[slot // 4, slot % 4]

    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(read(k_cache, slot).float(), to_fp8_saturated(k[i]).float())
        assert torch.equal(read(v_cache, slot).float(), to_fp8_saturated(v[i]).float())
    assert read(k_cache, 3)[0, 0].item() == FP8_MAX
    copy_slots(k_cache, torch.tensor([3, 17]), torch.tensor([20, 21]), layout)
    assert torch.equal(read(k_cache, 20).float(), read(k_cache, 3).float())
    assert torch.equal(read(k_cache, 21).float(), read(k_cache, 17).float())


def test_unknown_formats_are_refused_by_name():
    from tritonllm.core.config import EngineConfig

    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig.from_parameters(quantization="int3")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig.from_parameters(kv_cache_dtype="fp4")


PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "Once upon a time, in a small village by the mountains, there lived", "def fibonacci(n):"]
TOKENS = 24


def _engine(**params):
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    return Engine(EngineConfig.from_parameters(device="cpu", num_threads=2, kv_cache_max_bytes=256 << 20,
                                               enable_prefix_caching="false", warmup=False, **params))


def _teacher_forced(engine, tokenizer, outputs):
    """Per prompt, `engine`'s (log-prob, rank) of each of `outputs`' tokens after the prompt and those before it."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    scored = engine.generate(prompt_token_ids=[p + o for p, o in zip(prompts, outputs)],
                             params={"max_tokens": 1, "prompt_logprobs": 1})
    return [[(e[0][1], e[0][2]) for e in s.prompt_logprobs[len(p):]] for p, s in zip(prompts, scored)]


@pytest.fixture(scope="module")
def base_run(tokenizer):
    engine = _engine()
    outputs = [o.token_ids for o in engine.generate(PROMPTS, {"max_tokens": TOKENS, "min_tokens": TOKENS,
                                                             "ignore_eos": True})]
    scores = _teacher_forced(engine, tokenizer, outputs)
    return outputs, scores, engine.runner.kv_plan.num_blocks


# The bounds sit about twice above what FP8 costs this model (docs/PERFORMANCE.md, "FP8 accuracy"), leaving room
# for other prompts, and far below what a wrong scale, slot or cast costs (whole nats).
@pytest.mark.engine
@pytest.mark.parametrize("params,mean_bound,agree_bound", [
    ({"quantization": "fp8"}, 0.25, 0.8),
    ({"kv_cache_dtype": "fp8"}, 0.15, 0.85),
])
def test_fp8_engine_stays_within_its_accuracy_bound(params, mean_bound, agree_bound, base_run, tokenizer):
    outputs, base_scores, base_blocks = base_run
    engine = _engine(**params)
    plan = engine.runner.backend.describe()
    scores = _teacher_forced(engine, tokenizer, outputs)
    diffs = [abs(a[0] - b[0]) for s, bs in zip(scores, base_scores) for a, b in zip(s, bs)]
    agree = sum(rank == 1 for s in scores for _, rank in s) / len(diffs)
    assert len(diffs) == len(PROMPTS) * TOKENS
    assert max(diffs) > 1e-3, "the format changed nothing: is it applied?"
    assert sum(diffs) / len(diffs) <= mean_bound and agree >= agree_bound, (sum(diffs) / len(diffs), agree)
    if "quantization" in params:
        assert "linear=FP8 e4m3" in plan and "FP8 weights" in plan  # and the one-call stack stands aside
        assert engine.runner.model.lm_head.packed is None or engine.runner.model.lm_head.packed.kernel != "fp8"
    else:  # a byte a value: four times the float32 pool's blocks in the same bytes
        assert "an FP8 KV pool" in plan
        assert engine.runner.kv_plan.num_blocks >= 3.9 * base_blocks


@pytest.mark.engine
def test_fp8_rounds_a_mixture_of_experts_but_not_its_routers(tokenizer, tmp_path):
    import transformers

    from tiny_models import tiny_config_args, write_tiny_model
    from tritonllm.layers.linear import Linear

    config = transformers.Qwen2MoeConfig(**tiny_config_args(tokenizer), num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, shared_expert_intermediate_size=64)
    write_tiny_model(config, tokenizer, tmp_path)
    engine = _engine(model=str(tmp_path), quantization="fp8", max_model_len=256, max_num_seqs=4)
    linears = {name: m for name, m in engine.runner.model.layers.named_modules() if isinstance(m, Linear)}
    routers = [name for name in linears if name.endswith(("mlp.gate", "shared_expert_gate"))]
    # (the CPU's own packing of a router's plain weight is another matter: not FP8)
    assert routers and all(getattr(linears[name].packed, "kernel", "plain") != "fp8" for name in routers)
    assert all(m.packed.kernel == "fp8" for name, m in linears.items() if name not in routers)
    out = engine.generate(["The capital of France is"], {"max_tokens": 8, "min_tokens": 8, "ignore_eos": True})[0]
    assert len(out.token_ids) == 8
