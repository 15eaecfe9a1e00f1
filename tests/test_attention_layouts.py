"""A step's sequences as lengths and block tables, and the two KV pool layouts.

The torch reference reads lengths and block tables from head-major pools; the accelerators' kernels
(FlashInfer on CUDA, torch_npu on Ascend) read the same from token-major pools. Those kernels only
run on their devices; here the lengths, tables and layouts they are given, and the torch reference
itself, are checked against attention computed sequence by sequence, on the CPU.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tritonllm.devices.cuda.flashinfer_attention import paged_kv_csr
from tritonllm.core.sampling_params import SamplingParams
from tritonllm.core.sequence import Sequence
from tritonllm.layers.attention import GROUP_COST_BLOCKS, decode_groups, paged_attention
from tritonllm.layers.kv_layout import HEAD_MAJOR, TOKEN_MAJOR, by_slot, copy_slots, pool_shape, write_kv
from tritonllm.runner.step_inputs import build_host_step, to_device
from tritonllm.scheduling.scheduler import ScheduledSeq

pytestmark = pytest.mark.unit

BLOCK, KV_HEADS, HEADS, HEAD_DIM, BLOCKS = 16, 3, 9, 32, 96


def step(computed_and_new: list[tuple[int, int]], seed: int = 0):
    """Scheduled sequences with `computed` tokens in the cache and `new` fed this step, on random blocks."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(BLOCKS, generator=gen).tolist()
    scheduled = []
    for i, (computed, new) in enumerate(computed_and_new):
        seq = Sequence(f"s{i}", list(range(computed + new)), SamplingParams())
        seq.num_computed_tokens = computed
        seq.block_table = [free.pop() for _ in range(-(-(computed + new) // BLOCK))]
        scheduled.append(ScheduledSeq(seq, new))
    return scheduled


def attention_from_sequences(q, k_cache, v_cache, seqs, scale):
    """Causal attention of each sequence's new tokens over its whole context, read through its block
    table from a token-major pool: what the accelerators' kernels compute from the same inputs."""
    out = torch.empty_like(q)
    per_kv = HEADS // KV_HEADS
    for i, (start, end) in enumerate(zip(seqs.query_start_loc_host, seqs.query_start_loc_host[1:])):
        length = seqs.seq_lens_host[i]
        blocks = seqs.block_table_host[i, :-(-length // BLOCK)]
        keys = k_cache[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:length].repeat_interleave(per_kv, dim=1)
        values = v_cache[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:length].repeat_interleave(per_kv, dim=1)
        positions = torch.arange(length - (end - start), length)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * scale
        scores.masked_fill_(torch.arange(length)[None, None, :] > positions[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
    return out


@pytest.mark.parametrize("computed_and_new", [
    [(5, 1), (40, 1), (0, 37)],  # decodes, then a prompt
    [(16, 30), (0, 5), (33, 17)],  # prompt chunks after cached prefixes
    [(3, 1), (0, 1)],  # decodes only, one of a first token
])
def test_the_reference_on_lengths_and_tables_is_attention_of_each_sequence_over_its_blocks(computed_and_new):
    scheduled = step(computed_and_new)
    host, _ = build_host_step(scheduled, BLOCK)
    meta = to_device(host, torch.device("cpu")).meta
    seqs = meta.seqs
    assert seqs.num_decodes == sum(1 for _, new in computed_and_new if new == 1)
    gen = torch.Generator().manual_seed(1)
    num_tokens = len(host.input_ids)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    # The same K/V in both layouts: every slot of the pools, then this step's tokens written on top.
    head_major = [torch.randn(pool_shape(HEAD_MAJOR, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), generator=gen) for _ in "kv"]
    token_major = [p.permute(1, 2, 0, 3).contiguous() for p in head_major]
    assert token_major[0].shape == pool_shape(TOKEN_MAJOR, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    new_k, new_v = torch.randn(2, num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    slots = torch.from_numpy(host.slot_mapping)
    write_kv(*head_major, new_k, new_v, slots, HEAD_MAJOR)
    write_kv(*token_major, new_k, new_v, slots, TOKEN_MAJOR)
    torch.testing.assert_close(token_major[0], head_major[0].permute(1, 2, 0, 3))
    scale = HEAD_DIM ** -0.5
    expected = attention_from_sequences(q, *token_major, seqs, scale)
    got = paged_attention(q, *head_major, seqs, scale)  # the torch reference, on the head-major pool
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_flashinfer_page_table_lists_each_sequences_pages_and_its_last_pages_fill():
    scheduled = step([(5, 1), (31, 1), (16, 17)])
    host, _ = build_host_step(scheduled, BLOCK)
    seqs = to_device(host, torch.device("cpu")).meta.seqs
    indptr, indices, last_page_len = paged_kv_csr(seqs, BLOCK)
    assert indptr.tolist() == [0, 1, 3, 6]
    assert indices.tolist() == [b for item in scheduled for b in item.seq.block_table]
    assert last_page_len.tolist() == [6, 16, 1]


@pytest.mark.parametrize("layout", [HEAD_MAJOR, TOKEN_MAJOR])
def test_slot_copies_read_every_source_before_writing(layout):
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(pool_shape(layout, 8, 4, 2, 8), generator=gen)
    before = by_slot(pool, layout).clone()
    src, dst = torch.tensor([0, 1, 5]), torch.tensor([5, 6, 7])  # slot 5 is read and written
    copy_slots(pool, src, dst, layout)
    after = by_slot(pool, layout)
    picked = (lambda t, i: t[:, i]) if layout == HEAD_MAJOR else (lambda t, i: t[i])
    torch.testing.assert_close(picked(after, dst), picked(before, src))


def _cost(blocks: list[int], bounds: list[tuple[int, int]]) -> int:
    return sum((j - i) * blocks[j - 1] + GROUP_COST_BLOCKS for i, j in bounds)


def test_decode_groups_cover_every_decode_in_order():
    blocks = sorted([1, 3, 3, 19, 20, 57, 57, 57, 2, 2])
    bounds = decode_groups(blocks, 4)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(blocks)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_decode_groups_are_the_cheapest_cuts():
    rng = random.Random(0)
    for _ in range(20):
        blocks = sorted(rng.randint(1, 125) for _ in range(rng.randint(1, 9)))
        n = len(blocks)
        best = min(_cost(blocks, list(zip((0,) + cuts, cuts + (n,))))
                   for k in range(0, min(3, n - 1) + 1) for cuts in itertools.combinations(range(1, n), k))
        assert _cost(blocks, decode_groups(blocks, 4)) == best


def test_one_decode_group_when_asked_or_when_lengths_are_alike():
    assert len(decode_groups([1, 32, 63, 94] * 4, 1)) == 1
    assert len(decode_groups([7] * 64, 4)) == 1
    assert decode_groups([], 4) == []
