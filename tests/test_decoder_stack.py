"""The decoder layers as one C++ call (models/decoder_stack.py, csrc/decoder_stack.cpp): taken for
decode-only and prompt-only steps, and bit for bit what the modules compute."""

from __future__ import annotations

import pytest
import torch

from tritonllm import cpu_kernels

avx512 = pytest.mark.skipif(not (cpu_kernels.load() and cpu_kernels.packed_gemm_supported()),
                            reason="kernels built without AVX-512 (this CPU lacks it)")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def engine(model_dir, **overrides):
    from tritonllm.config import EngineConfig
    from tritonllm.engine import Engine

    return Engine(EngineConfig(model=str(model_dir), num_threads=2, num_kv_blocks=256, warmup=False, **overrides))


class CountingStack:
    """Wraps the model's stack to count the steps that take it."""

    def __init__(self, stack):
        self.stack, self.calls = stack, []

    def applies(self, hidden, meta):
        return self.stack.applies(hidden, meta)

    def __call__(self, hidden, kv_caches, meta, attention):
        self.calls.append(hidden.shape[0])
        return self.stack(hidden, kv_caches, meta, attention)


@avx512
@pytest.mark.parametrize("exact_blocks", [True, False])
def test_engine_outputs_equal_with_and_without_the_stack(model_dir, exact_blocks):
    """Greedy ids and log-probs, bit for bit, for one request (prompt step, then decode steps of one
    row) and for three of different lengths at once (a prompt-only step, then decodes), with the
    layers as one call and as modules; with and without the exact blocks (panels at few rows too)."""
    from tritonllm.sampling_params import SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    results = {}
    for on in (True, False):
        eng = engine(model_dir, exact_block_weights=exact_blocks)
        model = eng.runner.model
        assert model.decoder_stack is not None
        counter = CountingStack(model.decoder_stack) if on else None
        model.decoder_stack = counter
        params = SamplingParams(max_tokens=12, logprobs=True, ignore_eos=True)
        outs = eng.generate(prompts[:1], params) + eng.generate(prompts, params)
        results[on] = ([o.token_ids for o in outs], torch.tensor([o.logprobs for o in outs]))
        if on:
            assert 1 in counter.calls and 3 in counter.calls  # decode steps of one and of three rows
            assert any(rows > 3 for rows in counter.calls)  # and prompt steps
    assert results[True][0] == results[False][0]
    assert torch.equal(bits(results[True][1]), bits(results[False][1]))


@avx512
def test_mixed_steps_take_the_modules(model_dir):
    """A step with both decodes and a prompt chunk is more than one attention call: not the stack."""
    from tritonllm.layers.attention import one_kernel_call
    from tritonllm.sampling_params import SamplingParams

    eng = engine(model_dir)
    seen = []
    real = one_kernel_call

    def spy(meta, num_tokens):
        found = real(meta, num_tokens)
        seen.append((bool(meta.decode) and meta.prefill is not None, found is None))
        return found

    import tritonllm.models.decoder_stack as stack_module
    stack_module.one_kernel_call = spy
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        eng.add_sequence(eng.make_sequence("Tell me about the moon.", params))
        eng.step()  # its prompt
        eng.add_sequence(eng.make_sequence("And the sun?", params))
        eng.step()  # one decode and the new prompt: a mixed step
    finally:
        stack_module.one_kernel_call = real
    assert (True, True) in seen  # the mixed step was refused
    assert (False, False) in seen  # the prompt-only step was taken


def test_no_stack_without_the_avx512_gemm(model_dir):
    eng = engine(model_dir, cpu_gemm="aten")
    assert eng.runner.model.decoder_stack is None
