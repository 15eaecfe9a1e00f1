"""The only code that touches the device: KV pool, step inputs, forward, fused head, warm-up.

With tensor_parallel_size > 1 this process is rank 0: it runs its own shard and sends each step's
host inputs to the worker ranks (tp_workers.py) before running it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tritonllm.devices.cpu import kernels as cpu_kernels
from tritonllm.devices import platform as devices
from tritonllm.engine.config import EngineConfig
from tritonllm.models.loader import load_hf_config, load_model
from tritonllm.runner.logit_adjustments import LogitAdjustments
from tritonllm.runner.prompt_logprobs import positions_to_score, score_prompts
from tritonllm.runner.sampler import SamplingBatch, choose_tokens, ranking_logprobs, top_logprobs, unpack_tokens
from tritonllm.scheduling.scheduler import ScheduledSeq
from tritonllm.runner.step_inputs import MAX_DECODE_GROUPS, DeviceStep, HostStep, build_host_step, copy_kv_slots, to_device
from tritonllm.scheduling.window_pool import window_pool_blocks_per_sequence
from tritonllm.parallel.shard import TPShard, check_shardable, rank_device
from tritonllm.parallel.workers import TensorParallelError, TensorParallelWorkers, WorkerSpec, make_store, new_process_group

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    host: HostStep  # what tensor-parallel workers receive
    device: DeviceStep
    sampled: list[ScheduledSeq]  # in the order of logits_rows
    sampling: SamplingBatch
    scored: list[ScheduledSeq]  # sequences whose prompt positions this step scores (prompt_logprobs.py)


def allocate_kv_pool(model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                     num_window_blocks: int = 0):
    """Per layer (K, V), each [kv_heads on this rank, blocks, block_size, head_dim] (head-major: see
    layers/attention.py): `num_window_blocks` blocks for the layers whose K/V live in the window pool
    (`model.window_pool_layers`, window_pool.py), `num_blocks` for the others.

    Zeroed, not empty: attention reads whole blocks, and a NaN left in memory under a masked
    position would still poison the weighted sum (0 * NaN).
    """
    def pool(blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (model.num_kv_heads, blocks, block_size, model.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    in_window_pool = model.window_pool_layers if num_window_blocks else None
    return [pool(num_window_blocks if in_window_pool and in_window_pool[i] else num_blocks) for i in range(model.num_layers)]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, eos_token_ids: set[int]):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = devices.resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = sorted(eos_token_ids)
        self.tp_size = config.tensor_parallel_size
        self.workers: TensorParallelWorkers | None = None
        self._threads_before = 0
        devices.set_device(device)
        started = time.perf_counter()
        self.tp = TPShard(0, self.tp_size)
        try:
            if self.tp_size > 1:
                check_shardable(load_hf_config(model_dir).num_key_value_heads, self.tp_size)
                if device.type == "cpu":  # the ranks share this machine's cores (restored by close())
                    self._threads_before = torch.get_num_threads()
                    torch.set_num_threads(self._threads_per_rank())
                self.workers = TensorParallelWorkers([self._worker_spec(model_dir, r) for r in range(1, self.tp_size)])
            self.model = load_model(model_dir, dtype, device, max_position=max_model_len, tp=self.tp,
                                    cpu_gemm=config.cpu_gemm, batch_hint=config.max_num_seqs,
                                    greedy_screen=config.greedy_screen and config.cpu_kernels,
                                    exact_blocks=config.exact_block_weights, amx=config.amx_gemm)
            logger.info("loaded %s (%s, %s, tensor-parallel rank 0 of %d) in %.1f s", model_dir, device, dtype,
                        self.tp_size, time.perf_counter() - started)
            m = self.model
            # A token's K/V in the main pool, and in the window pool where the sliding layers have one: a
            # token within the window holds both, one behind it only the first.
            layer_bytes = 2 * m.num_kv_heads * m.head_dim * self.kv_dtype.itemsize
            self.window_pool_layers = m.window_pool_layers if config.window_pool else None
            num_window_layers = sum(self.window_pool_layers or [])
            self.kv_bytes_per_token = (m.num_layers - num_window_layers) * layer_bytes
            self.window_kv_bytes_per_token = num_window_layers * layer_bytes
            self.window_blocks_per_seq = 0 if not num_window_layers else window_pool_blocks_per_sequence(
                m.attention_window, config.max_num_batched_tokens, max_model_len, self.block_size)
            if config.num_kv_blocks:
                self.num_blocks = config.num_kv_blocks
                self.num_window_blocks = self._window_pool_blocks(config.num_kv_blocks)
            else:
                self.num_blocks, self.num_window_blocks = self._blocks_from_memory()
            if self.workers is not None:
                self._connect_workers()
        except BaseException:
            self.close()
            raise
        self.kv_caches = allocate_kv_pool(m, self.num_blocks, self.block_size, self.kv_dtype, device, self.num_window_blocks)
        # Our C++ CPU kernels where they apply and build (decode attention reading K/V in place, the
        # layers' fused elementwise ops, the greedy head); one decode group then (the kernel skips
        # padding instead of gathering it), else up to four.
        self.use_cpu_kernels = cpu_kernels.use_for(config.cpu_kernels, device, dtype)
        self.max_decode_groups = 1 if self.use_cpu_kernels else MAX_DECODE_GROUPS
        logger.info("kernels: %s", "our C++ CPU kernels" if self.use_cpu_kernels
                    else "torch (decode attention as gather + batched GEMMs)")
        logger.info("KV pool: %d blocks x %d tokens, %s (%.1f MiB, %d bytes/token on this rank)%s; max concurrency "
                    "at max_model_len=%d: %.1f", self.num_blocks, self.block_size, str(self.kv_dtype).removeprefix("torch."),
                    self.num_blocks * self.block_size * self.kv_bytes_per_token / 2**20, self.kv_bytes_per_token,
                    self._window_pool_description(), max_model_len, self.max_concurrency)

    # ---- tensor parallelism ------------------------------------------------------------------
    def _threads_per_rank(self) -> int:
        return self.config.num_threads or max(1, (os.cpu_count() or 1) // self.tp_size)

    def _worker_spec(self, model_dir: Path, rank: int) -> WorkerSpec:
        threads = self._threads_per_rank() if self.device.type == "cpu" else 0
        return WorkerSpec(model_dir=str(model_dir), dtype=str(self.dtype).removeprefix("torch."),
                          kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
                          device=str(rank_device(self.device, rank)), max_model_len=self.max_model_len,
                          rank=rank, world_size=self.tp_size, num_threads=threads, block_size=self.block_size,
                          cpu_gemm=self.config.cpu_gemm, batch_hint=self.config.max_num_seqs,
                          cpu_kernels=self.config.cpu_kernels, exact_blocks=self.config.exact_block_weights,
                          amx=self.config.amx_gemm)

    def _connect_workers(self) -> None:
        self.workers.wait_loaded()
        store = make_store(0, self.tp_size, is_master=True)
        self.workers.connect(store.port, self.num_blocks, self.num_window_blocks)
        self.tp.group = new_process_group(self.device, 0, self.tp_size, store)
        self._store = store  # the rendezvous store lives as long as the group

    @property
    def failure(self) -> str | None:
        """Why the model can no longer run (a tensor-parallel worker died), or None."""
        return self.workers.failure if self.workers is not None else None

    def close(self) -> None:
        """Stop tensor-parallel workers and leave the process group (nothing to do on one rank)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
            self.tp.group = None
        if self._threads_before:  # also when the workers never started
            torch.set_num_threads(self._threads_before)
            self._threads_before = 0

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len tokens the pools hold at once (the window pool limits it only
        where it holds fewer than max_num_seqs sequences' windows)."""
        full = self.num_blocks * self.block_size / self.max_model_len
        if not self.window_blocks_per_seq:
            return full
        windows = self.num_window_blocks / self.window_blocks_per_seq
        return full if windows >= self.config.max_num_seqs else min(full, windows)

    def _window_pool_description(self) -> str:
        if not self.window_blocks_per_seq:
            return ""
        mib = self.num_window_blocks * self.block_size * self.window_kv_bytes_per_token / 2**20
        return (f"; window pool for {sum(self.window_pool_layers)} sliding layers (window "
                f"{self.model.attention_window}): {self.num_window_blocks} blocks ({mib:.1f} MiB, "
                f"{self.window_kv_bytes_per_token} bytes/token, at most {self.window_blocks_per_seq} a sequence)")

    def _window_pool_blocks(self, num_blocks: int) -> int:
        """The window pool's size beside `num_blocks` (one pool of every layer would have as many): what
        num_window_kv_blocks says, else room for max_num_seqs sequences' windows, never more than
        `num_blocks` (no sequence holds more blocks there than in the main pool). So by default no
        workload fits fewer sequences than in one pool; where memory is short of max_num_seqs windows,
        the pools are then as one pool would be, and a smaller num_window_kv_blocks trades sequences
        shorter than the window for more long ones."""
        if not self.window_blocks_per_seq:
            return 0
        if self.config.num_window_kv_blocks:
            if self.config.num_window_kv_blocks < self.window_blocks_per_seq:
                raise RuntimeError(f"num_window_kv_blocks={self.config.num_window_kv_blocks} cannot hold one sequence's "
                                   f"window: at least {self.window_blocks_per_seq} blocks (sliding_window "
                                   f"{self.model.attention_window} + max_num_batched_tokens, in blocks, and one at each end)")
            return self.config.num_window_kv_blocks
        return min(self.config.max_num_seqs * self.window_blocks_per_seq, num_blocks)

    def _blocks_from_memory(self) -> tuple[int, int]:
        """The main pool's blocks and the window pool's from the memory budget. The window pool takes what
        it would take beside one pool of every layer (`_window_pool_blocks`), the main pool the rest."""
        free = devices.free_memory_bytes(self.device)
        budget = int(free * self.config.kv_cache_memory_fraction)
        bytes_per_token = self.kv_bytes_per_token + self.window_kv_bytes_per_token
        ranks = 1
        if self.device.type == "cpu":
            budget = min(budget, self.config.kv_cache_max_bytes)
            ranks = self.tp_size  # every rank's pool lives in the same host memory
        bytes_per_token *= ranks
        # Reserve room for the largest step's activations: hidden-sized buffers per batched
        # token, and float32 logits (plus softmax temporaries) per sampled sequence.
        cfg = self.model.config
        budget -= self.config.max_num_batched_tokens * 16 * (cfg.hidden_size + cfg.intermediate_size) * 4
        budget -= self.config.max_num_seqs * cfg.vocab_size * 4 * 3
        blocks = budget // (self.block_size * bytes_per_token)
        need = -(-self.max_model_len // self.block_size)
        if blocks < need:
            raise RuntimeError(f"not enough memory for one sequence of max_model_len={self.max_model_len}: "
                               f"{budget} bytes give {blocks} KV blocks, {need} needed")
        window_blocks = self._window_pool_blocks(int(blocks))
        budget -= window_blocks * self.block_size * self.window_kv_bytes_per_token * ranks
        blocks = budget // (self.block_size * self.kv_bytes_per_token * ranks)
        if blocks < need:
            raise RuntimeError(f"not enough memory for one sequence of max_model_len={self.max_model_len} beside "
                               f"num_window_kv_blocks={window_blocks}: {blocks} KV blocks left, {need} needed")
        return int(blocks), window_blocks

    # ---- inputs ------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        host, sampled = build_host_step(scheduled, self.block_size, self.max_decode_groups, self.model.attention_window,
                                        window_pool=bool(self.num_window_blocks))
        scored = [item for item in scheduled if positions_to_score(item)]
        return StepInputs(host, to_device(host, self.device, self.use_cpu_kernels), sampled, self._sampling_batch(sampled),
                          scored)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

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
            batch.min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=self.device)
            batch.generators = [self._generator(it) for it in sampled]
        ranked = [(row, it.seq.params.top_logprobs) for row, it in enumerate(sampled)
                  if it.seq.params.top_logprobs is not None]
        if ranked:
            batch.ranked_rows, batch.ranked_counts = [r for r, _ in ranked], [n for _, n in ranked]
        if any(it.seq.params.adjusts_logits for it in sampled):
            batch.adjustments = LogitAdjustments.build(sampled, self.model.config.vocab_size, self.device)
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
    def execute(self, inputs: StepInputs) -> tuple[list[int], list[float], list[list[tuple[int, float, int]] | None]]:
        """Run the step; per sampled row its token id, log-prob (NaN if not asked) and top log-probs (None if not asked)."""
        dev = inputs.device
        copy_kv_slots(self.kv_caches, dev, self.window_pool_layers)
        if self.workers is None:
            hidden = self.model(dev.input_ids, dev.positions, self.kv_caches, dev.meta)
        else:
            self.workers.broadcast(inputs.host)  # the other ranks start this step while we do
            try:
                hidden = self.model(dev.input_ids, dev.positions, self.kv_caches, dev.meta)
            except RuntimeError as exc:  # a collective failed: say which worker, if one died
                # The watchdog polls the workers every 0.1 s; on a starved machine it may take longer
                # to run, so wait for its word (bounded) rather than a fixed moment.
                deadline = time.monotonic() + 5.0
                while not self.failure and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.failure:
                    raise TensorParallelError(self.failure) from exc
                raise
        if inputs.scored:
            score_prompts(self.model, hidden, inputs.scored)
        if not inputs.sampled:
            return [], [], []
        wants_logprob = [it.seq.params.logprobs for it in inputs.sampled]
        sampling = inputs.sampling
        top: list[list[tuple[int, float, int]] | None] = [None] * len(wants_logprob)
        if (self.model.greedy_screen is not None and sampling.plain_greedy and sampling.ranked_rows is None
                and not all(wants_logprob) and not self.model.exact_head_beats_screen(len(wants_logprob))):
            return (*self._greedy_tokens_screened(hidden[dev.logits_rows], wants_logprob), top)
        logits = self.model.compute_logits(hidden[dev.logits_rows])
        # A step with a row that wants its top log-probs keeps them before the choice changes the logits.
        ranking = ranking_logprobs(logits, sampling) if sampling.ranked_rows is not None else None
        packed = choose_tokens(logits, inputs.sampling, self.use_cpu_kernels)
        ids, logprobs = unpack_tokens(packed.cpu().numpy())  # the step's one device -> host transfer
        if not all(wants_logprob):  # NaN for who did not ask, on every path
            logprobs = [lp if wants else math.nan for lp, wants in zip(logprobs, wants_logprob)]
        if ranking is not None:
            logprobs = list(logprobs)
            for row, entries in zip(sampling.ranked_rows, top_logprobs(ranking, sampling, ids)):
                top[row] = entries
                if wants_logprob[row]:  # the same number as its top entry, not the fused head's own sum
                    logprobs[row] = entries[0][1]
        return ids, logprobs, top

    def _greedy_tokens_screened(self, rows: torch.Tensor, wants_logprob: list[bool]) -> tuple[list[int], list[float]]:
        """An all-greedy step on CPU: the rows that want no log-prob take the greedy screen
        (layers/greedy_screen.py), the others the float32 head; the ids are the same either way."""
        screened = [i for i, wants in enumerate(wants_logprob) if not wants]
        asking = [i for i, wants in enumerate(wants_logprob) if wants]
        ids, logprobs = [0] * len(wants_logprob), [math.nan] * len(wants_logprob)
        got, _ = self.model.greedy_ids(rows if not asking else rows[screened])
        for i, token in zip(screened, got.tolist()):
            ids[i] = token
        if asking:
            logits = self.model.compute_logits(rows[asking])
            asked_ids, asked_logprobs = unpack_tokens(choose_tokens(logits, SamplingBatch(), self.use_cpu_kernels).numpy())
            for i, token, logprob in zip(asking, asked_ids, asked_logprobs):
                ids[i], logprobs[i] = token, logprob
        return ids, logprobs

    def forward_dummy(self, num_tokens_per_seq: list[int], logprobs: bool = True) -> None:
        """Warm-up: one forward over throw-away sequences written into unallocated blocks."""
        from tritonllm.engine.sampling_params import SamplingParams
        from tritonllm.engine.sequence import Sequence

        bs = self.block_size
        next_block = 0
        items = []
        for i, n in enumerate(num_tokens_per_seq):
            seq = Sequence(f"warmup-{i}", [0] * n, SamplingParams(max_tokens=1, logprobs=logprobs))
            nb = -(-n // bs)
            seq.block_table = list(range(next_block, next_block + nb))
            if self.num_window_blocks:  # throw-away K/V: sequences may share window-pool blocks
                seq.window_block_table = [b % self.num_window_blocks for b in seq.block_table]
            next_block += nb
            items.append(ScheduledSeq(seq, n))
        if next_block > self.num_blocks:
            return
        self.execute(self.prepare(items))
        devices.synchronize(self.device)
