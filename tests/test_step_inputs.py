"""Step inputs: prefix K/V copies, and what the step's arrays carry."""

from __future__ import annotations

import pytest
import torch

from tritonllm.devices.cpu.attention_rows import attention_rows
from tritonllm.scheduling.block_manager import KVCopy
from tritonllm.core.sampling_params import SamplingParams
from tritonllm.scheduling.scheduler import ScheduledSeq
from tritonllm.core.sequence import Sequence
from tritonllm.runner.step_inputs import build_host_step, copy_kv_slots, to_device

pytestmark = pytest.mark.unit


def _decodes(lengths: list[int]) -> list[ScheduledSeq]:
    items = []
    for i, n in enumerate(sorted(lengths)):
        seq = Sequence(f"r{i}", list(range(n + 1)), SamplingParams())
        seq.num_computed_tokens = n
        items.append(ScheduledSeq(seq, 1))
    return items


def test_prefix_kv_copies_read_every_source_before_writing():
    bs = 4
    pools = [(torch.randn(3, 6, bs, 8), torch.randn(3, 6, bs, 8)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in pools]
    items = []
    for i, (table, kv_copy) in enumerate([([0, 2], KVCopy(1, 2, 3)), ([5, 3], KVCopy(2, 3, 2))]):
        seq = Sequence(f"r{i}", list(range(8)), SamplingParams())
        seq.block_table, seq.num_computed_tokens = table, 4 + kv_copy.num_tokens
        items.append(ScheduledSeq(seq, 8 - seq.num_computed_tokens, [kv_copy]))
    host, _ = build_host_step(items, bs)
    assert host.kv_copy_src.tolist() == [4, 5, 6, 8, 9] and host.kv_copy_dst.tolist() == [8, 9, 10, 12, 13]
    copy_kv_slots(pools, to_device(host, torch.device("cpu")))
    for (k, v), (k0, v0) in zip(pools, before):
        for pool, old in ((k, k0), (v, v0)):
            assert torch.equal(pool[:, 2, :3], old[:, 1, :3]) and torch.equal(pool[:, 2, 3], old[:, 2, 3])
            assert torch.equal(pool[:, 3, :2], old[:, 2, :2])  # block 2's old tokens, not block 1's
            assert torch.equal(pool[:, 3, 2:], old[:, 3, 2:]) and torch.equal(pool[:, [0, 1, 4, 5]], old[:, [0, 1, 4, 5]])


def test_a_step_without_copies_has_none():
    decodes = _decodes([5, 9])
    for i, item in enumerate(decodes):
        item.seq.block_table = [3 * i, 3 * i + 1, 3 * i + 2]
    host, _ = build_host_step(decodes, 4)
    assert len(host.kv_copy_src) == 0 and to_device(host, torch.device("cpu")).kv_copy is None


def test_the_sliding_layers_own_pool_gets_its_own_slots_tables_and_copies():
    # Layer 0 attends to everything (6 blocks), layer 1 slides with a pool of its own (3 blocks): each
    # copy lands in its own pool's layers, and the sliding metadata carries that pool's slots and tables.
    bs = 4
    pools = [(torch.randn(2, 6, bs, 8), torch.randn(2, 6, bs, 8)), (torch.randn(2, 3, bs, 8), torch.randn(2, 3, bs, 8))]
    before = [(k.clone(), v.clone()) for k, v in pools]
    seq = Sequence("r", list(range(10)), SamplingParams())
    seq.block_table, seq.window_block_table, seq.num_computed_tokens = [4, 5, 1], [-1, 2, 0], 6
    copies = [KVCopy(3, 5, 2), KVCopy(1, 2, 2, window=True)]
    host, _ = build_host_step([ScheduledSeq(seq, 4, copies)], bs, window_pool=True)
    assert host.slot_mapping.tolist() == [22, 23, 4, 5] and host.window_slot_mapping.tolist() == [10, 11, 0, 1]
    step = to_device(host, torch.device("cpu"))
    assert step.meta.slot_mapping.tolist() == [22, 23, 4, 5] and step.meta.sliding.slot_mapping.tolist() == [10, 11, 0, 1]
    assert step.meta.seqs.block_table.tolist() == [[4, 5, 1]]
    assert step.meta.sliding.seqs.block_table.tolist() == [[-1, 2, 0]]  # -1: given back behind the window
    # What the CPU kernel's rows (positions 6..9) see with a window of 2: keys from position 5 on, so the
    # given-back block (positions 0..3) is behind every row's window.
    row_seq, row_end, row_start = attention_rows(step.meta.sliding.seqs, 2)
    assert row_seq.tolist() == [0] * 4 and row_end.tolist() == [7, 8, 9, 10] and row_start.tolist() == [5, 6, 7, 8]
    copy_kv_slots(pools, step, [False, True])
    for pool, old in ((pools[0][0], before[0][0]), (pools[0][1], before[0][1])):
        assert torch.equal(pool[:, 5, :2], old[:, 3, :2]) and torch.equal(pool[:, 2], old[:, 2])
    for pool, old in ((pools[1][0], before[1][0]), (pools[1][1], before[1][1])):
        assert torch.equal(pool[:, 2, :2], old[:, 1, :2]) and torch.equal(pool[:, 2, 2:], old[:, 2, 2:])


def test_each_query_row_reads_its_sequences_table_up_to_its_position():
    """The CPU attention kernel's rows (devices/cpu/attention_rows.py), from the step's lengths on the
    device: decodes one row each, then each prompt token a row of its own; made once per step and window."""
    items = _decodes([5, 9])
    seq = Sequence("p", list(range(19)), SamplingParams())
    seq.num_computed_tokens = 16
    items.append(ScheduledSeq(seq, 3))
    for i, item in enumerate(items):
        item.seq.block_table = [5 * i + j for j in range(5)]
    host, _ = build_host_step(items, 4)
    seqs = to_device(host, torch.device("cpu")).meta.seqs
    row_seq, row_end, row_start = attention_rows(seqs)
    assert row_seq.tolist() == [0, 1, 2, 2, 2] and row_end.tolist() == [6, 10, 17, 18, 19]
    assert row_start.tolist() == [0] * 5 and row_seq.dtype == row_end.dtype == row_start.dtype == torch.int32
    assert attention_rows(seqs, 8)[2].tolist() == [0, 2, 9, 10, 11]  # the last 8 positions
    assert attention_rows(seqs, 8) is attention_rows(seqs, 8) and attention_rows(seqs)[0] is row_seq
    decodes_only = to_device(build_host_step(items[:2], 4)[0], torch.device("cpu")).meta.seqs
    assert [t.tolist() for t in attention_rows(decodes_only)] == [[0, 1], [6, 10], [0, 0]]
