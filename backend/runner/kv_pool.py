"""The KV cache's memory: how many blocks each pool gets, and the pools themselves.

Every layer keeps K and V in one pool of fixed-size blocks. A model that mixes sliding-window and
full layers may keep its sliding layers' K/V in a second pool (the window pool,
scheduling/window_pool.py), which frees what falls behind the window; a token within the window then
holds a slot in both pools, one behind it only in the main pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonllm.devices import platform
from tritonllm.core.config import EngineConfig
from tritonllm.layers.kv_layout import HEAD_MAJOR, pool_shape
from tritonllm.scheduling.window_pool import window_pool_blocks_per_sequence


@dataclass
class KVPoolPlan:
    """The pools' sizes, for one rank."""

    num_blocks: int
    num_window_blocks: int  # 0: no window pool
    block_size: int
    kv_bytes_per_token: int  # in the main pool, on this rank
    window_kv_bytes_per_token: int
    window_blocks_per_seq: int  # the most window-pool blocks one sequence holds (0: no window pool)
    window_pool_layers: list[bool] | None  # per layer: its K/V live in the window pool
    max_model_len: int
    max_num_seqs: int

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len tokens the pools hold at once (the window pool limits it only
        where it holds fewer than max_num_seqs sequences' windows)."""
        full = self.num_blocks * self.block_size / self.max_model_len
        if not self.window_blocks_per_seq:
            return full
        windows = self.num_window_blocks / self.window_blocks_per_seq
        return full if windows >= self.max_num_seqs else min(full, windows)

    def describe(self, kv_dtype: torch.dtype, attention_window: int | None) -> str:
        text = (f"{self.num_blocks} blocks x {self.block_size} tokens, {str(kv_dtype).removeprefix('torch.')} "
                f"({self.num_blocks * self.block_size * self.kv_bytes_per_token / 2**20:.1f} MiB, "
                f"{self.kv_bytes_per_token} bytes/token on this rank)")
        if self.window_blocks_per_seq:
            mib = self.num_window_blocks * self.block_size * self.window_kv_bytes_per_token / 2**20
            text += (f"; window pool for {sum(self.window_pool_layers)} sliding layers (window {attention_window}): "
                     f"{self.num_window_blocks} blocks ({mib:.1f} MiB, {self.window_kv_bytes_per_token} bytes/token, "
                     f"at most {self.window_blocks_per_seq} a sequence)")
        return f"{text}; max concurrency at max_model_len={self.max_model_len}: {self.max_concurrency:.1f}"


def plan_kv_pools(model, config: EngineConfig, max_model_len: int, kv_dtype: torch.dtype, device: torch.device,
                  num_ranks: int) -> KVPoolPlan:
    """The pools' sizes for `model` (this rank's shard): `num_kv_blocks` / `num_window_kv_blocks` where
    config.pbtxt sets them, else from the memory budget."""
    cache, scheduler = config.cache, config.scheduler
    layer_bytes = 2 * model.num_kv_heads * model.head_dim * kv_dtype.itemsize
    window_layers = model.window_pool_layers if cache.window_pool else None
    num_window_layers = sum(window_layers or [])
    plan = KVPoolPlan(
        num_blocks=0, num_window_blocks=0, block_size=cache.block_size,
        kv_bytes_per_token=(model.num_layers - num_window_layers) * layer_bytes,
        window_kv_bytes_per_token=num_window_layers * layer_bytes,
        window_blocks_per_seq=0 if not num_window_layers else window_pool_blocks_per_sequence(
            model.attention_window, scheduler.max_num_batched_tokens, max_model_len, cache.block_size),
        window_pool_layers=window_layers, max_model_len=max_model_len, max_num_seqs=scheduler.max_num_seqs)
    if cache.num_blocks:
        plan.num_blocks = cache.num_blocks
        plan.num_window_blocks = _window_pool_blocks(plan, config, cache.num_blocks, model.attention_window)
    else:
        plan.num_blocks, plan.num_window_blocks = _blocks_from_memory(plan, model, config, device, num_ranks)
    if not plan.num_window_blocks:
        plan.window_pool_layers = None
    return plan


def _window_pool_blocks(plan: KVPoolPlan, config: EngineConfig, num_blocks: int, window: int | None) -> int:
    """The window pool's size beside `num_blocks` (one pool of every layer would have as many): what
    num_window_kv_blocks says, else room for max_num_seqs sequences' windows, never more than
    `num_blocks` (no sequence holds more blocks there than in the main pool). So by default no
    workload fits fewer sequences than in one pool; where memory is short of max_num_seqs windows,
    the pools are then as one pool would be, and a smaller num_window_kv_blocks trades sequences
    shorter than the window for more long ones."""
    if not plan.window_blocks_per_seq:
        return 0
    asked = config.cache.num_window_blocks
    if asked:
        if asked < plan.window_blocks_per_seq:
            raise RuntimeError(f"num_window_kv_blocks={asked} cannot hold one sequence's window: at least "
                               f"{plan.window_blocks_per_seq} blocks (sliding_window {window} + "
                               f"max_num_batched_tokens, in blocks, and one at each end)")
        return asked
    return min(config.scheduler.max_num_seqs * plan.window_blocks_per_seq, num_blocks)


def _blocks_from_memory(plan: KVPoolPlan, model, config: EngineConfig, device: torch.device,
                        num_ranks: int) -> tuple[int, int]:
    """The main pool's blocks and the window pool's from the memory budget. The window pool takes what
    it would take beside one pool of every layer (`_window_pool_blocks`), the main pool the rest."""
    cache, scheduler, bs = config.cache, config.scheduler, config.cache.block_size
    budget = int(platform.free_memory_bytes(device) * cache.memory_fraction)
    ranks = 1
    if device.type == "cpu":
        budget = min(budget, cache.max_bytes)
        ranks = num_ranks  # every rank's pool lives in the same host memory
    # Room for the largest step's activations: hidden-sized buffers per batched token, and float32
    # logits (plus softmax temporaries) per sampled sequence.
    cfg = model.config
    budget -= scheduler.max_num_batched_tokens * 16 * (cfg.hidden_size + cfg.intermediate_size) * 4
    budget -= scheduler.max_num_seqs * cfg.vocab_size * 4 * 3
    blocks = budget // (bs * (plan.kv_bytes_per_token + plan.window_kv_bytes_per_token) * ranks)
    need = -(-plan.max_model_len // bs)
    if blocks < need:
        raise RuntimeError(f"not enough memory for one sequence of max_model_len={plan.max_model_len}: "
                           f"{budget} bytes give {blocks} KV blocks, {need} needed")
    window_blocks = _window_pool_blocks(plan, config, int(blocks), model.attention_window)
    budget -= window_blocks * bs * plan.window_kv_bytes_per_token * ranks
    blocks = budget // (bs * plan.kv_bytes_per_token * ranks)
    if blocks < need:
        raise RuntimeError(f"not enough memory for one sequence of max_model_len={plan.max_model_len} beside "
                           f"num_window_kv_blocks={window_blocks}: {blocks} KV blocks left, {need} needed")
    return int(blocks), window_blocks


def allocate_kv_pool(model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                     num_window_blocks: int = 0, layout: str = HEAD_MAJOR) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each of this rank's KV heads' blocks laid out as `layout` (layers/kv_layout.py):
    `num_window_blocks` blocks for the layers whose K/V live in the window pool
    (`model.window_pool_layers`), `num_blocks` for the others.

    Zeroed, not empty: attention reads whole blocks, and a NaN left in memory under a masked
    position would still poison the weighted sum (0 * NaN).
    """
    def pool(blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = pool_shape(layout, blocks, block_size, model.num_kv_heads, model.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    in_window_pool = model.window_pool_layers if num_window_blocks else None
    return [pool(num_window_blocks if in_window_pool and in_window_pool[i] else num_blocks)
            for i in range(model.num_layers)]
