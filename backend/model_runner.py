"""The only code that touches the device: KV pool, step inputs, forward, fused head, warm-up."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import device as devices
from .config import EngineConfig
from .layers.attention import AttentionGroup, AttentionMetadata
from .loader import load_model
from .sampler import SamplingBatch, choose_tokens, unpack_tokens
from .scheduler import ScheduledSeq

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # flat token rows whose next token is chosen this step
    sampled: list[ScheduledSeq]  # in the order of logits_rows
    sampling: SamplingBatch


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, eos_token_ids: set[int]):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = sorted(eos_token_ids)
        devices.set_device(device)
        started = time.perf_counter()
        self.model = load_model(model_dir, dtype, device, max_position=max_model_len)
        logger.info("loaded %s (%s, %s) in %.1f s", model_dir, device, dtype, time.perf_counter() - started)
        m = self.model
        self.kv_bytes_per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * torch.tensor([], dtype=dtype).element_size()
        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory()
        shape = (self.num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        # Zeroed, not empty: attention reads whole blocks, and a NaN left in memory under a masked
        # position would still poison the weighted sum (0 * NaN).
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(m.num_layers)]
        logger.info("KV pool: %d blocks x %d tokens (%.1f MiB, %d bytes/token); max concurrency at max_model_len=%d: %.1f",
                    self.num_blocks, self.block_size, self.num_blocks * self.block_size * self.kv_bytes_per_token / 2**20,
                    self.kv_bytes_per_token, max_model_len, self.num_blocks * self.block_size / max_model_len)

    def _blocks_from_memory(self) -> int:
        free = devices.free_memory_bytes(self.device)
        budget = int(free * self.config.kv_cache_memory_fraction)
        if self.device.type == "cpu":
            budget = min(budget, self.config.kv_cache_max_bytes)
        # Reserve room for the largest step's activations: hidden-sized buffers per batched
        # token, and float32 logits (plus softmax temporaries) per sampled sequence.
        cfg = self.model.config
        budget -= self.config.max_num_batched_tokens * 16 * (cfg.hidden_size + cfg.intermediate_size) * 4
        budget -= self.config.max_num_seqs * cfg.vocab_size * 4 * 3
        blocks = budget // (self.block_size * self.kv_bytes_per_token)
        need = -(-self.max_model_len // self.block_size)
        if blocks < need:
            raise RuntimeError(f"not enough memory for one sequence of max_model_len={self.max_model_len}: "
                               f"{budget} bytes give {blocks} KV blocks, {need} needed")
        return int(blocks)

    # ---- inputs ------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        bs = self.block_size
        decodes = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.seq.num_computed_tokens)
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        for item in decodes + prefills:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            if item.samples:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(item)
        to = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to(np.concatenate(slots)),
            decode=[self._group(part, offset) for part, offset in self._split_by_length(decodes)],
            prefill=self._group(prefills, len(decodes)) if prefills else None,
        )
        return StepInputs(
            input_ids=to(np.asarray(input_ids, dtype=np.int64)),
            positions=to(np.concatenate(positions)),
            meta=meta,
            logits_rows=to(np.asarray(logits_rows, dtype=np.int64)),
            sampled=sampled,
            sampling=self._sampling_batch(sampled),
        )

    def _split_by_length(self, decodes: list[ScheduledSeq]) -> list[tuple[list[ScheduledSeq], int]]:
        """Cut the length-sorted decodes in two where that most reduces the blocks gathered.

        Every sequence of a group is padded to the group's longest context: with mixed lengths
        one group gathers far more K/V than the sequences hold. A second group costs one more
        attention call per layer, so it is only used when it saves at least a fifth of the gather.
        """
        if len(decodes) < 8:
            return [(decodes, 0)] if decodes else []
        blocks = [-(-(d.seq.num_computed_tokens + 1) // self.block_size) for d in decodes]
        n = len(blocks)
        whole = n * blocks[-1]
        best_cost, best_cut = whole, n
        for cut in range(4, n - 3):
            cost = cut * blocks[cut - 1] + (n - cut) * blocks[-1]
            if cost < best_cost:
                best_cost, best_cut = cost, cut
        if best_cost > 0.8 * whole:
            return [(decodes, 0)]
        return [(decodes[:best_cut], 0), (decodes[best_cut:], best_cut)]

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _group(self, items: list[ScheduledSeq], token_offset: int) -> AttentionGroup:
        bs = self.block_size
        batch = len(items)
        q_lens = [it.num_new_tokens for it in items]
        starts = [it.seq.num_computed_tokens for it in items]
        max_blocks = max(-(-(s + n) // bs) for s, n in zip(starts, q_lens))
        tables = np.zeros((batch, max_blocks), dtype=np.int64)
        valid = np.zeros((batch, max_blocks), dtype=bool)
        for i, it in enumerate(items):
            row = np.asarray(it.seq.block_table[:max_blocks])
            tables[i, :len(row)] = np.maximum(row, 0)
            valid[i, :len(row)] = row >= 0
        width = max_blocks * bs
        key_pos = np.arange(width)
        key_ok = np.repeat(valid, bs, axis=1)  # [batch, width]: block still holds its K/V
        max_q = max(q_lens)
        q_pos = np.asarray(starts)[:, None] + np.arange(max_q)[None, :]  # [batch, max_q]
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & key_ok[:, None, :]
        query_index = output_index = None
        if batch > 1 and max_q > 1:
            offsets = token_offset + np.concatenate([[0], np.cumsum(q_lens)[:-1]])
            j = np.arange(max_q)[None, :]
            real = j < np.asarray(q_lens)[:, None]
            query_index = to_idx = offsets[:, None] + np.minimum(j, np.asarray(q_lens)[:, None] - 1)
            mask[~real] = False
            mask[~real, 0] = True  # padding rows attend somewhere: no NaN from an empty softmax
            output_index = np.flatnonzero(real.reshape(-1))
            query_index = self._to_device(to_idx)
            output_index = self._to_device(output_index)
        return AttentionGroup(
            block_tables=self._to_device(tables),
            mask=self._to_device(mask[:, None, :, :]),
            query_index=query_index,
            output_index=output_index,
            token_offset=token_offset,
            num_tokens=sum(q_lens),
        )

    def _sampling_batch(self, sampled: list[ScheduledSeq]) -> SamplingBatch:
        batch = SamplingBatch()
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, item in enumerate(sampled):
            p = item.seq.params
            if item.seq.num_output_tokens < p.min_tokens:
                ban = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                banned_rows.extend([row] * len(ban))
                banned_ids.extend(ban)
        if banned_rows:
            batch.banned_rows = self._to_device(np.asarray(banned_rows, dtype=np.int64))
            batch.banned_ids = self._to_device(np.asarray(banned_ids, dtype=np.int64))
        if any(not it.seq.params.greedy for it in sampled):
            ps = [it.seq.params for it in sampled]
            batch.temperatures = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=self.device)
            vocab = self.model.config.vocab_size  # a top_k beyond the vocabulary means no limit
            batch.top_k = torch.tensor([min(p.top_k, vocab) for p in ps], dtype=torch.int64, device=self.device)
            batch.top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=self.device)
            batch.generators = [self._generator(it) for it in sampled]
        return batch

    def _generator(self, item: ScheduledSeq):
        seed = item.seq.params.seed
        if seed is None or item.seq.params.greedy:
            return None
        # Seeded per (seed, position): a preempted and recomputed request samples the same tokens.
        gen = torch.Generator(device=self.device)
        gen.manual_seed((seed * 1_000_003 + item.seq.num_tokens) % 2**64)  # any Python int seed
        return gen

    # ---- execution ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> tuple[list[int], list[float]]:
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampled:
            return [], []
        logits = self.model.compute_logits(hidden[inputs.logits_rows])
        packed = choose_tokens(logits, inputs.sampling)
        return unpack_tokens(packed.cpu().numpy())  # the step's one device -> host transfer

    def forward_dummy(self, num_tokens_per_seq: list[int]) -> None:
        """Warm-up: one forward over throw-away sequences written into unallocated blocks."""
        from .sampling_params import SamplingParams
        from .sequence import Sequence

        bs = self.block_size
        next_block = 0
        items = []
        for i, n in enumerate(num_tokens_per_seq):
            seq = Sequence(f"warmup-{i}", [0] * n, SamplingParams(max_tokens=1))
            nb = -(-n // bs)
            seq.block_table = list(range(next_block, next_block + nb))
            next_block += nb
            items.append(ScheduledSeq(seq, n))
        if next_block > self.num_blocks:
            return
        self.execute(self.prepare(items))
        devices.synchronize(self.device)
