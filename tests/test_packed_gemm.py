"""Our GEMM on packed panels (csrc/packed_gemm.cpp: AVX-512 or AVX2 + FMA builds) against F.linear, and the engine
on each `cpu_gemm`."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tritonllm.devices.cpu import kernels as cpu_kernels
from tritonllm.devices.cpu.packed_linear import PackedWeight, onednn_linear, onednn_linear_supported, resolve_cpu_gemm

pytestmark = pytest.mark.unit

needs_compiler = pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")
# Our panel GEMMs (cpu_gemm=avx512, the parameter's historical name) run on the AVX-512 and the AVX2 (+ FMA)
# builds of the kernels; the generic build (or TRITONLLM_CPU_ISA=generic) has neither and keeps oneDNN.
panel_gemm = pytest.mark.skipif(not (cpu_kernels.load() and cpu_kernels.packed_gemm_supported()),
                                reason="the kernels' build has neither AVX-512 nor AVX2 + FMA (generic variant, "
                                       "or TRITONLLM_CPU_ISA=generic): no panel GEMM")
# The bfloat16 GEMM runs wherever the panels do (AVX512-BF16's dot product, else FMAs on widened pairs).
bf16_gemm = pytest.mark.skipif(not (cpu_kernels.load() and cpu_kernels.packed_gemm_bf16_supported()),
                               reason="the kernels' build has no panel GEMM (generic variant): no bfloat16 GEMM")


def bf16_rounded(t: torch.Tensor) -> torch.Tensor:
    """What `avx512_bf16` multiplies: the float32 value rounded to bfloat16 (nearest even)."""
    return t.bfloat16().float()


# Row counts around the 12-row microkernel, split into blocks of 10-11 (64) and past a 168-row chunk (K=576); widths with a partial
# last panel (100, 5) and K not a multiple of anything (7).
GEMM_SHAPES = [
    (1, 960, 576), (3, 576, 1536), (12, 3072, 576), (13, 100, 576), (40, 5, 7), (64, 96, 576), (200, 96, 576), (0, 64, 64)]


@panel_gemm
@pytest.mark.parametrize("rows,out_features,in_features", GEMM_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_gemm_equals_f_linear(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    packed = PackedWeight(weight, "avx512", batch_hint=64)
    torch.testing.assert_close(packed(x, bias), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


@panel_gemm
def test_packed_gemm_keeps_leading_dims_and_reads_strided_input():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 48, generator=gen)
    x = torch.randn(2, 5, 96, generator=gen)[..., ::2]  # not contiguous
    got = PackedWeight(weight, "avx512", 64)(x, None)
    assert got.shape == (2, 5, 64)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-4, atol=1e-4)


@panel_gemm
def test_a_rows_result_does_not_depend_on_its_batch():
    # The same per-row arithmetic at every row count: a request's logits do not change with who
    # else is in the step (greedy outputs stay reproducible under continuous batching).
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(320, 576, generator=gen), torch.randn(29, 576, generator=gen)
    packed = PackedWeight(weight, "avx512", 64)
    full = packed(x, None)
    for start, end in [(0, 1), (5, 9), (11, 29)]:
        assert torch.equal(packed(x[start:end], None), full[start:end])


@pytest.mark.parametrize("kernel", [pytest.param("avx512", marks=panel_gemm),
                                    pytest.param("avx512_bf16", marks=bf16_gemm)])
def test_the_result_does_not_depend_on_the_thread_count(kernel):
    # The threads claim runs of panels as they go (csrc/claimed_chunks.h): whichever thread computes
    # a panel, every column is computed once and in the same order. 200 rows at K=576 make two row
    # chunks; 3072 columns make 96 panels, more than one run per claim.
    gen = torch.Generator().manual_seed(3)
    weight, x, bias = torch.randn(3072, 576, generator=gen), torch.randn(200, 576, generator=gen), torch.randn(3072)
    packed = PackedWeight(weight, kernel, 64)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(packed(x, bias))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("kernel", [pytest.param("avx512", marks=panel_gemm),
                                    pytest.param("avx512_bf16", marks=bf16_gemm)])
def test_packed_gemm_rejects_bad_input(kernel):
    packed = PackedWeight(torch.randn(64, 32), kernel, 64)
    with pytest.raises(RuntimeError, match="in_features"):
        packed(torch.randn(3, 31), None)
    with pytest.raises(RuntimeError, match="float32 only"):
        packed(torch.randn(3, 32, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="bias"):
        packed(torch.randn(3, 32), torch.randn(63))


# The bfloat16-weight kernel multiplies exactly the bfloat16-rounded x and W and sums in float32:
# against a float64 product of the rounded operands only the summation order differs.
@bf16_gemm
@pytest.mark.parametrize("rows,out_features,in_features", GEMM_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_equals_the_product_of_bf16_rounded_operands(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 5 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    got = PackedWeight(weight, "avx512_bf16", batch_hint=64)(x, bias)
    expected = F.linear(bf16_rounded(x).double(), bf16_rounded(weight).double(), None if bias is None else bias.double())
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-4)
    if rows:  # and it is not the float32 product: the rounding is real
        assert not torch.allclose(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


@bf16_gemm
def test_bf16_gemm_rows_do_not_depend_on_their_batch_and_leading_dims_are_kept():
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(320, 576, generator=gen), torch.randn(29, 576, generator=gen)
    packed = PackedWeight(weight, "avx512_bf16", 64)
    full = packed(x, None)
    for start, end in [(0, 1), (5, 9), (11, 29)]:
        assert torch.equal(packed(x[start:end], None), full[start:end])
    strided = torch.randn(2, 5, 1152, generator=gen)[..., ::2]
    assert torch.equal(packed(strided, None), packed(strided.reshape(10, 576).contiguous(), None).view(2, 5, 320))


@bf16_gemm
def test_bf16_gemm_rejects_a_float32_packed_weight():
    with pytest.raises(RuntimeError, match="pack_gemm_weight_bf16"):
        cpu_kernels.packed_gemm_bf16(torch.randn(3, 32), cpu_kernels.pack_gemm_weight(torch.randn(64, 32)), None, 64, 32)


@needs_compiler
def test_cpu_gemm_falls_back_where_the_kernel_cannot_run():
    cpu = torch.device("cpu")
    expected = "avx512" if cpu_kernels.packed_gemm_supported() else "onednn"
    assert resolve_cpu_gemm("avx512", cpu, torch.float32) == expected
    assert resolve_cpu_gemm("avx512", cpu, torch.bfloat16) == "onednn"  # our kernel is float32 only
    assert resolve_cpu_gemm("onednn", cpu, torch.float32) == "onednn"
    assert resolve_cpu_gemm("aten", cpu, torch.float32) == "aten"
    assert resolve_cpu_gemm("avx512", torch.device("cuda"), torch.float32) == "aten"
    expected_bf16 = "avx512_bf16" if cpu_kernels.packed_gemm_bf16_supported() else expected
    assert resolve_cpu_gemm("avx512_bf16", cpu, torch.float32) == expected_bf16
    assert resolve_cpu_gemm("avx512_bf16", cpu, torch.bfloat16) == "onednn"  # a float32 model only
    assert resolve_cpu_gemm("avx512_bf16", torch.device("cuda"), torch.float32) == "aten"


onednn_linear_available = pytest.mark.skipif(not onednn_linear_supported(), reason="torch built without mkldnn")


@onednn_linear_available
@pytest.mark.parametrize("shape", [(1, 576), (64, 576), (3, 5, 96), (0, 64)])
def test_onednn_linear_on_the_plain_weight_matches_f_linear(shape):
    """cpu_gemm=aten's other library: torch's oneDNN linear on the [out, in] weight as it is."""
    torch.manual_seed(0)
    x = torch.randn(*shape)
    weight, bias = torch.randn(300, shape[-1]), torch.randn(300)
    for b in (None, bias):
        torch.testing.assert_close(onednn_linear(x, weight, b), F.linear(x, weight, b), rtol=1e-4, atol=1e-4)
    strided = torch.randn(shape[0], 2 * shape[-1])[:, ::2] if len(shape) == 2 else x
    torch.testing.assert_close(onednn_linear(strided, weight, None), F.linear(strided, weight), rtol=1e-4, atol=1e-4)


@onednn_linear_available
def test_aten_library_is_timed_for_cpu_gemm_aten_only():
    from tritonllm.devices.cpu.ops import CpuOps

    weights = [torch.randn(1536, 576), torch.randn(576, 1536), torch.randn(1536, 576)]  # a shape twice: timed once
    aten = CpuOps(False, "aten", 64, False)
    assert aten.choose_aten_library(weights, 64) in ("blas", "onednn")
    assert ("oneDNN" in aten.plan()["linear"]) == (aten.aten_library == "onednn")
    bf16 = [w.bfloat16() for w in weights]
    assert CpuOps(False, "aten", 64, False).choose_aten_library(bf16, 64) == "blas"  # bf16: torch's own choice
    assert CpuOps(False, "onednn", 64, False).choose_aten_library(weights, 64) == "blas"  # packed: not aten


@pytest.mark.engine
@onednn_linear_available
def test_engine_on_cpu_gemm_aten_takes_either_library_with_the_same_tokens():
    """The library cpu_gemm=aten times at load changes the last bits of a sum, not the greedy tokens."""
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    engine = Engine(EngineConfig.from_parameters(device="cpu", num_threads=2, cpu_gemm="aten", cpu_kernels="false",
                                                 num_kv_blocks=256, enable_prefix_caching="false", warmup=False))
    ops = engine.runner.backend.ops
    prompts = ["The capital of France is", "Once upon a time, in a small village by the mountains, there lived"]
    params = {"max_tokens": 24, "temperature": 0.0}
    outputs = {}
    for library in ("blas", "onednn"):
        ops.aten_library = library
        outputs[library] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs["blas"] == outputs["onednn"]


@pytest.mark.engine
@panel_gemm
def test_engine_tokens_equal_on_every_cpu_gemm():
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    prompts = ["The capital of France is", "Write a haiku about the sea.",
               "Once upon a time, in a small village by the mountains, there lived"]
    params = {"max_tokens": 24, "temperature": 0.0}
    outputs = {}
    for gemm in ("avx512", "onednn", "aten"):
        engine = Engine(EngineConfig.from_parameters(device="cpu", num_threads=2, cpu_gemm=gemm, num_kv_blocks=256, warmup=False))
        o_proj = engine.runner.model.layers[0].self_attn.o_proj
        assert (o_proj.packed.kernel if o_proj.packed is not None else "aten") == gemm
        outputs[gemm] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs["avx512"] == outputs["onednn"] == outputs["aten"]


def teacher_forced(engine, prompt_ids: list[int], output_ids: list[int]) -> list[list[tuple[int, float, int]]]:
    """Per output token, `engine`'s scores of it after the prompt and the output before it: (token,
    log-prob, rank) for the token itself, then for the most likely token there."""
    full = prompt_ids + output_ids
    scored = engine.generate(prompt_token_ids=[full], params={"max_tokens": 1, "prompt_logprobs": 1})[0]
    return scored.prompt_logprobs[len(prompt_ids):]


def assert_greedy_up_to_noise(engine, prompt_ids, output_ids, logprobs=None, tol=0.1, mean_tol=0.02):
    """Each output token is `engine`'s greedy choice after the same tokens, up to `tol` in log-prob, and its
    log-prob (where given) is `engine`'s within `tol`, `mean_tol` on average. Rounding activations to
    bfloat16 turns a last-bit difference of two summation orders into a bfloat16 step now and then, and
    those steps add up over 30 layers: these bounds are far above that and far below what a GEMM that
    multiplied the wrong values would give."""
    diffs = []
    for i, entries in enumerate(teacher_forced(engine, prompt_ids, output_ids)):
        (token, lp, rank), best = entries[0], max(entries, key=lambda e: e[1])
        assert token == output_ids[i]
        assert rank == 1 or best[1] - lp <= tol, (i, entries)
        if logprobs is not None:
            diffs.append(abs(logprobs[i] - lp))
    if diffs:
        assert max(diffs) <= tol and sum(diffs) / len(diffs) <= mean_tol, diffs


@pytest.mark.engine
@bf16_gemm
def test_engine_with_bf16_gemm_is_float32_with_bf16_rounded_gemm_operands():
    """`cpu_gemm=avx512_bf16`: every GEMM of the engine (layers and LM head) takes the bfloat16 kernel,
    whose arithmetic is pinned above (test_bf16_gemm_equals_the_product_of_bf16_rounded_operands); all
    else stays float32.

    The reference is the plain-torch engine with its linear weights rounded and a hook rounding their
    inputs, its tied LM head a rounded copy (the embedding lookup keeps float32). Each token the bf16
    engine chose is the reference's greedy choice after the same tokens, with its log-prob, up to the
    noise of other summation orders. Requests without log-probs take the greedy screen, whose ids are a
    float32 head's on the same hidden states."""
    from torch import nn

    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    prompts = ["The capital of France is", "Write a haiku about the sea.",
               "Once upon a time, in a small village by the mountains, there lived"]
    params = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    engine = Engine(EngineConfig.from_parameters(device="cpu", num_threads=2, cpu_gemm="avx512_bf16", num_kv_blocks=256,
                                                 warmup=False))
    model = engine.runner.model
    from tritonllm.layers.linear import Linear

    layers = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert len(layers) == 4 * model.num_layers and all(m.packed.kernel == "avx512_bf16" for m in layers)
    assert model.lm_head.packed.data is engine.runner.backend.head.screen.packed  # one bfloat16 copy of the head
    prompt_ids = [engine.tokenizer.encode(p) for p in prompts]
    got = engine.generate(prompt_token_ids=prompt_ids, params=params)
    got_ids_only = engine.generate(prompt_token_ids=prompt_ids, params={**params, "logprobs": False})
    del engine, model

    reference = Engine(EngineConfig.from_parameters(device="cpu", num_threads=2, cpu_gemm="aten", num_kv_blocks=256,
                                                    warmup=False))
    model = reference.runner.model
    for module in model.layers.modules():
        if isinstance(module, Linear):
            module.weight.data = bf16_rounded(module.weight.data)
            module.register_forward_pre_hook(lambda module, args: (bf16_rounded(args[0]),))
    float32_head = model.lm_head
    rounded_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    rounded_head.weight.data = bf16_rounded(model.embed_tokens.weight.data)
    rounded_head.register_forward_pre_hook(lambda module, args: (bf16_rounded(args[0]),))
    model.lm_head = rounded_head
    for ids, out in zip(prompt_ids, got):
        assert_greedy_up_to_noise(reference, ids, out.token_ids, out.logprobs)
    model.lm_head = float32_head  # the float32 head the screen's ids are exact for
    for ids, out in zip(prompt_ids, got_ids_only):
        assert_greedy_up_to_noise(reference, ids, out.token_ids)
