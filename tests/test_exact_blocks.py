"""Float32 weights that are exactly quantized blocks (devices/cpu/exact_blocks.py) and the GEMM on those
blocks (csrc/exact_block_gemm.cpp): found only where exact, and the same results bit for bit."""

from __future__ import annotations

import pytest
import torch

from tritonllm.devices.cpu import kernels as cpu_kernels
from tritonllm.devices.cpu.exact_blocks import find_blocks
from tritonllm.devices.cpu.packed_linear import BLOCKS_MAX_ROWS, PackedWeight

pytestmark = pytest.mark.unit

# Our panel GEMMs (cpu_gemm=avx512, the parameter's historical name) run on the AVX-512 and the AVX2 (+ FMA)
# builds of the kernels; the generic build (or TRITONLLM_CPU_ISA=generic) has neither and keeps oneDNN.
panel_gemm = pytest.mark.skipif(not (cpu_kernels.load() and cpu_kernels.packed_gemm_supported()),
                                reason="the kernels' build has neither AVX-512 nor AVX2 + FMA (generic variant, "
                                       "or TRITONLLM_CPU_ISA=generic): no panel GEMM")


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


def q8_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A weight made as a GGUF Q8_0 file dequantises: float16 d per block of 32, q in -128..127,
    fl(d * q) in float32; one block of zeros."""
    gen = torch.Generator().manual_seed(seed)
    blocks = in_features // 32
    d = (torch.rand(out_features, blocks, 1, generator=gen) * 0.001).half().float()
    q = torch.randint(-127, 128, (out_features, blocks, 32), generator=gen).float()
    q[..., 0] = 127  # each block reaches its scale, as the quantiser makes it
    q[0, 0] = 0
    return (d * q).view(out_features, in_features)


def bf16_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A bfloat16 checkpoint's weight loaded as float32 (a -0.0 among its values)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16().float()
    weight[0, 0] = -0.0
    return weight


MAKERS = {"q4_1": q4_weight, "q8_0": q8_weight, "bf16": bf16_weight}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_4_bit_blocks_are_found_and_give_back_every_value_bit_for_bit():
    weight = q4_weight(96, 128, seed=1)
    q, d, m = find_blocks(weight)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and d.shape == m.shape == (96, 4)
    rebuilt = d[..., None] * q.view(96, 4, 32).float() + m[..., None]
    assert torch.equal(bits(rebuilt.view(96, 128)), bits(weight))


def q4_weight_with_inexact_products(out_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight [out, 32], d, q): one Q4_1 block per row, fl(fl(d * q) + m) with float32 d (not float16)
    chosen so that span / 15 gives d back and rebuilds every value, yet some fl(d * q) is rounded."""
    gen = torch.Generator().manual_seed(seed)
    rows_w, rows_d, rows_q = [], [], []
    while len(rows_w) < out_features:
        d = torch.rand(1, 1, generator=gen) * 0.01
        m = (-torch.rand(1, 1, generator=gen) * 0.08).half().float()
        q = torch.randint(0, 16, (1, 32), generator=gen).float()
        q[0, 0], q[0, 1] = 0, 15
        w = d * q + m
        quotient = (w.amax() - w.amin()) / 15
        rebuilds = torch.equal(bits(quotient * q + m), bits(w))
        inexact = not torch.equal((d * q).double(), d.double() * q.double())
        if rebuilds and inexact and bool(quotient == d):
            rows_w.append(w), rows_d.append(d), rows_q.append(q)
    return torch.cat(rows_w), torch.cat(rows_d), torch.cat(rows_q).to(torch.uint8)


def test_4_bit_blocks_whose_products_round_are_left_alone():
    """The block GEMM decodes 4-bit blocks in one FMA, round(d * q + m), equal to the two roundings
    the weight was made with only where d * q is exact (always, for GGUF's float16 scales). A weight
    whose float32 scales rebuild it with two roundings but not with one stays float32."""
    weight, d, q = q4_weight_with_inexact_products(8, seed=6)
    assert find_blocks(weight) is None


@panel_gemm
def test_the_4_bit_packing_refuses_scales_whose_products_round():
    weight, d, q = q4_weight_with_inexact_products(8, seed=6)
    m = weight.amin(-1, keepdim=True)
    with pytest.raises(RuntimeError, match="d \\* q exact"):
        cpu_kernels.pack_block_weight(q, d, m)
    exact_d = d.half().float()  # float16 scales: every product exact, so the same codes pack
    cpu_kernels.pack_block_weight(q, exact_d, m)


def test_8_bit_blocks_are_found_and_give_back_every_value_bit_for_bit():
    weight = q8_weight(96, 128, seed=1)
    q, d, m = find_blocks(weight)
    assert q.dtype == torch.int8 and m is None and d.shape == (96, 4)
    rebuilt = d[..., None] * q.view(96, 4, 32).float()
    assert torch.equal(bits(rebuilt.view(96, 128)), bits(weight))


def test_bfloat16_values_are_found_as_themselves():
    weight = bf16_weight(96, 128, seed=1)
    q, d, m = find_blocks(weight)
    assert q.dtype == torch.bfloat16 and d is None and m is None
    assert torch.equal(bits(q.float()), bits(weight))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_signed_zeros_come_back_with_their_sign(kind):
    """A block of zeros may hold -0.0 (a zero scale times a negative code); a GEMM over a zero column
    gives -0.0 or +0.0 by it, so the blocks must keep it."""
    weight = MAKERS[kind](64, 64, seed=5)
    weight[:, :32] = 0.0
    weight[3, :32] = -0.0
    if kind == "q8_0":
        weight[5, 7] = -0.0  # Q8_0 mixes them in a block (codes 0 and -1); Q4_1's zero blocks are all one sign
    found = find_blocks(weight)
    assert found is not None
    q, d, m = found
    rebuilt = d[..., None] * q.view(64, 2, 32).float()
    if m is not None:
        rebuilt = rebuilt + m[..., None]
    assert torch.equal(bits(rebuilt.view(64, 64)), bits(weight))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "bf16"])
@pytest.mark.parametrize("case", ["random", "one ulp off", "k not a multiple of 32", "nan", "bfloat16"])
def test_weights_that_are_not_exactly_blocks_are_left_alone(kind, case):
    weight = MAKERS[kind](96, 128, seed=2)
    if case == "random":
        weight = torch.randn(96, 128)
    elif case == "one ulp off":  # past the 64-row sample, so the full check has to catch it
        weight[80, 34] = torch.nextafter(weight[80, 34], torch.tensor(1.0))
    elif case == "k not a multiple of 32":
        weight = weight[:, :100]
    elif case == "nan":
        weight[3, 3] = float("nan")
    else:
        weight = weight.bfloat16()
    assert find_blocks(weight) is None


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "bf16"])
def test_a_weight_solved_in_runs_of_rows_gives_the_same_blocks_and_a_bad_last_run_rejects_it(kind, monkeypatch):
    from tritonllm.devices.cpu import exact_blocks

    weight = MAKERS[kind](200, 128, seed=4)
    whole = find_blocks(weight)
    monkeypatch.setattr(exact_blocks, "_CHUNK_BYTES", 30 * 128 * 4)  # runs of 30 rows: the last one short
    in_runs = find_blocks(weight)
    for a, b in zip(whole, in_runs):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    weight[195, 7] = torch.nextafter(weight[195, 7], torch.tensor(1.0))  # in the last run only
    assert find_blocks(weight) is None


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_value_past_the_sample_rows_is_not_taken_for_blocks(kind, value):
    """(bfloat16 keeps an infinity exactly, so its blocks may hold one: not a scaled-integer form.)"""
    weight = MAKERS[kind](96, 128, seed=3)
    weight[80, 40] = value
    assert find_blocks(weight) is None


def q4_weight_with_float32_scales(out_features: int, seed: int) -> torch.Tensor:
    """Q4_1 blocks whose d is a float32 quotient, not a float16 value, with every d * q still exact
    (d has 19 significant bits): found only by the last of the search's scale candidates."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    while len(rows) < out_features:
        d = (torch.randint(2 ** 18, 2 ** 19, (1, 1), generator=gen) * 2.0 ** -26).float()
        m = (-torch.rand(1, 1, generator=gen) * 0.08).half().float()
        q = torch.randint(0, 16, (1, 32), generator=gen).float()
        q[0, 0], q[0, 1] = 0, 15
        w = d * q + m
        if d.half().float() != d and torch.equal(bits((w.amax() - w.amin()) / 15 * q + m), bits(w)):
            rows.append(w)
    return torch.cat(rows)


def _same_blocks(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return all((x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                             and torch.equal(x.view(torch.uint8), y.view(torch.uint8)))
               for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "bf16", "q4_1 float32 scales", "q4_1 inexact products"])
@pytest.mark.parametrize("case", ["as made", "signed zeros", "one ulp off", "nan", "inf", "random"])
def test_the_kernels_search_finds_the_torch_searchs_blocks(kind, case):
    """find_blocks searches the 4- and 8-bit forms with the C++ kernel (csrc/find_exact_blocks.cpp) where
    the kernels load, and in torch ops with in_torch=True: the same blocks, or None, in every case."""
    if kind == "q4_1 float32 scales":
        weight = q4_weight_with_float32_scales(96, seed=7)
    elif kind == "q4_1 inexact products":
        weight = q4_weight_with_inexact_products(96, seed=8)[0]
    else:
        weight = MAKERS[kind](96, 128, seed=9)
    if case == "signed zeros":
        weight[:, :32] = 0.0
        weight[3, :32] = -0.0
        weight[5, 7] = -0.0
        weight[6, :32] = -0.25  # one repeated negative value: d = -0.0 in Q4_1
    elif case == "one ulp off":
        weight[90, 20] = torch.nextafter(weight[90, 20], torch.tensor(1.0))
    elif case in ("nan", "inf"):
        weight[90, 20] = float(case)
    elif case == "random":
        weight = torch.randn(96, 128)
    assert cpu_kernels.load(), cpu_kernels.error()
    assert _same_blocks(find_blocks(weight), find_blocks(weight, in_torch=True))
    if case == "as made" and kind != "q4_1 inexact products":
        assert find_blocks(weight) is not None


def test_the_kernels_search_finds_the_torch_searchs_blocks_in_the_default_model(model_dir):
    from safetensors import safe_open

    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as tensors:
            for name in tensors.keys():
                weight = tensors.get_tensor(name)
                if weight.dim() == 2:
                    weight = weight.float()
                    assert _same_blocks(find_blocks(weight), find_blocks(weight, in_torch=True)), name


@panel_gemm
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "bf16"])
# 1 to 6: each row block of both builds (AVX2: 1 or 2 rows whole, 3 to 5 in half panels, 6 as 3 + 3); 200: decodes with a prompt chunk
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 10, 12, 13, 30, 64, 200])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (50, 64), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_block_gemm_equals_the_float32_gemm_bit_for_bit(kind, rows, out_features, in_features, with_bias):
    weight = MAKERS[kind](out_features, in_features, seed=rows + out_features)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    codes, scales = cpu_kernels.pack_block_weight(*find_blocks(weight))
    want = cpu_kernels.packed_gemm(x, cpu_kernels.pack_gemm_weight(weight), bias, out_features)
    got = cpu_kernels.block_gemm(x, codes, scales, bias, out_features)
    assert torch.equal(bits(got), bits(want))


@panel_gemm
@pytest.mark.parametrize("rows", [1, 5, 13])
def test_the_block_gemm_result_does_not_depend_on_the_thread_count(rows):
    # Each thread claims panels from its own run, then from the back of the others' (csrc/claimed_chunks.h):
    # with more threads than cores the OS pauses some and the others take their panels. Every column is
    # computed once, whoever takes it; 3072 columns make 96 panels, several claims per run.
    weight = q4_weight(3072, 576, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    codes, scales = cpu_kernels.pack_block_weight(*find_blocks(weight))
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 7):
            torch.set_num_threads(count)
            results += [cpu_kernels.block_gemm(x, codes, scales, None, 3072) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(bits(r), bits(results[0])) for r in results[1:])


@panel_gemm
def test_the_block_gemm_refuses_mismatched_inputs():
    codes, scales = cpu_kernels.pack_block_weight(*find_blocks(q8_weight(64, 64, seed=4)))
    with pytest.raises(RuntimeError, match="in_features"):
        cpu_kernels.block_gemm(torch.randn(2, 32), codes, scales, None, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_kernels.block_gemm(torch.randn(2, 64), codes, scales, None, 96)
    with pytest.raises(RuntimeError, match="pack_block_weight"):
        cpu_kernels.block_gemm(torch.randn(2, 64), codes, scales[:, :1], None, 64)


@panel_gemm
@pytest.mark.parametrize("kind,code_bytes", [("q4_1", 16), ("q8_0", 32), ("bf16", 64)])
def test_a_packed_weight_takes_the_blocks_only_for_few_rows(kind, code_bytes):
    weight = MAKERS[kind](64, 64, seed=3)
    packed = PackedWeight(weight, "avx512", 64, exact_blocks=True)
    assert packed.blocks is not None and packed.blocks[0].shape[2] == code_bytes  # bytes per k step of a panel
    assert packed.reads_blocks(BLOCKS_MAX_ROWS)
    assert not packed.reads_blocks(BLOCKS_MAX_ROWS + 1)
    assert PackedWeight(weight, "avx512", 64).blocks is None  # off unless asked
    assert PackedWeight(torch.randn(64, 64), "avx512", 64, exact_blocks=True).blocks is None
    for rows in (1, BLOCKS_MAX_ROWS, BLOCKS_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 64)
        assert torch.equal(bits(packed(x, None)), bits(cpu_kernels.packed_gemm(x, packed.data, None, 64)))


@panel_gemm
@pytest.mark.parametrize("pays_up_to,want", [(64, 512), (32, 32), (8, 8)])
def test_blocks_that_pay_at_a_full_batch_also_take_the_steps_with_prompt_chunks(monkeypatch, pays_up_to, want):
    """tune_blocks_max_rows: rows double while the timing finds the blocks faster; where they still are at
    max_rows (a step's decodes), every step up to step_rows reads them; where they stop paying before,
    nothing past that is given to them."""
    from tritonllm.devices.cpu import packed_linear

    timed = []

    def pays(weights, rows, *_):
        timed.append(rows)
        return rows <= pays_up_to

    monkeypatch.setattr(packed_linear, "_pays", pays)
    weights = [PackedWeight(q4_weight(64, 64, seed=5), "avx512", 64, exact_blocks=True),
               PackedWeight(torch.randn(64, 64), "avx512", 64, exact_blocks=True)]  # no blocks: told the same rows
    assert packed_linear.tune_blocks_max_rows(weights, 64, step_rows=512) == want
    assert all(w.blocks_max_rows == want for w in weights)
    assert max(timed) <= 64  # nothing past a full batch is timed


@panel_gemm
def test_panels_that_no_step_reads_are_freed_and_the_blocks_take_every_row_count(monkeypatch):
    """Where the blocks take every step size, the float32 panels are freed; any row count, a step's or
    more, then reads the blocks, with the panels' results bit for bit. Where one weight has no blocks, or
    the blocks stop short of the largest step, nothing is freed."""
    from tritonllm.devices.cpu import packed_linear

    monkeypatch.setattr(packed_linear, "_pays", lambda *_: True)
    weights = [PackedWeight(MAKERS[kind](96, 64, seed=7), "avx512", 64, exact_blocks=True) for kind in MAKERS]
    xs = {rows: torch.randn(rows, 64) for rows in (1, 13, 64, 512, 700)}
    want = {rows: [bits(cpu_kernels.packed_gemm(x, w.data, None, 96)) for w in weights] for rows, x in xs.items()}
    assert packed_linear.tune_blocks_max_rows(weights, 64, step_rows=512) == 512
    plain = PackedWeight(torch.randn(96, 64), "avx512", 64, exact_blocks=True)
    assert packed_linear.drop_unread_panels(weights + [plain], 512) == 0  # one of them has no blocks
    assert packed_linear.drop_unread_panels(weights, 1024) == 0  # a step larger than the blocks take
    assert all(w.data is not None for w in weights)
    assert packed_linear.drop_unread_panels(weights, 512) == sum(96 * 64 * 4 for _ in weights)
    for rows, x in xs.items():
        for w, expected in zip(weights, want[rows]):
            assert w.data is None and w.reads_blocks(rows)
            assert torch.equal(bits(w(x, None)), expected)


@panel_gemm
def test_every_gemm_of_the_default_model_reads_exact_blocks(model_dir):
    """The packaged GGUF is Q4_1 in every decoder linear and Q8_0 in its tied embedding: every linear
    and the LM head get their blocks, and on the real weights the block GEMM gives the float32
    GEMM's results bit for bit."""
    from tritonllm.core.config import EngineConfig
    from tritonllm.layers.linear import Linear
    from tritonllm.models.loader import load_model
    from tritonllm.parallel.shard import SINGLE
    from tritonllm.runner.model_shard import ModelShard

    config = EngineConfig.from_parameters(cpu_gemm="avx512", exact_block_weights=True, max_num_seqs=64)
    shard = ModelShard(config, model_dir, torch.device("cpu"), torch.float32, 256, SINGLE)
    model = shard.model
    layers = [m for m in model.layers.modules() if isinstance(m, Linear)]
    linears = [m.packed for m in layers]
    assert len(linears) == 4 * model.num_layers and all(p.blocks is not None for p in linears)
    head = model.lm_head.packed
    assert head is not None and head.blocks is not None and head.blocks[0].shape[2] == 32  # 8-bit codes
    # The float32 panels of the same weights, from the plain model (the served one may have freed its own).
    plain = load_model(model_dir, torch.float32, torch.device("cpu"), 256)
    plain_weights = [m.weight for m in plain.layers.modules() if isinstance(m, Linear)][:8] + [plain.lm_head.weight]
    gen = torch.Generator().manual_seed(0)
    for rows in (BLOCKS_MAX_ROWS, 64, 300):  # 300: a step with a prompt chunk, as tune_blocks_max_rows may hand them
        for p, weight in zip(linears[:8] + [head], plain_weights):
            x = torch.randn(rows, p.in_features, generator=gen)
            want = cpu_kernels.packed_gemm(x, cpu_kernels.pack_gemm_weight(weight), None, p.out_features)
            assert torch.equal(bits(cpu_kernels.block_gemm(x, *p.blocks, None, p.out_features)), bits(want))
    # The rows up to which the blocks are read were timed at load; never fewer than the default.
    assert all(p.blocks_max_rows == linears[0].blocks_max_rows >= BLOCKS_MAX_ROWS for p in linears)
    assert model.ops.decoder_stack.blocks_max_rows == linears[0].blocks_max_rows
    assert head.blocks_max_rows >= BLOCKS_MAX_ROWS  # the head's own crossover, timed alike


@panel_gemm
def test_engine_outputs_equal_with_and_without_the_blocks(model_dir):
    """Greedy ids and log-probs, bit for bit, at one row (the exact head instead of the screen) and at
    three rows (the layers on their blocks, the screen for the head), with the blocks on and off."""
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine
    from tritonllm.core.sampling_params import SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    results = {}
    for on in (True, False):
        engine = Engine(EngineConfig.from_parameters(model=str(model_dir), num_threads=2, exact_block_weights=on,
                                                     num_kv_blocks=256, warmup=False))
        assert (engine.runner.model.lm_head.packed.blocks is not None) is on
        alone = engine.generate(prompts[:1], SamplingParams(max_tokens=16, logprobs=True))
        ids_only = engine.generate(prompts, SamplingParams(max_tokens=16, logprobs=False))
        results[on] = ([o.token_ids for o in alone], torch.tensor([o.logprobs for o in alone]),
                       [o.token_ids for o in ids_only])
    assert results[True][0] == results[False][0] and results[True][2] == results[False][2]
    assert torch.equal(bits(results[True][1]), bits(results[False][1]))
