"""CUDA graphs of pure-decode steps, one per batch-size bucket, captured at load and replayed.

A small model's decode step is hundreds of short kernels; launching them one by one from Python
costs more than running them. A graph launches the whole step at once. Each bucket's graph reads its
inputs from static buffers: a step of n decodes takes the smallest bucket of at least n, its rows
copied in and the remaining rows filled with copies of its last one (the same token, position and KV
slot, so they write the same K/V to the same place and their outputs are dropped). Attention in a
graph runs FlashInfer's decode wrappers planned on fixed buffers, re-planned on the host before each
replay (FlashInfer's own CUDA-graph mode).
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch
from torch import nn

from tritonllm.core.tracing import span
from tritonllm.devices.cuda.flashinfer_attention import FlashInferPlans, paged_kv_csr
from tritonllm.layers.attention_metadata import AttentionMetadata, SequenceBatch

logger = logging.getLogger(__name__)


def padded_decodes(seqs: SequenceBatch, size: int, max_blocks: int) -> tuple[list[int], np.ndarray]:
    """A step's decodes as a bucket of `size` rows plans them: (context lengths, block tables [size,
    max_blocks]), each row past the step's own a copy of its last (the padding rows of `_Bucket.load`)."""
    n = len(seqs.seq_lens_host)
    seq_lens = seqs.seq_lens_host + seqs.seq_lens_host[-1:] * (size - n)
    table = np.zeros((size, max_blocks), dtype=np.int32)
    table[:n, :seqs.block_table_host.shape[1]] = seqs.block_table_host
    table[n:] = table[n - 1]
    return seq_lens, table


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every 8 up to 64, every 16 up to 128, every 32 beyond (and `max_batch` itself): each
    graph costs start-up time to capture, and a padded row costs a large batch less than a small one (the
    step reads the same weights), so the buckets thin out as they grow."""
    buckets = ([1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 128, 16)) + list(range(128, max_batch, 32)))
    return sorted({b for b in buckets if b < max_batch} | {max_batch})


class _Bucket:
    """One captured batch size: its static inputs, decode wrappers and graph."""

    def __init__(self, size: int, max_blocks: int, plans: FlashInferPlans, device: torch.device):
        flashinfer = plans.flashinfer
        self.size, self.max_blocks = size, max_blocks
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(size, dtype=torch.int64, device=device)
        self.wrappers = {}
        for kind in plans.wrappers:
            # Tensor cores: FlashInfer's decode kernels without them take only some query/KV head ratios.
            self.wrappers[kind] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                plans.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(size * max_blocks, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=device))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None

    def meta(self, seqs: SequenceBatch) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping, seqs=seqs)

    def load(self, plans: FlashInferPlans, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> None:
        """A step of up to `size` decodes into the static inputs, the rows past it copies of its last one
        (the same token, position and KV slot: they write the same K/V to the same place), and its
        attention planned on those rows."""
        n, pad = len(input_ids), self.size - len(input_ids)
        for static, value in ((self.input_ids, input_ids), (self.positions, positions),
                              (self.slot_mapping, meta.slot_mapping)):
            static[:n].copy_(value)
            if pad:
                static[n:].copy_(value[-1:].expand(pad))
        self.plan(plans, *padded_decodes(meta.seqs, self.size, self.max_blocks))

    def plan(self, plans: FlashInferPlans, seq_lens: list[int], block_table: np.ndarray) -> None:
        seqs = SequenceBatch(query_start_loc=None, seq_lens=None, block_table=None, num_decodes=self.size,
                             query_start_loc_host=list(range(self.size + 1)), seq_lens_host=seq_lens,
                             block_table_host=block_table)
        indptr, indices, last_page_len = paged_kv_csr(seqs, plans.block_size)
        for kind, wrapper in self.wrappers.items():
            wrapper.plan(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last_page_len),
                         kind.num_heads, kind.num_kv_heads, kind.head_dim, plans.block_size,
                         window_left=-1 if kind.window is None else kind.window - 1,
                         logits_soft_cap=kind.softcap, sm_scale=kind.scale, q_data_type=plans.dtype,
                         kv_data_type=plans.kv_dtype)


class DecodeGraphs:
    """Captures the buckets' graphs (`capture`) and replays them for pure-decode steps (`run`)."""

    def __init__(self, model: nn.Module, plans: FlashInferPlans, max_batch: int, max_blocks: int):
        self.model, self.plans = model, plans
        self.buckets = [_Bucket(b, max_blocks, plans, plans.device) for b in batch_buckets(max_batch)]
        self.max_batch = max_batch
        # What the steps did with the graphs, for benchmarks' breakdowns: how many replayed, and the host's
        # time loading and planning a bucket, then launching its replay.
        self.replays, self.load_seconds, self.replay_seconds = 0, 0.0, 0.0

    def capture(self, kv_caches) -> None:
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):  # the largest first: the smaller ones reuse its memory
            seq_lens = [1] * bucket.size
            block_table = np.zeros((bucket.size, bucket.max_blocks), dtype=np.int32)
            bucket.plan(self.plans, seq_lens, block_table)
            meta = bucket.meta(None)
            with self._decoding(bucket):
                # Warm-up on a side stream, as torch's graph capture asks: libraries allocate their
                # workspaces on first use, which must not happen inside the capture.
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.model(bucket.input_ids, bucket.positions, kv_caches, meta)
                torch.cuda.current_stream().wait_stream(side)
                bucket.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(bucket.graph, pool=pool):
                    bucket.hidden = self.model(bucket.input_ids, bucket.positions, kv_caches, meta)
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs (batch %s) in %.1f s", len(self.buckets),
                    ", ".join(str(b.size) for b in self.buckets), time.perf_counter() - started)

    @contextlib.contextmanager
    def _decoding(self, bucket: _Bucket):
        """While capturing `bucket`, every layer runs its kind's decode wrapper."""
        self.plans.active = bucket.wrappers
        try:
            yield
        finally:
            self.plans.active = None

    def bucket_for(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> _Bucket | None:
        """The bucket a step replays in, or None where no graph applies (a step with a prompt chunk, or
        more decodes than the largest bucket)."""
        seqs = meta.seqs
        if seqs is None or meta.sliding is not None:
            return None
        n = len(seqs.seq_lens_host)
        if seqs.num_decodes != n or n != len(input_ids) or n > self.max_batch:
            return None
        return next(b for b in self.buckets if b.size >= n)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's final hidden states from a graph, or None where no graph applies (`bucket_for`)."""
        bucket = self.bucket_for(input_ids, meta)
        if bucket is None:
            return None
        started = time.perf_counter()
        with span("graph.load_and_plan"):
            bucket.load(self.plans, input_ids, positions, meta)
        loaded = time.perf_counter()
        with span("graph.replay"):
            bucket.graph.replay()
        self.replays += 1
        self.load_seconds += loaded - started
        self.replay_seconds += time.perf_counter() - loaded
        return bucket.hidden[:len(input_ids)]
