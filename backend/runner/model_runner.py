"""The only code that touches the device: the model, its KV pool, and one step's forward and head.

At start-up: this rank's model, built with its device backend's ops (model_shard.py), then the KV
pools sized (kv_pool.py) and allocated. Per step: `prepare` builds the inputs on the host and moves them in one go
(step_inputs.py, sampling_batch.py); `execute` launches the forward and the choice of the tokens (head.py),
whose ids and log-probs reach the host when the caller asks (`StepTokens.result()`).

With tensor_parallel_size > 1 this process is rank 0: it runs its own shard and sends each step's
host inputs to the worker ranks (parallel/) before running it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tritonllm.devices import platform
from tritonllm.core.config import EngineConfig
from tritonllm.core.tracing import span
from tritonllm.models.loader import load_hf_config
from tritonllm.parallel.shard import TPShard, check_shardable, rank_device
from tritonllm.runner.tp_workers import TensorParallelWorkers, WorkerSpec, threads_per_rank
from tritonllm.runner.head import StepTokens, device_started_event, launch_step_tokens
from tritonllm.runner.kv_pool import plan_kv_pools
from tritonllm.runner.lora_slots import LoraSlots
from tritonllm.runner.model_shard import ModelShard
from tritonllm.runner.prompt_logprobs import positions_to_score, score_prompts
from tritonllm.runner.sampling_batch import SamplingBatch
from tritonllm.runner.step_inputs import DeviceStep, HostStep, TokenFeed, build_host_step, to_device
from tritonllm.scheduling.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    host: HostStep  # what tensor-parallel workers receive
    device: DeviceStep
    sampled: list[ScheduledSeq]  # in the order of logits_rows
    sampling: SamplingBatch
    scored: list[ScheduledSeq]  # sequences whose prompt positions this step scores (prompt_logprobs.py)
    # Rows whose token the previous step chose on the device and the host does not have yet (async scheduling).
    feed: TokenFeed | None = None


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
        self.time_device = False  # time each step's forward and head on the device with events (benchmarks)
        platform.set_device(device)
        if config.lora.enabled and config.cuda.graphs:
            # A graph replays the base model's decode step: steps with adapter rows must run the layers.
            logger.info("cuda_graphs: off while LoRA adapters are served")
            config = self.config = dataclasses.replace(config, cuda=dataclasses.replace(config.cuda, graphs=False))
        self.lora: LoraSlots | None = None
        try:
            if self.tp_size > 1:
                self._start_workers(model_dir)
            self.shard = ModelShard(config, model_dir, device, dtype, max_model_len, self.tp)
            if config.lora.enabled:  # every declared adapter read (and checked) now: a bad one fails the load
                self.lora = LoraSlots(config.lora, self.model, device, dtype)
            self.kv_plan = plan_kv_pools(self.model, config, max_model_len, self.kv_dtype, device, self.tp_size)
            if self.workers is not None:
                self.workers.wait_loaded()
                self.tp.group = self.workers.connect(device, self.kv_plan.num_blocks, self.kv_plan.num_window_blocks,
                                                     self.backend.capabilities.shared_memory_all_reduce)
                self.tp.local_all_reduce = self.workers.shared_memory
        except BaseException:
            self.close()
            raise
        self.shard.allocate(self.num_blocks, self.num_window_blocks)
        logger.info("KV pool: %s", self.kv_plan.describe(self.kv_dtype, self.model.attention_window))

    @property
    def backend(self):
        return self.shard.backend

    @property
    def model(self):
        return self.shard.model

    @property
    def kv_caches(self):
        return self.shard.kv_caches

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
            WorkerSpec(self.config, str(model_dir), dtype_name(self.dtype), str(rank_device(self.device, rank)),
                       self.max_model_len, rank, threads)
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
            self.tp.group = self.tp.local_all_reduce = None
        if self._threads_before:  # also when the workers never started
            torch.set_num_threads(self._threads_before)
            self._threads_before = 0

    # ---- one step ----------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        lora_slots = None
        if self.lora is not None:
            names = {item.seq.params.lora_name for item in scheduled} - {None}
            lora_slots = self.lora.activate(names) if names else None
        with span("inputs.host"):
            host, sampled = build_host_step(scheduled, self.block_size, window_pool=bool(self.num_window_blocks),
                                            lora_slots=lora_slots)
            scored = [item for item in scheduled if positions_to_score(item)]
        with span("inputs.sampling"):
            sampling = SamplingBatch.build(sampled, self.eos_token_ids, self.model.config.vocab_size, self.device)
        with span("inputs.to_device"):
            device_step = to_device(host, self.device)
        return StepInputs(host, device_step, sampled, sampling, scored)

    @property
    def plans_on_host(self) -> bool:
        """Whether the attention kernels' plan for a step goes through a host staging buffer that the next
        step's plan overwrites (FlashInfer's page-locked workspace, copied to the device in stream
        order): then the next step may be built while this one runs, but launched only once it is done."""
        return getattr(self.backend.ops, "plans", None) is not None

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepTokens:
        """Launch the step: the forward and the choice of its tokens, on the device. `result()` of what it
        returns gives per sampled row its token id, log-prob (NaN if not asked) and top log-probs (None if
        not asked). Nothing before that waits for the device, except in steps with prompt log-probs or
        sampled rows (temperature > 0), whose values are copied back or forth with blocking copies."""
        dev = inputs.device
        started = device_started_event(self.device) if self.time_device else None
        if inputs.feed is not None:
            with span("feed"):
                inputs.feed.write(dev.input_ids)
        if self.workers is not None:
            self.workers.broadcast(inputs.host)  # the other ranks start this step while we do
        try:
            with span("forward"):
                hidden = self.shard.forward(dev)
        except RuntimeError as exc:  # a collective failed: say which worker, if one died
            if self.workers is not None:
                self.workers.explain(exc)
            raise
        if inputs.scored:
            score_prompts(self.model, hidden, inputs.scored)
        if not inputs.sampled:
            return StepTokens.none(self.device)
        wants_logprob = [it.seq.params.logprobs for it in inputs.sampled]
        with span("head"):
            return launch_step_tokens(self.model, self.backend.head, hidden[dev.logits_rows], inputs.sampling,
                                      wants_logprob, started)
