"""The decoder layers as one C++ call (devices/cpu/decoder_stack.py, csrc/decoder_stack.cpp): taken for
decode-only and prompt-only steps, and bit for bit what the modules compute."""

from __future__ import annotations

import pytest
import torch

from greedy_reference import transformers_greedy
from tritonllm.devices.cpu import kernels as cpu_kernels
from tritonllm.devices.cpu.decoder_stack import DecoderStack

pytestmark = pytest.mark.engine

panel_gemm = pytest.mark.skipif(not (cpu_kernels.load() and cpu_kernels.packed_gemm_supported()),
                                reason="kernels without the panel GEMM (the generic variant: neither AVX-512 nor AVX2 + FMA)")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def engine(model_dir, **overrides):
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    return Engine(EngineConfig.from_parameters(model=str(model_dir), num_threads=2, num_kv_blocks=256, warmup=False, **overrides))


def stack_of(model) -> DecoderStack | None:
    """The stack the CPU's ops run the model's layers through, if the backend gave them one."""
    return model.ops.decoder_stack


def use_modules(model) -> None:
    """Run the layers one by one: no whole-stack op."""
    model.ops.decoder_stack = None


class CountingStack:
    """Stands in for the model's stack to count the steps that take it."""

    def __init__(self, stack):
        self.stack, self.calls = stack, []

    def run(self, hidden, kv_caches, meta):
        out = self.stack.run(hidden, kv_caches, meta)
        if out is not None:
            self.calls.append(hidden.shape[0])
        return out


def count_stack_steps(model) -> CountingStack:
    counter = CountingStack(stack_of(model))
    model.ops.decoder_stack = counter
    return counter


def stack_against_modules(make_engine, prompts, params, model_ok) -> list[list[int]]:
    """`prompts` generated on a fresh engine (`make_engine()`, whose model `model_ok` accepts) with the
    stack, and on another with the layers one by one: the same ids and log-probs bit for bit, the stack
    having taken decode steps of 3 rows and prompt steps of more. Returns the ids."""
    results = {}
    for on in (True, False):
        eng = make_engine()
        model = eng.runner.model
        assert model_ok(model)
        counter = count_stack_steps(model) if on else use_modules(model)
        outs = eng.generate(prompt_token_ids=prompts, params=params)
        results[on] = ([o.token_ids for o in outs], torch.tensor([o.logprobs for o in outs]))
        if on:
            assert 3 in counter.calls and any(rows > 3 for rows in counter.calls)
    assert results[True][0] == results[False][0]
    assert torch.equal(bits(results[True][1]), bits(results[False][1]))
    return results[True][0]


@panel_gemm
@pytest.mark.parametrize("exact_blocks", [True, False])
def test_engine_outputs_equal_with_and_without_the_stack(model_dir, exact_blocks):
    """Greedy ids and log-probs, bit for bit, for one request (prompt step, then decode steps of one
    row) and for three of different lengths at once (a prompt-only step, then decodes), with the
    layers as one call and as modules; with and without the exact blocks (panels at few rows too)."""
    from tritonllm.core.sampling_params import SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    results = {}
    for on in (True, False):
        eng = engine(model_dir, exact_block_weights=exact_blocks)
        model = eng.runner.model
        assert stack_of(model) is not None
        counter = count_stack_steps(model) if on else use_modules(model)
        params = SamplingParams(max_tokens=12, logprobs=True, ignore_eos=True)
        outs = eng.generate(prompts[:1], params) + eng.generate(prompts, params)
        results[on] = ([o.token_ids for o in outs], torch.tensor([o.logprobs for o in outs]))
        if on:
            assert 1 in counter.calls and 3 in counter.calls  # decode steps of one and of three rows
            assert any(rows > 3 for rows in counter.calls)  # and prompt steps
    assert results[True][0] == results[False][0]
    assert torch.equal(bits(results[True][1]), bits(results[False][1]))


@panel_gemm
def test_a_mixed_step_takes_the_stack_with_the_modules_results(model_dir):
    """A step with decodes beside a prompt chunk runs one attention call per layer over both (the decode's
    row, then a row per prompt token); its ids and log-probs are the modules' bit for bit."""
    from tritonllm.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=6, logprobs=True, ignore_eos=True)
    results = {}
    for on in (True, False):
        eng = engine(model_dir)
        model = eng.runner.model
        steps = []  # per step: (decodes, sequences)
        stack = stack_of(model)
        real_applies = stack.applies

        def applies(hidden, meta, real_applies=real_applies, steps=steps):
            rows = real_applies(hidden, meta)
            assert rows is not None and len(rows[0]) == hidden.shape[0]  # one row per token
            steps.append((meta.seqs.num_decodes, len(meta.seqs.seq_lens_host)))
            return rows if on else None

        stack.applies = applies
        first = eng.make_sequence("Tell me about the moon.", params)
        eng.add_sequence(first)
        eng.step()  # its prompt
        second = eng.make_sequence("And the sun?", params)
        eng.add_sequence(second)
        eng.step()  # the first one's decode beside the second one's prompt
        while eng.has_unfinished():
            eng.step()
        assert steps[:2] == [(0, 1), (1, 2)]  # a prompt alone, then a decode beside a prompt
        results[on] = [(seq.output_token_ids, torch.tensor(seq.output_logprobs)) for seq in (first, second)]
    for (ids_on, lp_on), (ids_off, lp_off) in zip(results[True], results[False]):
        assert ids_on == ids_off and torch.equal(bits(lp_on), bits(lp_off))


@panel_gemm
@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_query_key_and_output_norms_run_in_the_stack_with_the_modules_results(family, tokenizer, tmp_path):
    """Qwen3 norms each query and key head before the rotary; OLMo 2 norms the whole query and key
    projections, and the attention's and MLP's outputs instead of their inputs. The stack does as the
    modules do, bit for bit (a prompt step, then decodes of three rows), and its outputs are
    transformers' greedy ones."""
    import transformers

    from tiny_models import tiny_config_args, write_tiny_model
    from tritonllm.core.sampling_params import SamplingParams

    args = {**tiny_config_args(tokenizer), "num_hidden_layers": 3}
    config = (transformers.Qwen3Config(**args, head_dim=32) if family == "qwen3" else transformers.Olmo2Config(**args))
    reference = write_tiny_model(config, tokenizer, tmp_path)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ("def fibonacci(n):", "Once upon a time", "1, 2, 3")]
    params = SamplingParams(max_tokens=10, logprobs=True, ignore_eos=True)
    def check(model) -> bool:
        stack = stack_of(model)
        return (stack is not None and len(stack.qk_norms) == 2 * 3
                and (len(stack.norms), len(stack.output_norms)) == ((2 * 3, 0) if family == "qwen3" else (0, 2 * 3)))

    token_ids = stack_against_modules(lambda: engine(tmp_path), prompts, params, check)
    for ids, out in zip(prompts, token_ids):
        assert out == transformers_greedy(reference, ids, out, 10, min_new_tokens=10)[0]


@panel_gemm
def test_layers_that_all_slide_with_one_window_run_in_the_stack_with_the_modules_results(tokenizer, tmp_path):
    """Where every layer attends to its last `sliding_window` positions (Mistral), one pool serves them all
    and the stack's attention rows carry the window: outputs running past it, the blocks behind it given
    back, are the modules' bit for bit and transformers' greedy ones."""
    import transformers

    from tiny_models import tiny_config_args, write_tiny_model
    from tritonllm.core.sampling_params import SamplingParams

    args = {**tiny_config_args(tokenizer), "num_hidden_layers": 3}
    reference = write_tiny_model(transformers.MistralConfig(**args, sliding_window=20), tokenizer, tmp_path)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ("def fibonacci(n):", "Once upon a time", "1, 2, 3")]
    params = SamplingParams(max_tokens=40, logprobs=True, ignore_eos=True)  # 20 or more past the window
    token_ids = stack_against_modules(lambda: engine(tmp_path), prompts, params,
                                      lambda model: model.kv_release_window == 20 and stack_of(model) is not None)
    for ids, out in zip(prompts, token_ids):
        assert out == transformers_greedy(reference, ids, out, 40, min_new_tokens=40)[0]


def test_no_stack_without_the_avx512_gemm(model_dir):
    eng = engine(model_dir, cpu_gemm="aten")
    assert stack_of(eng.runner.model) is None
