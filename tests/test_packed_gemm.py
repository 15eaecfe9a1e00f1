"""Our AVX-512 GEMM (csrc/packed_gemm.cpp) against F.linear, and the engine on each `cpu_gemm`."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tritonllm import cpu_kernels
from tritonllm.layers.linear import PackedWeight, resolve_cpu_gemm

needs_compiler = pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")
avx512 = pytest.mark.skipif(not (cpu_kernels.load() and cpu_kernels.packed_gemm_supported()),
                            reason="kernels built without AVX-512 (this CPU lacks it)")


# Row counts around the 12-row microkernel and past a 168-row chunk (K=576); widths with a partial
# last panel (100, 5) and K not a multiple of anything (7).
@avx512
@pytest.mark.parametrize("rows,out_features,in_features", [
    (1, 960, 576), (3, 576, 1536), (12, 3072, 576), (13, 100, 576), (40, 5, 7), (200, 96, 576), (0, 64, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_gemm_equals_f_linear(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    packed = PackedWeight(weight, "avx512", batch_hint=64)
    torch.testing.assert_close(packed(x, bias), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


@avx512
def test_packed_gemm_keeps_leading_dims_and_reads_strided_input():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 48, generator=gen)
    x = torch.randn(2, 5, 96, generator=gen)[..., ::2]  # not contiguous
    got = PackedWeight(weight, "avx512", 64)(x, None)
    assert got.shape == (2, 5, 64)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-4, atol=1e-4)


@avx512
def test_a_rows_result_does_not_depend_on_its_batch():
    # The same per-row arithmetic at every row count: a request's logits do not change with who
    # else is in the step (greedy outputs stay reproducible under continuous batching).
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(320, 576, generator=gen), torch.randn(29, 576, generator=gen)
    packed = PackedWeight(weight, "avx512", 64)
    full = packed(x, None)
    for start, end in [(0, 1), (5, 9), (11, 29)]:
        assert torch.equal(packed(x[start:end], None), full[start:end])


@avx512
def test_packed_gemm_rejects_bad_input():
    packed = PackedWeight(torch.randn(64, 32), "avx512", 64)
    with pytest.raises(RuntimeError, match="in_features"):
        packed(torch.randn(3, 31), None)
    with pytest.raises(RuntimeError, match="float32 only"):
        packed(torch.randn(3, 32, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="bias"):
        packed(torch.randn(3, 32), torch.randn(63))


@needs_compiler
def test_cpu_gemm_falls_back_where_the_kernel_cannot_run():
    cpu = torch.device("cpu")
    expected = "avx512" if cpu_kernels.packed_gemm_supported() else "onednn"
    assert resolve_cpu_gemm("avx512", cpu, torch.float32) == expected
    assert resolve_cpu_gemm("avx512", cpu, torch.bfloat16) == "onednn"  # our kernel is float32 only
    assert resolve_cpu_gemm("onednn", cpu, torch.float32) == "onednn"
    assert resolve_cpu_gemm("aten", cpu, torch.float32) == "aten"
    assert resolve_cpu_gemm("avx512", torch.device("cuda"), torch.float32) == "aten"


@avx512
def test_engine_tokens_equal_on_every_cpu_gemm():
    from tritonllm.config import EngineConfig
    from tritonllm.engine import Engine

    prompts = ["The capital of France is", "Write a haiku about the sea.",
               "Once upon a time, in a small village by the mountains, there lived"]
    params = {"max_tokens": 24, "temperature": 0.0}
    outputs = {}
    for gemm in ("avx512", "onednn", "aten"):
        engine = Engine(EngineConfig(device="cpu", num_threads=2, cpu_gemm=gemm, num_kv_blocks=256, warmup=False))
        o_proj = engine.runner.model.layers[0].self_attn.o_proj
        assert (o_proj.packed.kernel if o_proj.packed is not None else "aten") == gemm
        outputs[gemm] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs["avx512"] == outputs["onednn"] == outputs["aten"]
