"""The only code that touches the device: the model, its KV pool, and one step's forward and head.

At start-up: load the plain model, apply the device backend (devices/), size and allocate the KV
pools (kv_pool.py). Per step: `prepare` builds the inputs on the host and moves them in one go
(step_inputs.py, sampling_batch.py); `execute` runs the forward and chooses the tokens (head.py).

With tensor_parallel_size > 1 this process is rank 0: it runs its own shard and sends each step's
host inputs to the worker ranks (parallel/) before running it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tritonllm.devices import platform, select_backend
from tritonllm.engine.config import EngineConfig
from tritonllm.models.loader import load_hf_config, load_model
from tritonllm.parallel.shard import TPShard, check_shardable, rank_device
from tritonllm.parallel.workers import TensorParallelWorkers, WorkerSpec, threads_per_rank
from tritonllm.runner.head import TopLogprobs, choose_step_tokens
from tritonllm.runner.kv_pool import allocate_kv_pool, plan_kv_pools
from tritonllm.runner.prompt_logprobs import positions_to_score, score_prompts
from tritonllm.runner.sampling_batch import SamplingBatch
from tritonllm.runner.step_inputs import DeviceStep, HostStep, build_host_step, copy_kv_slots, to_device
from tritonllm.scheduling.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    host: HostStep  # what tensor-parallel workers receive
    device: DeviceStep
    sampled: list[ScheduledSeq]  # in the order of logits_rows
    sampling: SamplingBatch
    scored: list[ScheduledSeq]  # sequences whose prompt positions this step scores (prompt_logprobs.py)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, eos_token_ids: set[int]):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = platform.resolve_kv_cache_dtype(config.cache.dtype, dtype)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = sorted(eos_token_ids)
        self.tp_size = config.parallel.tensor_parallel_size
        self.tp = TPShard(0, self.tp_size)
        self.workers: TensorParallelWorkers | None = None
        self._threads_before = 0
        platform.set_device(device)
        self.backend = select_backend(device, dtype, config)
        started = time.perf_counter()
        try:
            if self.tp_size > 1:
                self._start_workers(model_dir)
            self.model = self.backend.optimize(load_model(model_dir, dtype, device, max_model_len, self.tp))
            logger.info("loaded %s (%s, %s, tensor-parallel rank 0 of %d) in %.1f s; device backend: %s", model_dir,
                        device, dtype, self.tp_size, time.perf_counter() - started, self.backend.describe())
            self.kv_plan = plan_kv_pools(self.model, config, max_model_len, self.kv_dtype, device, self.tp_size)
            if self.workers is not None:
                self.workers.wait_loaded()
                self.tp.group = self.workers.connect(device, self.kv_plan.num_blocks, self.kv_plan.num_window_blocks)
        except BaseException:
            self.close()
            raise
        self.kv_caches = allocate_kv_pool(self.model, self.num_blocks, self.block_size, self.kv_dtype, device,
                                          self.num_window_blocks, self.backend.kv_layout)
        logger.info("KV pool: %s", self.kv_plan.describe(self.kv_dtype, self.model.attention_window))
        self.backend.capture(self.model, self.kv_caches, self.num_window_blocks)

    @property
    def num_blocks(self) -> int:
        return self.kv_plan.num_blocks

    @property
    def num_window_blocks(self) -> int:
        return self.kv_plan.num_window_blocks

    # ---- tensor parallelism ------------------------------------------------------------------
    def _start_workers(self, model_dir: Path) -> None:
        """Ranks 1..N-1 as worker processes, loading their shards while this rank loads its own."""
        check_shardable(load_hf_config(model_dir).num_key_value_heads, self.tp_size)
        threads = 0
        if self.device.type == "cpu":  # the ranks share this machine's cores (restored by close())
            threads = threads_per_rank(self.config)
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)
        dtype_name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
        self.workers = TensorParallelWorkers([
            WorkerSpec(self.config, str(model_dir), dtype_name(self.dtype), dtype_name(self.kv_dtype),
                       str(rank_device(self.device, rank)), self.max_model_len, rank, threads)
            for rank in range(1, self.tp_size)])

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

    # ---- one step ----------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        host, sampled = build_host_step(scheduled, self.block_size, self.model.attention_window,
                                        window_pool=bool(self.num_window_blocks),
                                        with_groups=self.backend.takes_groups)
        scored = [item for item in scheduled if positions_to_score(item)]
        sampling = SamplingBatch.build(sampled, self.eos_token_ids, self.model.config.vocab_size, self.device)
        return StepInputs(host, to_device(host, self.device), sampled, sampling, scored)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
        """Run the step; per sampled row its token id, log-prob (NaN if not asked) and top log-probs (None if not asked)."""
        dev = inputs.device
        copy_kv_slots(self.kv_caches, dev, self.kv_plan.window_pool_layers, self.backend.kv_layout)
        if self.workers is not None:
            self.workers.broadcast(inputs.host)  # the other ranks start this step while we do
        try:
            hidden = self.backend.forward(self.model, dev.input_ids, dev.positions, self.kv_caches, dev.meta)
        except RuntimeError as exc:  # a collective failed: say which worker, if one died
            if self.workers is not None:
                self.workers.explain(exc)
            raise
        if inputs.scored:
            score_prompts(self.model, hidden, inputs.scored)
        if not inputs.sampled:
            return [], [], []
        wants_logprob = [it.seq.params.logprobs for it in inputs.sampled]
        return choose_step_tokens(self.model, self.backend, hidden[dev.logits_rows], inputs.sampling, wants_logprob)
