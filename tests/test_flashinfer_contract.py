"""Our CUDA backend's side of FlashInfer's contract, checked on the CPU.

The backend's real planning (devices/cuda/flashinfer_attention.py `FlashInferPlans`, and the decode
graphs' buckets in graphs.py) runs here against tests/flashinfer_reference.py, a plain-torch stand-in for
the two FlashInfer wrappers we use, which checks each planning array against FlashInfer's documentation
and computes the attention those arrays describe. Steps of prompts, chunks after cached prefixes and
decodes over shuffled pages, for plain, sliding-window and soft-capped layers, must then give the torch
reference attention's output (layers/ops.py `LayerOps`). What only a GPU shows is in docs/DEVICES.md,
"What the contract tests prove".
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flashinfer_reference import ContractError, FlashInferReference
from shuffled_blocks import ShuffledBlocks
from tritonllm.devices.cuda.flashinfer_attention import FlashInferPlans, LayerKind
from tritonllm.devices.cuda.graphs import DecodeGraphs, batch_buckets, padded_decodes
from tritonllm.devices.cuda.ops import CudaOps
from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.kv_layout import HEAD_MAJOR, TOKEN_MAJOR, pool_shape
from tritonllm.layers.ops import LayerOps
from tritonllm.runner.step_inputs import to_device

pytestmark = pytest.mark.unit

BLOCK, HEADS, KV_HEADS, HEAD_DIM, BLOCKS = 16, 9, 3, 64, 96
CPU = torch.device("cpu")
# The kinds of layer a plan depends on: plain, a sliding window, Gemma 2's soft cap (LayerKind).
LAYERS = {"plain": {}, "sliding": {"window": 24}, "soft-capped": {"softcap": 5.0}}


class Steps:
    """Sequences advanced step by step on shuffled pages, each layer with two pools: the FlashInfer ops'
    token-major (NHD) one and the torch reference's head-major one, both fed the same projections."""

    def __init__(self, dtype: torch.dtype, flashinfer: FlashInferReference, seed: int = 0, max_batch: int = 8):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.sequences = ShuffledBlocks(BLOCKS, BLOCK, self.gen)
        self.ops = CudaOps("flashinfer")
        scale = HEAD_DIM ** -0.5
        self.ours = nn.ModuleList(PagedAttention(HEADS, KV_HEADS, HEAD_DIM, scale, self.ops, **kind)
                                  for kind in LAYERS.values())
        self.torch = [PagedAttention(HEADS, KV_HEADS, HEAD_DIM, scale, LayerOps(), **kind) for kind in LAYERS.values()]
        # What CudaBackend.prepare and capture build, on the reference module instead of FlashInfer.
        self.ops.plans = FlashInferPlans(self.ours, CPU, dtype, dtype, BLOCK, flashinfer=flashinfer)
        self.graphs = DecodeGraphs(self.ours, self.ops.plans, max_batch, max_blocks=BLOCKS)
        self.our_pools, self.torch_pools = [], []
        for _ in LAYERS:  # pools start as noise: attention must read only what the plan covers
            pool = tuple(torch.randn(pool_shape(TOKEN_MAJOR, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM),
                                     generator=self.gen).to(dtype) for _ in "kv")
            self.our_pools.append(pool)
            self.torch_pools.append(tuple(p.permute(2, 0, 1, 3).contiguous() for p in pool))
        assert self.torch_pools[0][0].shape == pool_shape(HEAD_MAJOR, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)

    def host_step(self, new_tokens: dict[str, int]):
        return self.sequences.host_step(new_tokens)

    def inputs(self, positions: torch.Tensor):
        """Projections (a strided view, as the fused QKV projection hands them over) and rotary tables."""
        wide = torch.randn(len(positions), HEADS + 2 * KV_HEADS, 2 * HEAD_DIM, generator=self.gen).to(self.dtype)
        angles = positions.float()[:, None] * torch.logspace(0, -3, HEAD_DIM // 2)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return wide[:, :, :HEAD_DIM], (angles.cos().to(self.dtype), angles.sin().to(self.dtype))

    def step(self, new_tokens: dict[str, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A step through the batch-prefill wrappers (planned as CudaBackend.forward plans them): per layer
        (ours, the torch reference's)."""
        host = self.host_step(new_tokens)
        qkv, rope = self.inputs(torch.from_numpy(host.positions))
        meta = to_device(host, CPU).meta
        self.ops.plans.plan(meta)
        return [(ours(qkv, rope, pool, meta), theirs(qkv, rope, torch_pool, to_device(host, CPU).meta))
                for ours, theirs, pool, torch_pool in zip(self.ours, self.torch, self.our_pools, self.torch_pools)]

    def graph_step(self, new_tokens: dict[str, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A pure-decode step as a decode graph replays it: its bucket's static inputs and decode wrappers,
        the padding rows copies of the last (what the graph's embedding of those rows would give)."""
        host = self.host_step(new_tokens)
        n = len(host.input_ids)
        step = to_device(host, CPU)
        bucket = self.graphs.bucket_for(step.input_ids, step.meta)
        assert bucket is not None and bucket.size >= n
        bucket.load(self.ops.plans, step.input_ids, step.positions, step.meta)
        qkv, rope = self.inputs(step.positions)
        rows = torch.arange(bucket.size).clamp(max=n - 1)
        padded_qkv, padded_rope = qkv[rows], tuple(t[rows] for t in rope)
        assert torch.equal(bucket.positions, step.positions[rows])
        results = []
        with self.graphs._decoding(bucket):
            for ours, theirs, pool, torch_pool in zip(self.ours, self.torch, self.our_pools, self.torch_pools):
                out = ours(padded_qkv, padded_rope, pool, bucket.meta(None))
                torch.testing.assert_close(out[n:], out[n - 1:n].expand(bucket.size - n, -1, -1))
                results.append((out[:n], theirs(qkv, rope, torch_pool, to_device(host, CPU).meta)))
        return results


SCENARIOS = {
    "prompts": [{"a": 37, "b": 200, "c": 16}],
    "chunked prompts, then decodes": [{"a": 100, "b": 5}, {"a": 60, "b": 30}, {"a": 1, "b": 1}, {"a": 1, "b": 1}],
    "decodes beside prompts and chunks": [{"a": 15, "b": 17}, {"a": 1, "b": 1, "c": 70},
                                          {"a": 1, "b": 1, "c": 33, "d": 3}, {"a": 1, "b": 1, "c": 1, "d": 1}],
}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=list(SCENARIOS))
def test_our_flashinfer_plans_mean_the_torch_reference_attention(scenario):
    flashinfer = FlashInferReference(extra_dtypes=(torch.float32,))  # float32 to compare at 1e-5; all else checked
    steps = Steps(torch.float32, flashinfer)
    for new_tokens in SCENARIOS[scenario]:
        for (ours, theirs), layer in zip(steps.step(new_tokens), LAYERS):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=lambda m: f"{layer}: {m}")
    for ours, theirs in zip(steps.our_pools, steps.torch_pools):
        torch.testing.assert_close(ours[1], theirs[1].permute(1, 2, 0, 3))
    # One wrapper per kind of layer, each planned once per step.
    wrappers = steps.ops.plans.wrappers
    assert set(wrappers) == {LayerKind.of(m) for m in steps.ours} and len(wrappers) == len(LAYERS)
    assert all(w.plans == len(SCENARIOS[scenario]) for w in wrappers.values())


def test_decode_graph_plans_mean_the_torch_reference_attention():
    flashinfer = FlashInferReference(extra_dtypes=(torch.float32,))
    steps = Steps(torch.float32, flashinfer, max_batch=8)
    steps.step({"a": 40, "b": 7, "c": 16})  # the prompts, through the prefill wrappers
    for new_tokens in ({"a": 1, "b": 1, "c": 1}, {"a": 1}, {"a": 1, "b": 1, "c": 1}, {"b": 1, "c": 1}):
        for (ours, theirs), layer in zip(steps.graph_step(new_tokens), LAYERS):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=lambda m: f"{layer}: {m}")
    used = [b.size for b in steps.graphs.buckets if any(w.plans for w in b.wrappers.values())]
    assert used == [1, 2, 4]  # three decodes in a bucket of 4, one in 1, two in 2


def test_bfloat16_plans_within_the_documented_dtypes():
    steps = Steps(torch.bfloat16, FlashInferReference())  # no widening
    for new_tokens in SCENARIOS["decodes beside prompts and chunks"]:
        for ours, theirs in steps.step(new_tokens):
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)


def test_float32_is_outside_the_documented_dtypes():
    with pytest.raises(ContractError, match="float16 or bfloat16"):
        Steps(torch.float32, FlashInferReference()).step({"a": 5})


def test_a_padded_decode_bucket_repeats_the_last_sequence():
    steps = Steps(torch.float32, FlashInferReference(extra_dtypes=(torch.float32,)))
    steps.step({"a": 20, "b": 33})
    seqs = to_device(steps.host_step({"a": 1, "b": 1}), CPU).meta.seqs
    seq_lens, table = padded_decodes(seqs, 4, BLOCKS)
    assert seq_lens == seqs.seq_lens_host + seqs.seq_lens_host[-1:] * 2
    assert table.shape == (4, BLOCKS) and (table[2:] == table[1]).all()
    assert (table[:2, :seqs.block_table_host.shape[1]] == seqs.block_table_host).all()


@pytest.mark.parametrize("max_batch", [1, 3, 8, 64, 100, 256, 512])
def test_decode_buckets_cover_every_batch_and_thin_out_as_they_grow(max_batch):
    buckets = batch_buckets(max_batch)
    assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == max_batch
    for n in range(1, max_batch + 1):  # every batch has a bucket: at most 7 rows of padding, or a quarter
        size = next(b for b in buckets if b >= n)
        assert size - n <= max(7, n // 4)
    if max_batch == 256:
        assert len(buckets) == 19


# ---- the reference refuses what FlashInfer's documentation forbids ---------------------------------

def _prefill_args():
    steps = Steps(torch.bfloat16, FlashInferReference())
    steps.step({"a": 20})
    host = steps.host_step({"a": 1, "b": 30})
    seqs = to_device(host, CPU).meta.seqs
    from tritonllm.devices.cuda.flashinfer_attention import paged_kv_csr

    indptr, indices, last = paged_kv_csr(seqs, BLOCK)
    return ([torch.tensor(seqs.query_start_loc_host, dtype=torch.int32), torch.from_numpy(indptr),
             torch.from_numpy(indices), torch.from_numpy(last), HEADS, KV_HEADS, HEAD_DIM, BLOCK],
            dict(causal=True, window_left=-1, logits_soft_cap=None, sm_scale=HEAD_DIM ** -0.5,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16))


PLAN_BREAKS = {
    "int64 indptr": (0, lambda t: t.long()),
    "an indptr not from 0": (0, lambda t: t + 1),
    "page indices one short": (2, lambda t: t[:-1]),
    "int64 page indices": (2, lambda t: t.long()),
    "a last page empty": (3, lambda t: t * 0),
    "a last page over page_size": (3, lambda t: t + BLOCK),
    "KV heads that do not divide the heads": (5, lambda n: 2),
    "a batch the indptrs disagree on": (1, lambda t: t[:-1]),
    "more query rows than context": (0, lambda t: t * 100),
}


@pytest.mark.parametrize("position, break_it", PLAN_BREAKS.values(), ids=list(PLAN_BREAKS))
def test_the_reference_refuses_each_broken_plan_argument(position, break_it):
    args, kwargs = _prefill_args()
    BatchPrefill = FlashInferReference().BatchPrefillWithPagedKVCacheWrapper
    workspace = torch.empty(8, dtype=torch.uint8)
    BatchPrefill(workspace, "NHD").plan(*args, **kwargs)  # as our code passes them: accepted
    broken = list(args)
    broken[position] = break_it(args[position])
    with pytest.raises(ContractError):
        BatchPrefill(workspace, "NHD").plan(*broken, **kwargs)


def test_a_captured_decode_wrapper_refuses_another_batch_size():
    flashinfer = FlashInferReference()
    workspace = torch.empty(8, dtype=torch.uint8)
    buffers = dict(paged_kv_indptr_buffer=torch.zeros(3, dtype=torch.int32),
                   paged_kv_indices_buffer=torch.zeros(4, dtype=torch.int32),
                   paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32))
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, **buffers)
    one = torch.tensor([5], dtype=torch.int32)
    wrapper.plan(torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([4, 0, 2], dtype=torch.int32),
                 torch.tensor([5, 16], dtype=torch.int32), HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    assert buffers["paged_kv_indices_buffer"][:3].tolist() == [4, 0, 2]
    with pytest.raises(ContractError, match="captured for 2"):
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4], dtype=torch.int32), one,
                     HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    with pytest.raises(ContractError, match="beyond the indices buffer"):
        wrapper.plan(torch.tensor([0, 1, 5], dtype=torch.int32), torch.arange(5, dtype=torch.int32),
                     torch.tensor([5, 16], dtype=torch.int32), HEADS, KV_HEADS, HEAD_DIM, BLOCK)
