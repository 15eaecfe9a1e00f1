"""One step's model inputs, built on the host as numpy arrays, then moved to a device in one go.

The host form (`HostStep`) is what the scheduler rank sends to tensor-parallel workers: small,
picklable, device-free. `to_device` turns it into the tensors the model's forward reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tritonllm.layers.attention_metadata import AttentionMetadata, SequenceBatch
from tritonllm.layers.kv_layout import HEAD_MAJOR, copy_slots
from tritonllm.layers.lora import LoraBatch
from tritonllm.scheduling.block_manager import KVCopy
from tritonllm.scheduling.scheduler import ScheduledSeq



@dataclass
class HostSeqs:
    """The step's sequences as lengths and block tables (see SequenceBatch), as host arrays."""

    query_start_loc: np.ndarray  # [n + 1] int32
    seq_lens: np.ndarray  # [n] int32
    block_table: np.ndarray  # [n, max_blocks] int32
    num_decodes: int
    window_block_table: np.ndarray | None = None  # the sliding layers' own pool's tables (window pool)


@dataclass
class HostStep:
    input_ids: np.ndarray  # [num_tokens] int64: decode tokens first, then prompt chunks
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    window_slot_mapping: np.ndarray | None  # the same tokens' slots in the sliding layers' own pool, if any
    seqs: HostSeqs  # the step's sequences as lengths and block tables
    logits_rows: np.ndarray  # flat token rows whose next token is chosen this step
    # Prefix K/V copied slot to slot (block * block_size + offset) before the forward; empty: none.
    kv_copy_src: np.ndarray
    kv_copy_dst: np.ndarray
    window_kv_copy_src: np.ndarray  # ... in the sliding layers' own pool
    window_kv_copy_dst: np.ndarray
    # Multi-LoRA: (adapter slot, first row, end row) runs of the rows that use an adapter (layers/lora.py);
    # None: every row is the base model's.
    lora_segments: list[tuple[int, int, int]] | None = None


@dataclass
class TokenFeed:
    """Input rows whose token the previous step chose and the host does not have yet (async scheduling):
    the host built them with a placeholder, and `write` puts the chosen ids in their place on the device,
    in stream order after the previous step's head and before this step's forward."""

    rows: np.ndarray  # int64: this step's flat input rows
    source_rows: np.ndarray  # int64: each one's row in the previous step's output
    tokens: torch.Tensor  # the previous step's int32 [2, rows] output (head.StepTokens.packed), on the device

    def write(self, input_ids: torch.Tensor) -> None:
        device = input_ids.device
        rows, sources = host_to_device(self.rows, device), host_to_device(self.source_rows, device)
        input_ids.index_copy_(0, rows, self.tokens[0].index_select(0, sources).to(input_ids.dtype))


@dataclass
class DeviceStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    kv_copy: tuple[torch.Tensor, torch.Tensor] | None  # (source slots, destination slots)
    window_kv_copy: tuple[torch.Tensor, torch.Tensor] | None  # ... in the sliding layers' own pool


def build_host_step(scheduled: list[ScheduledSeq], block_size: int, window_pool: bool = False,
                    lora_slots: dict[str, int] | None = None) -> tuple[HostStep, list[ScheduledSeq]]:
    """The step's flat inputs, and the sequences that choose a token (in logits-row order; a sequence
    with a speculative draft once per row of it).

    The sequences reach attention as lengths and block tables (`seqs`), from which each attention
    implementation derives what its queries see (a sliding layer applies its window itself).
    `window_pool`: the sliding layers' K/V live in a pool of their own (scheduling/window_pool.py),
    with the sequences' `window_block_table`s.
    `lora_slots`: the step's adapters' slots (runner/lora_slots.py); each adapter's decodes, and its prompt
    chunks, are then neighbours, so its rows form few runs (`lora_segments`).
    """
    bs = block_size
    slot = (lambda s: lora_slots.get(s.seq.params.lora_name, -1)) if lora_slots else (lambda s: -1)
    decodes = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: (slot(s), s.seq.num_computed_tokens))
    prefills = sorted((s for s in scheduled if s.num_new_tokens > 1), key=slot)
    input_ids: list[int] = []
    logits_rows: list[int] = []
    sampled: list[ScheduledSeq] = []
    # A step's one-token decodes (most of a busy step's rows) in plain ints: numpy's per-call cost would
    # be most of the work for arrays of one element.
    one_positions: list[int] = []
    one_slots: list[int] = []
    one_window_slots: list[int] = []
    for item in decodes:  # one token each, so never a draft (a draft adds rows)
        seq, pos = item.seq, item.seq.num_computed_tokens
        item.first_row = len(input_ids)
        input_ids.append(seq.token_ids[pos])
        one_positions.append(pos)
        one_slots.append(seq.block_table[pos // bs] * bs + pos % bs)
        if window_pool:
            one_window_slots.append(seq.window_block_table[pos // bs] * bs + pos % bs)
        if item.samples:
            logits_rows.append(item.first_row)
            sampled.append(item)
    positions: list[np.ndarray] = [np.asarray(one_positions, dtype=np.int64)]
    slots: list[np.ndarray] = [np.asarray(one_slots, dtype=np.int64)]
    window_slots: list[np.ndarray] = [np.asarray(one_window_slots, dtype=np.int64)]
    for item in prefills:
        seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
        item.first_row = len(input_ids)
        input_ids.extend(seq.token_ids[start:start + n - len(item.draft)])
        input_ids.extend(item.draft)
        pos = np.arange(start, start + n)
        table = np.asarray(seq.block_table)
        positions.append(pos)
        slots.append(table[pos // bs] * bs + pos % bs)
        if window_pool:
            window_slots.append(np.asarray(seq.window_block_table)[pos // bs] * bs + pos % bs)
        if item.draft:  # every row chooses: after its last token, and after each draft token
            logits_rows.extend(range(item.first_row, len(input_ids)))
            sampled.extend([item] * n)
        elif item.samples:
            logits_rows.append(len(input_ids) - 1)
            sampled.append(item)
    host = HostStep(
        input_ids=np.asarray(input_ids, dtype=np.int64),
        positions=np.concatenate(positions).astype(np.int64),
        slot_mapping=np.concatenate(slots).astype(np.int64),
        window_slot_mapping=np.concatenate(window_slots).astype(np.int64) if window_pool else None,
        seqs=_sequences(decodes + prefills, len(decodes), bs, window_pool),
        logits_rows=np.asarray(logits_rows, dtype=np.int64),
        **_kv_copy_slots([c for s in scheduled for c in s.kv_copies], bs),
        lora_segments=_lora_segments(decodes + prefills, slot) if lora_slots else None,
    )
    return host, sampled


def _lora_segments(items: list[ScheduledSeq], slot) -> list[tuple[int, int, int]] | None:
    """(slot, first row, end row) of each run of neighbouring rows with one adapter; None if no row has one."""
    runs: list[tuple[int, int, int]] = []
    for item in items:
        s, start, end = slot(item), item.first_row, item.first_row + item.num_new_tokens
        if s < 0:
            continue
        if runs and runs[-1][0] == s and runs[-1][2] == start:
            runs[-1] = (s, runs[-1][1], end)
        else:
            runs.append((s, start, end))
    return runs or None


def _sequences(items: list[ScheduledSeq], num_decodes: int, bs: int, window_pool: bool) -> HostSeqs:
    q_lens = [it.num_new_tokens for it in items]
    seq_lens = [it.seq.num_computed_tokens + n for it, n in zip(items, q_lens)]
    max_blocks = max(-(-n // bs) for n in seq_lens)

    def tables(of) -> np.ndarray:
        out = np.zeros((len(items), max_blocks), dtype=np.int32)
        for i, (it, n) in enumerate(zip(items, seq_lens)):
            row = of(it.seq)[:-(-n // bs)]
            out[i, :len(row)] = row  # -1: a block given back (behind a window, or pruned by kv_window)
        return out

    return HostSeqs(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32), np.asarray(seq_lens, dtype=np.int32),
                    tables(lambda seq: seq.block_table), num_decodes,
                    tables(lambda seq: seq.window_block_table) if window_pool else None)


def _kv_copy_slots(copies: list[KVCopy], bs: int) -> dict[str, np.ndarray]:
    slots = {}
    for prefix, in_window_pool in (("", False), ("window_", True)):
        pool = [c for c in copies if c.window == in_window_pool]
        src = [np.arange(c.num_tokens) + c.src * bs for c in pool]
        dst = [np.arange(c.num_tokens) + c.dst * bs for c in pool]
        empty = np.zeros(0, dtype=np.int64)
        slots[f"{prefix}kv_copy_src"] = np.concatenate(src).astype(np.int64) if pool else empty
        slots[f"{prefix}kv_copy_dst"] = np.concatenate(dst).astype(np.int64) if pool else empty
    return slots


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`, without waiting for the device's queued work: an accelerator's copy comes
    from page-locked memory of its own (a copy from pageable memory may wait for the stream; a staging
    buffer reused by the next step could be overwritten before this copy has run)."""
    tensor = torch.from_numpy(array)
    if device.type != "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def to_device(host: HostStep, device: torch.device) -> DeviceStep:
    def to(array: np.ndarray) -> torch.Tensor:
        return host_to_device(array, device)

    def sequences(s: HostSeqs, sliding: bool = False) -> SequenceBatch:
        tables = s.window_block_table if sliding and s.window_block_table is not None else s.block_table
        return SequenceBatch(to(s.query_start_loc), to(s.seq_lens), to(tables), s.num_decodes,
                             s.query_start_loc.tolist(), s.seq_lens.tolist(), tables)

    def metadata(sliding: bool = False) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=window_slot_mapping if sliding and window_slot_mapping is not None else slot_mapping,
            seqs=sequences(host.seqs, sliding),
        )

    slot_mapping = to(host.slot_mapping)
    window_slot_mapping = None if host.window_slot_mapping is None else to(host.window_slot_mapping)
    meta = metadata()
    if window_slot_mapping is not None:  # the sliding layers' own pool: its slots and tables
        meta.sliding = metadata(sliding=True)
    kv_copy = (to(host.kv_copy_src), to(host.kv_copy_dst)) if len(host.kv_copy_src) else None
    window_kv_copy = (to(host.window_kv_copy_src), to(host.window_kv_copy_dst)) if len(host.window_kv_copy_src) else None
    if host.lora_segments:
        meta.lora = LoraBatch(host.lora_segments)
    return DeviceStep(to(host.input_ids), to(host.positions), meta, to(host.logits_rows), kv_copy, window_kv_copy)


def copy_kv_slots(kv_caches, step: DeviceStep, window_pool_layers: list[bool] | None = None,
                  layout: str = HEAD_MAJOR) -> None:
    """Run a step's prefix K/V copies in every layer's pool (laid out as `layout`, layers/kv_layout.py):
    the window pool's copies in the layers whose K/V live there (`window_pool_layers`), the others'
    in the rest.

    All sources are read before any destination is written, so a block that is one copy's source
    and, handed out again in the same step, another's destination still gives its old contents.
    """
    for i, (k, v) in enumerate(kv_caches):
        copy = step.window_kv_copy if window_pool_layers and window_pool_layers[i] else step.kv_copy
        if copy is None:
            continue
        src, dst = copy
        for pool in (k, v):
            copy_slots(pool, src, dst, layout)
