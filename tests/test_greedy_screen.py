"""The greedy screens (devices/cpu/greedy_screen.py; csrc/int8_greedy_screen.cpp, csrc/screened_greedy_head.cpp):
the float32 head's ids, ties included, from an 8-bit or a bfloat16 LM head and its error bound; and the
engine using one only for rows that want no log-prob."""

from __future__ import annotations

import math

import pytest
import torch

from tritonllm.devices.cpu import kernels as cpu_kernels
from tritonllm.devices.cpu.greedy_screen import GreedyScreen, Int8GreedyScreen, error_bound_factor, int8_bound_factors

pytestmark = pytest.mark.unit

# The bfloat16 GEMM runs wherever the panels do (AVX512-BF16's dot product, else FMAs on widened pairs).
bf16_gemm = pytest.mark.skipif(not (cpu_kernels.load() and cpu_kernels.packed_gemm_bf16_supported()),
                               reason="the kernels' build has no panel GEMM (generic variant): no bfloat16 GEMM")
int8_dots = pytest.mark.skipif(not (cpu_kernels.load() and cpu_kernels.int8_screen_supported()),
                               reason="kernels built without AVX2 or AVX512-VNNI (the generic variant)")
# "int8_avx2": x in 63 steps, as with plain AVX2's dot products (the avx2 variant runs them for it even on
# a CPU with AVX-VNNI): every path a build has is tested on a CPU that runs it.
SCREENS = [pytest.param("int8", marks=int8_dots), pytest.param("int8_avx2", marks=int8_dots),
           pytest.param("bfloat16", marks=bf16_gemm)]


def make_screen(kind: str, weight: torch.Tensor):
    if kind == "bfloat16":
        return GreedyScreen(weight)
    return Int8GreedyScreen(weight, steps=63 if kind == "int8_avx2" else None)


def float32_head_ids(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What the default float32 path picks: our float32 GEMM, then the greedy head's argmax."""
    logits = cpu_kernels.packed_gemm(x, cpu_kernels.pack_gemm_weight(weight), None, weight.shape[0])
    return cpu_kernels.greedy_head(logits)[0]


@pytest.mark.parametrize("kind", SCREENS)
@pytest.mark.parametrize("rows,vocab,hidden", [(1, 7, 37), (5, 1000, 576), (64, 49152, 576), (3, 40, 1), (6, 33, 64)])
def test_screen_ids_equal_the_float32_head_including_ties(kind, rows, vocab, hidden):
    if kind.startswith("int8") and hidden % 32:
        with pytest.raises(ValueError, match="multiple of 32"):  # its scales cover blocks of 32 along K
            Int8GreedyScreen(torch.randn(vocab, hidden))
        return
    gen = torch.Generator().manual_seed(rows + vocab)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    x = torch.randn(rows, hidden, generator=gen) * 2
    tied = weight[vocab // 2]
    weight[vocab // 2] = tied / tied.norm() * weight.norm(dim=1).max() * 1.5  # the longest row, so x below picks it
    weight[vocab - 1] = weight[vocab // 2]  # an exact tie: the lower index wins
    if vocab > 3:
        weight[2] = torch.nextafter(weight[1], torch.tensor(1.0))  # one ulp apart: far inside the bf16 error
        x[-1] = weight[1] * 40
    x[0] = weight[vocab // 2] * 40  # the tied pair is this row's argmax
    ids, candidates = make_screen(kind, weight)(x)
    assert torch.equal(ids, float32_head_ids(weight, x))
    assert ids[0] == vocab // 2
    assert bool((candidates >= 1).all())


@pytest.fixture(scope="module")
def real_head_and_hidden(hf_model, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """The packaged model's (tied) LM head, and the hidden states after the final norm of a greedy answer."""
    head = hf_model.get_output_embeddings().weight.detach().float().contiguous()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a paged KV cache works."}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([list(ids)]), max_new_tokens=32, do_sample=False,
                                pad_token_id=tokenizer.eos_token_id)
        hidden = hf_model(out, output_hidden_states=True).hidden_states[-1][0].contiguous()  # after the final norm
    return head, hidden


@bf16_gemm
def test_screen_recomputes_few_tokens_and_its_bound_holds_on_the_packaged_model(real_head_and_hidden):
    """Real hidden states and the real (tied) head: every bfloat16 logit within its bound of the
    float32 one, and only a handful of the 49,152 tokens left to recompute per row."""
    head, hidden = real_head_and_hidden
    screen = GreedyScreen(head)
    exact = hidden @ head.T
    approx = cpu_kernels.packed_gemm_bf16(hidden, screen.packed, None, head.shape[0], head.shape[1])
    bound = hidden.double().norm(dim=1, keepdim=True) * screen.col_bounds.double()
    assert bool(((exact.double() - approx.double()).abs() <= bound).all())
    got, candidates = screen(hidden)
    assert torch.equal(got, float32_head_ids(head, hidden))
    assert candidates.float().median() <= 4 and candidates.max() <= 64, candidates.tolist()


@pytest.mark.parametrize("kind", [p for p in SCREENS if p.values[0].startswith("int8")])
def test_int8_screen_recomputes_few_tokens_and_its_bound_holds_on_the_packaged_model(real_head_and_hidden, kind):
    """Real hidden states and the real (tied) head: the 8-bit logits, rebuilt in float64 from the packed
    codes and scales as the kernel computes them, within their bound of the float32 ones; the kernel's
    ids those of the float32 head, with a handful of the 49,152 tokens recomputed per row."""
    head, hidden = real_head_and_hidden
    screen = make_screen(kind, head)
    steps = screen.steps  # x's: 127 with a VNNI dot product, 63 with plain AVX2's
    rows, k = hidden.shape
    vocab, blocks = head.shape[0], k // 32
    q = screen.codes.permute(0, 2, 1, 3).reshape(-1, k)[:vocab].double()  # back to [V, K]
    d, c = (t.permute(0, 2, 1).reshape(-1, blocks)[:vocab].double() for t in (screen.d, screen.c))
    xb = hidden.view(rows, blocks, 32)
    top = xb.abs().amax(dim=2, keepdim=True)
    s = top / steps  # as the kernel rounds them, in float32
    xq = torch.round(xb * (steps / top)).double()
    dots = torch.einsum("rbk,vbk->rvb", xq, q.view(vocab, blocks, 32))
    approx = torch.einsum("rvb,rb,vb->rv", dots, s.squeeze(2).double(), d)
    bound = s.squeeze(2).double() @ c.T
    exact = cpu_kernels.packed_gemm(hidden, cpu_kernels.pack_gemm_weight(head), None, vocab)
    assert bool(((exact.double() - approx).abs() <= bound).all())
    got, candidates = screen(hidden)
    assert torch.equal(got, float32_head_ids(head, hidden))
    room = 1 if steps == 127 else 2.5  # 63 steps: each bound twice as wide
    assert candidates.float().median() <= 8 * room and candidates.max() <= 128 * 2 * room, candidates.tolist()


def test_int8_bound_factors_cover_half_a_step_and_the_weight_residual():
    a, e = int8_bound_factors(576)
    assert 0.5 < a < 0.5 * 1.03 and 127 < e < 127 * 1.02


def test_error_bound_factor_covers_bfloat16_rounding():
    # Two bfloat16 roundings (2^-8 each) and the float32 sums: just over 2^-7 for K = 576.
    assert 2 ** -7 < error_bound_factor(576) < 2 ** -7 * 1.05


@bf16_gemm
def test_screen_rejects_bad_shapes_and_gives_id_0_for_a_nan_row():
    weight = torch.randn(50, 8)
    screen = GreedyScreen(weight)
    x = torch.randn(2, 8)
    x[1, 3] = math.nan
    ids, candidates = screen(x)
    assert ids[1] == 0 and candidates[1] == 0 and candidates[0] >= 1
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_kernels.screened_greedy_head(x, torch.zeros(2, 49), weight, screen.col_bounds)
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu_kernels.screened_greedy_head(x.double(), torch.zeros(2, 50), weight, screen.col_bounds)
    with pytest.raises(ValueError, match="float32"):
        GreedyScreen(weight.double())


@int8_dots
def test_int8_screen_rejects_bad_shapes_and_handles_nan_zero_and_tiny_rows():
    weight = torch.randn(50, 64) * 0.05
    screen = Int8GreedyScreen(weight)
    x = torch.randn(4, 64)
    x[1, 3] = math.nan
    x[2] = 0.0  # every logit 0: the first token
    x[3, :32] = 1e-35  # a block too small to scale, bounded by its size
    ids, candidates = screen(x)
    assert ids[1] == 0 and candidates[1] == 0
    keep = torch.tensor([0, 2, 3])
    assert torch.equal(ids[keep], float32_head_ids(weight, x[keep]))
    x[1, 3] = math.inf
    assert screen(x)[1][1] == 0
    with pytest.raises(RuntimeError, match="K a multiple of 32|weight float32"):
        cpu_kernels.int8_greedy_screen(torch.randn(2, 63), screen.codes, screen.d, screen.negq, screen.c, weight, screen.steps)
    with pytest.raises(RuntimeError, match="codes"):
        cpu_kernels.int8_greedy_screen(x, screen.codes[:2].contiguous(), screen.d, screen.negq, screen.c, weight, screen.steps)
    with pytest.raises(RuntimeError, match="127 or 63 steps"):
        cpu_kernels.int8_greedy_screen(x, screen.codes, screen.d, screen.negq, screen.c, weight, 100)
    with pytest.raises(ValueError, match="float32"):
        Int8GreedyScreen(weight.double())


ENGINE_PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
                  "Once upon a time, in a small village by the mountains, there lived"]


def _screen_engine(model_dir, greedy_screen: str):
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    return Engine(EngineConfig.from_parameters(model=str(model_dir), num_threads=2, greedy_screen=greedy_screen,
                                               num_kv_blocks=256, warmup=False))


@pytest.fixture(scope="module")
def unscreened_engine_ids(model_dir) -> list[list[int]]:
    """ENGINE_PROMPTS' greedy ids without a screen (the float32 head): what each screen must give. One
    engine for every screen's test, as the reference does not depend on the screen under test."""
    from tritonllm.core.sampling_params import SamplingParams

    engine = _screen_engine(model_dir, "false")
    assert engine.runner.backend.head.screen_kind() is None
    return [o.token_ids for o in engine.generate(ENGINE_PROMPTS, SamplingParams(max_tokens=24, logprobs=False))]


@pytest.mark.parametrize("kind", [p for p in SCREENS if p.values[0] != "int8_avx2"])
def test_engine_ids_equal_with_and_without_the_screen_and_log_probs_only_where_asked(model_dir, kind,
                                                                                      unscreened_engine_ids):
    from tritonllm.core.sampling_params import SamplingParams

    engine = _screen_engine(model_dir, kind)
    assert engine.runner.backend.head.screen_kind() == kind
    screened = [o.token_ids for o in engine.generate(ENGINE_PROMPTS, SamplingParams(max_tokens=24, logprobs=False))]
    # One request wants log-probs, three do not, in the same steps: it gets them (the float32 head), they
    # get NaN (the screen), and every id is the one it had alone.
    rids = [engine.add_request(p, SamplingParams(max_tokens=8, logprobs=i == 0)) for i, p in enumerate(ENGINE_PROMPTS)]
    lps = {rid: [] for rid in rids}
    mixed = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for out in engine.step():
            lps[out.request_id] += out.new_logprobs
            mixed[out.request_id] += out.new_token_ids
    assert all(lp <= 0 and math.isfinite(lp) for lp in lps[rids[0]])
    assert all(math.isnan(lp) for rid in rids[1:] for lp in lps[rid])
    assert [mixed[rid] for rid in rids] == [ids[:8] for ids in screened]
    assert screened == unscreened_engine_ids


@pytest.mark.skipif(not (cpu_kernels.load() and (cpu_kernels.int8_screen_supported()
                                                 or cpu_kernels.packed_gemm_bf16_supported())),
                    reason="kernels built without AVX512-VNNI and AVX512-BF16 (this CPU lacks both): no screen")
def test_an_untied_head_keeps_its_float32_rows_for_the_screen(model_dir, tmp_path):
    """An untied LM head's plain weight is freed when it is packed; the screen must keep its own (both
    screens keep it alike: the first this CPU runs is taken)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine
    from tritonllm.core.sampling_params import SamplingParams

    untied = tmp_path / "untied"
    shutil.copytree(model_dir, untied, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed + torch.randn(embed.shape, generator=gen, dtype=embed.dtype) * 0.01
    save_file(tensors, untied / "model.safetensors")
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))

    outputs = {}
    for on in (True, False):
        engine = Engine(EngineConfig.from_parameters(model=str(untied), num_threads=2, greedy_screen=on,
                                                     num_kv_blocks=128, warmup=False))
        model = engine.runner.model
        assert not model.tie_word_embeddings and (engine.runner.backend.head.screen is not None) is on
        outputs[on] = [o.token_ids for o in engine.generate(["The capital of France is", "Hi"],
                                                             SamplingParams(max_tokens=16, logprobs=False))]
    assert outputs[True] == outputs[False]


@int8_dots
@bf16_gemm
def test_each_setting_builds_the_screens_it_names():
    """auto builds both to time them; true the first this CPU runs (the 8-bit one); int8 or bfloat16 that
    one; and the 8-bit screen is left out for a hidden size its blocks of 32 do not divide."""
    from tritonllm.devices.cpu.head import build_screens

    def built(setting: str, hidden: int = 64) -> list[str]:
        return [type(s).__name__ for s in build_screens(setting, torch.randn(40, hidden))]

    assert built("auto") == ["Int8GreedyScreen", "GreedyScreen"]
    assert built("true") == ["Int8GreedyScreen"]
    assert built("int8") == ["Int8GreedyScreen"]
    assert built("bfloat16") == ["GreedyScreen"]
    assert built("int8", hidden=48) == []
    assert built("auto", hidden=48) == ["GreedyScreen"]
