"""Exactly-4-bit float32 weights (layers/exact_q4.py) and the GEMM on their 4-bit blocks
(csrc/packed_gemm.cpp `packed_gemm_q4`): found only where exact, and the same results bit for bit."""

from __future__ import annotations

import pytest
import torch

from tritonllm import cpu_kernels
from tritonllm.layers.exact_q4 import find_q4_blocks
from tritonllm.layers.linear import Q4_MAX_ROWS, PackedWeight

avx512 = pytest.mark.skipif(not (cpu_kernels.load() and cpu_kernels.packed_gemm_supported()),
                            reason="kernels built without AVX-512 (this CPU lacks it)")


def q4_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A weight made as a GGUF Q4_1 file dequantises: float16 d and m per block of 32, q in 0..15,
    fl(fl(d * q) + m) in float32; a few blocks of one repeated value, as real weights have."""
    gen = torch.Generator().manual_seed(seed)
    blocks = in_features // 32
    d = (torch.rand(out_features, blocks, 1, generator=gen) * 0.01).half().float()
    m = (-torch.rand(out_features, blocks, 1, generator=gen) * 0.08).half().float()
    q = torch.randint(0, 16, (out_features, blocks, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # each block spans its whole range, as the quantiser makes it
    d[0, 0] = 0  # a block of equal values
    return (d * q + m).view(out_features, in_features)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_the_blocks_are_found_and_give_back_every_value_bit_for_bit():
    weight = q4_weight(96, 128, seed=1)
    q, d, m = find_q4_blocks(weight)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and d.shape == m.shape == (96, 4)
    rebuilt = d[..., None] * q.view(96, 4, 32).float() + m[..., None]
    assert torch.equal(bits(rebuilt.view(96, 128)), bits(weight))


@pytest.mark.parametrize("case", ["random", "one ulp off", "k not a multiple of 32", "nan", "bfloat16"])
def test_weights_that_are_not_exactly_4_bit_are_left_alone(case):
    weight = q4_weight(96, 128, seed=2)
    if case == "random":
        weight = torch.randn(96, 128)
    elif case == "one ulp off":  # past the 64-row sample, so the full check has to catch it
        weight[80, 33] = torch.nextafter(weight[80, 33], torch.tensor(1.0))
    elif case == "k not a multiple of 32":
        weight = weight[:, :100]
    elif case == "nan":
        weight[3, 3] = float("nan")
    else:
        weight = weight.bfloat16()
    assert find_q4_blocks(weight) is None


@avx512
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 10, 12, 13, 30])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (50, 64), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_4_bit_gemm_equals_the_float32_gemm_bit_for_bit(rows, out_features, in_features, with_bias):
    weight = q4_weight(out_features, in_features, seed=rows + out_features)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    nibbles, dm = cpu_kernels.pack_gemm_weight_q4(*find_q4_blocks(weight))
    want = cpu_kernels.packed_gemm(x, cpu_kernels.pack_gemm_weight(weight), bias, out_features)
    got = cpu_kernels.packed_gemm_q4(x, nibbles, dm, bias, out_features)
    assert torch.equal(bits(got), bits(want))


@avx512
def test_a_packed_weight_takes_the_4_bit_blocks_only_for_few_rows():
    weight = q4_weight(64, 64, seed=3)
    packed = PackedWeight(weight, "avx512", 64, exact_q4=True)
    assert packed.q4 is not None
    assert PackedWeight(weight, "avx512", 64).q4 is None  # off unless asked
    assert PackedWeight(torch.randn(64, 64), "avx512", 64, exact_q4=True).q4 is None
    for rows in (1, Q4_MAX_ROWS, Q4_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 64)
        assert torch.equal(bits(packed(x, None)), bits(cpu_kernels.packed_gemm(x, packed.data, None, 64)))


@avx512
def test_every_linear_of_the_default_model_is_exactly_4_bit(model_dir):
    """The packaged GGUF is Q4_1 in every decoder linear: all of them get the 4-bit blocks, and on
    the real weights the 4-bit GEMM gives the float32 GEMM's results bit for bit."""
    from tritonllm.layers.linear import Linear
    from tritonllm.loader import load_model

    model = load_model(model_dir, torch.float32, torch.device("cpu"), 256, cpu_gemm="avx512", exact_q4=True)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.num_layers and all(m.packed.q4 is not None for m in linears)
    gen = torch.Generator().manual_seed(0)
    for linear in linears[:8]:
        p = linear.packed
        x = torch.randn(Q4_MAX_ROWS, p.in_features, generator=gen)
        want = cpu_kernels.packed_gemm(x, p.data, linear.bias, p.out_features)
        assert torch.equal(bits(cpu_kernels.packed_gemm_q4(x, *p.q4, linear.bias, p.out_features)), bits(want))
