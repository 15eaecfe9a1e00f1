"""Our Ascend backend's side of torch_npu's contract, checked on the CPU.

The backend's real calls (devices/npu/ops.py: the KV write through `_npu_reshape_and_cache`, attention
through `npu_fused_infer_attention_score`) run here through tests/npu_reference.py, a plain-torch
reference of what torch_npu documents those operators to compute, which refuses every argument the
documentation forbids. Steps of prompts, prompt chunks after cached prefixes and decodes, over
shuffled blocks, must then give the torch reference attention's output (layers/ops.py `LayerOps`).
What this cannot show (the real kernels' numerics, speed, and whatever the documentation leaves
unsaid) is in docs/DEVICES.md, "What the contract tests prove".
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from npu_reference import ContractError, NpuReference, compressed_causal_mask
from shuffled_blocks import ShuffledBlocks
from tritonllm.core.config import NpuOptions
from tritonllm.devices.backend import Runtime
from tritonllm.devices.npu.backend import NpuBackend
from tritonllm.devices.npu.ops import CAUSAL_MASK_SIZE, NpuOps, causal_mask
from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.kv_layout import HEAD_MAJOR, TOKEN_MAJOR, pool_shape
from tritonllm.layers.ops import LayerOps
from tritonllm.runner.step_inputs import to_device

pytestmark = pytest.mark.unit

BLOCK, HEADS, KV_HEADS, HEAD_DIM, BLOCKS = 128, 9, 3, 64, 24  # SmolLM2's heads; torch_npu's block size
CPU = torch.device("cpu")


class Steps:
    """Sequences advanced step by step on blocks drawn in shuffled order, one pool per path: the NPU
    ops' token-major pool written through the reference's reshape-and-cache, the torch reference's
    head-major pool written by its own ops. Each step feeds both the same projections."""

    def __init__(self, dtype: torch.dtype, kernels: NpuReference, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.sequences = ShuffledBlocks(BLOCKS, BLOCK, self.gen)
        scale = HEAD_DIM ** -0.5
        self.npu = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, scale, NpuOps(True, CPU, kernels=kernels))
        self.torch = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, scale, LayerOps())
        # Pools start as noise: attention must read only what the step's tables and lengths cover.
        self.npu_pool = tuple(torch.randn(pool_shape(TOKEN_MAJOR, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM),
                                          generator=self.gen).to(dtype) for _ in "kv")
        self.torch_pool = tuple(p.permute(2, 0, 1, 3).contiguous() for p in self.npu_pool)
        assert self.torch_pool[0].shape == pool_shape(HEAD_MAJOR, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)

    def step(self, new_tokens: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of `new_tokens` per sequence through both paths: (NPU ops' output, torch reference's)."""
        host = self.sequences.host_step(new_tokens)
        num_tokens = len(host.input_ids)
        # A strided view, as the model's fused QKV projection hands attention its slices.
        wide = torch.randn(num_tokens, HEADS + 2 * KV_HEADS, 2 * HEAD_DIM, generator=self.gen).to(self.dtype)
        qkv = wide[:, :, :HEAD_DIM]
        assert not qkv.is_contiguous()
        angles = torch.from_numpy(host.positions).float()[:, None] * torch.logspace(0, -3, HEAD_DIM // 2)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        rope = (angles.cos().to(self.dtype), angles.sin().to(self.dtype))
        # Each path gets its own metadata: the plans each attention derives per step stay apart.
        npu_out = self.npu(qkv, rope, self.npu_pool, to_device(host, CPU).meta)
        torch_out = self.torch(qkv, rope, self.torch_pool, to_device(host, CPU).meta)
        return npu_out, torch_out


# Each scenario: the steps, each the tokens fed per sequence (1: a decode; more: a prompt or its chunk).
SCENARIOS = {
    "prompts": [{"a": 37, "b": 200, "c": 128}],
    "chunked prompts, then decodes": [{"a": 100, "b": 5}, {"a": 60, "b": 130}, {"a": 1, "b": 1}, {"a": 1, "b": 1}],
    "decodes beside prompts and chunks": [{"a": 127, "b": 129}, {"a": 1, "b": 1, "c": 70},
                                          {"a": 1, "b": 1, "c": 200, "d": 3}, {"a": 1, "b": 1, "c": 1, "d": 1}],
    "a first token decoded": [{"a": 1, "b": 1}, {"a": 1, "b": 1}],
}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=list(SCENARIOS))
def test_our_npu_calls_mean_the_torch_reference_attention(scenario):
    kernels = NpuReference(extra_dtypes=(torch.float32,))  # float32 only to compare at 1e-5; all else checked
    steps = Steps(torch.float32, kernels)
    for new_tokens in SCENARIOS[scenario]:
        npu_out, torch_out = steps.step(new_tokens)
        torch.testing.assert_close(npu_out, torch_out, rtol=1e-5, atol=1e-5)
    # The K/V the reshape-and-cache wrote are the torch path's, slot for slot, in the other layout.
    for npu_pool, torch_pool in zip(steps.npu_pool, steps.torch_pool):
        torch.testing.assert_close(npu_pool, torch_pool.permute(1, 2, 0, 3))
    names = [name for name, _ in kernels.calls]
    assert names == ["_npu_reshape_and_cache", "npu_fused_infer_attention_score"] * len(SCENARIOS[scenario])


def test_bfloat16_runs_within_the_documented_dtypes():
    steps = Steps(torch.bfloat16, NpuReference())  # no widening: float16 and bfloat16 only
    for new_tokens in SCENARIOS["decodes beside prompts and chunks"]:
        npu_out, torch_out = steps.step(new_tokens)
        # Both write the same bfloat16 K/V; the reference attends in float32 and rounds once, the torch
        # reference attends in bfloat16: a few bfloat16 steps apart.
        torch.testing.assert_close(npu_out.float(), torch_out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(steps.npu_pool[0], steps.torch_pool[0].permute(1, 2, 0, 3), rtol=0, atol=0)


def test_the_causal_mask_we_pass_is_the_documented_compressed_one():
    mask = causal_mask(CPU)
    assert mask.shape == (CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE) == (2048, 2048)
    assert torch.equal(mask, compressed_causal_mask())


# ---- every documented constraint, broken one at a time, is refused ---------------------------------

@pytest.fixture(scope="module")
def recorded():
    """The arguments of one mixed step's two calls (decodes, a chunk after a cached prefix, a prompt):
    (KV write's, attention's). Tests build broken copies; none changes these in place."""
    kernels = NpuReference()
    steps = Steps(torch.bfloat16, kernels)
    steps.step({"a": 130, "b": 20})
    steps.step({"a": 1, "b": 1, "c": 9})
    steps.step({"a": 1, "b": 40, "c": 1})
    (_, write), (_, attend) = kernels.calls[-2:]
    return write, attend


def _broken(args: dict, name: str, value) -> dict:
    return {**args, name: value}


ATTENTION_BREAKS = {
    "a layout other than TND": lambda a: _broken(a, "input_layout", "BSH"),
    "query lengths per sequence, not cumulative": lambda a: _broken(
        a, "actual_seq_lengths", [e - s for s, e in zip([0] + a["actual_seq_lengths"], a["actual_seq_lengths"])]),
    "query ends that go down": lambda a: _broken(a, "actual_seq_lengths", a["actual_seq_lengths"][::-1]),
    "query ends as a device tensor": lambda a: _broken(a, "actual_seq_lengths", torch.tensor(a["actual_seq_lengths"])),
    "query ends short of the rows": lambda a: _broken(a, "actual_seq_lengths", a["actual_seq_lengths"][:-1]),
    "context lengths missing": lambda a: _broken(a, "actual_seq_lengths_kv", None),
    "a context shorter than its query rows": lambda a: _broken(
        a, "actual_seq_lengths_kv", [1] * len(a["actual_seq_lengths_kv"])),
    "causal without its mask": lambda a: _broken(a, "atten_mask", None),
    "the mask the other way round": lambda a: _broken(a, "atten_mask", ~a["atten_mask"]),
    "a mask not 2048 square": lambda a: _broken(a, "atten_mask", a["atten_mask"][:1024, :1024].contiguous()),
    "a float mask": lambda a: _broken(a, "atten_mask", a["atten_mask"].float()),
    "a mask with sparse mode 0": lambda a: _broken(a, "sparse_mode", 0),
    "sparse mode 2": lambda a: _broken(a, "sparse_mode", 2),
    "an int64 block table": lambda a: _broken(a, "block_table", a["block_table"].long()),
    "a block table one row short": lambda a: _broken(a, "block_table", a["block_table"][1:]),
    "a block table too narrow": lambda a: _broken(a, "block_table", a["block_table"][:, :1].contiguous()),
    "a block outside the pool": lambda a: _broken(a, "block_table", a["block_table"] + BLOCKS),
    "block_size not the pool's": lambda a: _broken(a, "block_size", 64),
    "num_heads not the query's": lambda a: _broken(a, "num_heads", HEADS + 1),
    "KV heads that do not divide the heads": lambda a: _broken(a, "num_key_value_heads", 2),
    "a non-contiguous query": lambda a: _broken(a, "query", a["query"].transpose(0, 1).contiguous().transpose(0, 1)),
    "a float32 query": lambda a: _broken(a, "query", a["query"].float()),
    "keys in another dtype": lambda a: _broken(a, "key", a["key"].half()),
    "the scale under its old name": lambda a: {**{k: v for k, v in a.items() if k != "scale"},
                                               "scale_value": a["scale"]},
    "a non-default extra": lambda a: _broken(a, "pre_tokens", 1),
}


@pytest.mark.parametrize("break_it", ATTENTION_BREAKS.values(), ids=list(ATTENTION_BREAKS))
def test_the_reference_refuses_each_broken_attention_argument(break_it, recorded):
    _, attend = recorded
    NpuReference().npu_fused_infer_attention_score(**attend)  # as our code passed them: accepted
    with pytest.raises((ContractError, TypeError)):
        NpuReference().npu_fused_infer_attention_score(**break_it(attend))


def test_context_lengths_read_as_cumulative_would_attend_elsewhere(recorded):
    # With a block table, each context length is the sequence's own (module docstring of
    # npu_reference); cumulative ones still fit this step's table, so only the output tells them apart.
    _, attend = recorded
    ours, _ = NpuReference().npu_fused_infer_attention_score(**attend)
    cumulative = torch.tensor(attend["actual_seq_lengths_kv"]).cumsum(0).tolist()
    other, _ = NpuReference().npu_fused_infer_attention_score(**_broken(attend, "actual_seq_lengths_kv", cumulative))
    assert not torch.allclose(ours.float(), other.float(), atol=1e-2)


def test_prompt_rows_need_a_documented_block_size():
    kernels = NpuReference()
    steps = Steps(torch.bfloat16, kernels)
    steps.step({"a": 1, "b": 1})  # one query row each: any multiple of 16 will do
    attend = dict(kernels.calls[-1][1])
    pool = [p.view(BLOCKS * 8, 16, -1) for p in (attend["key"], attend["value"])]  # the same pool as 16-token blocks
    table = attend["block_table"] * 8
    small = {**attend, "key": pool[0], "value": pool[1], "block_table": table, "block_size": 16}
    NpuReference().npu_fused_infer_attention_score(**small)
    # Two query rows each: 128 to 512 in steps of 128 only.
    prompt = {**small, "query": torch.cat([attend["query"]] * 2), "actual_seq_lengths": [2, 4],
              "actual_seq_lengths_kv": [2, 2]}
    with pytest.raises(ContractError, match="128 to 512"):
        NpuReference().npu_fused_infer_attention_score(**prompt)


WRITE_BREAKS = {
    "int64 slots": lambda a: _broken(a, "slot_indices", a["slot_indices"].long()),
    "a slot twice": lambda a: _broken(a, "slot_indices", a["slot_indices"].clone().fill_(int(a["slot_indices"][0]))),
    "a slot outside the pool": lambda a: _broken(a, "slot_indices", a["slot_indices"] + BLOCKS * BLOCK),
    "keys in another dtype than the pool": lambda a: _broken(a, "key", a["key"].half()),
    "keys of another head count": lambda a: _broken(a, "key", a["key"][:, :1].contiguous()),
    "a non-contiguous key": lambda a: _broken(a, "key", a["key"].transpose(0, 1).contiguous().transpose(0, 1)),
    "a pool as [slots, heads, dim]": lambda a: _broken(a, "key_cache", a["key_cache"].view(-1, KV_HEADS, HEAD_DIM)),
    "one slot per token missing": lambda a: _broken(a, "slot_indices", a["slot_indices"][1:]),
}


@pytest.mark.parametrize("break_it", WRITE_BREAKS.values(), ids=list(WRITE_BREAKS))
def test_the_reference_refuses_each_broken_kv_write_argument(break_it, recorded):
    write, _ = recorded
    fresh = lambda a: {k: v.clone() if k.endswith("cache") else v for k, v in a.items()}  # noqa: E731
    NpuReference()._npu_reshape_and_cache(**fresh(write))
    with pytest.raises(ContractError):
        NpuReference()._npu_reshape_and_cache(**fresh(break_it(write)))


# ---- the backend calls torch_npu only within the documented contract ------------------------------

def _runtime(dtype=torch.bfloat16, kv_dtype=None, block_size=128) -> Runtime:
    return Runtime(CPU, dtype, kv_dtype or dtype, block_size, max_num_seqs=8, max_num_batched_tokens=256,
                   max_model_len=1024)


@pytest.mark.parametrize("runtime, why", [
    (_runtime(), ""),
    (_runtime(torch.float16, block_size=512), ""),
    (_runtime(block_size=16), "block_size 128, 256, 384 or 512, not 16"),
    (_runtime(torch.float32), "float16 and bfloat16, not float32"),
    (_runtime(kv_dtype=torch.float16), "kv_cache_dtype differs"),
])
def test_auto_runs_torch_npu_only_where_its_documentation_allows(runtime, why):
    ops = NpuBackend(NpuOptions(attention="auto"), runtime).ops
    assert ops.fused == (not why) and why in ops.why
    assert ops.kv_layout == (TOKEN_MAJOR if not why else HEAD_MAJOR)


@pytest.mark.parametrize("kind", [{"window": 64}, {"softcap": 30.0}])
def test_a_model_the_fused_call_cannot_express_keeps_the_torch_reference(kind):
    backend = NpuBackend(NpuOptions(attention="auto"), _runtime())
    assert backend.ops.fused
    layers = nn.ModuleList([PagedAttention(HEADS, KV_HEADS, HEAD_DIM, 0.125, backend.ops),
                            PagedAttention(HEADS, KV_HEADS, HEAD_DIM, 0.125, backend.ops, **kind)])
    backend.prepare(layers)
    assert not backend.ops.fused and backend.capabilities.kv_layout == HEAD_MAJOR
    assert "sliding-window or soft-capped" in backend.plan()["attention"]


def test_an_explicit_torch_npu_outside_its_documentation_fails_the_load():
    with pytest.raises(ValueError, match="npu_attention=torch_npu: .*block_size"):
        NpuBackend(NpuOptions(attention="torch_npu"), _runtime(block_size=16))
    assert NpuBackend(NpuOptions(attention="torch_npu"), _runtime()).ops.fused


@pytest.mark.parametrize("runtime", [_runtime(kv_dtype=torch.float8_e4m3fn),
                                     dataclasses.replace(_runtime(), quantization="fp8")])
def test_fp8_is_refused_on_the_npu_by_name(runtime):
    with pytest.raises(ValueError, match="fp8 are not supported on Ascend NPUs"):
        NpuBackend(NpuOptions(attention="auto"), runtime)
