"""Tensor-parallel shard of a model: which slice of heads and MLP columns this rank holds, and its all-reduce.

Megatron-style: QKV and gate/up are split by output columns (each rank computes its own heads and
its own part of the MLP), the attention output and down projections by input rows, and each of
those two row-parallel GEMMs ends with one all-reduce that sums the ranks' partial results.
Attention heads are split along KV-head groups, so a rank's query heads always find their K/V
locally; when the KV heads do not divide evenly, the first ranks take one more group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class TPShard:
    """Shared by every layer of one model; `group` (and `local_all_reduce`, where the device has one) is set
    once the ranks have met (after loading)."""

    rank: int = 0
    world_size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup of this model's ranks only
    # Sums a tensor in place across the ranks faster than the group's all-reduce, where the device has such
    # a path (the CPU's through shared memory: devices/cpu/shared_memory_all_reduce.py); None: the group's.
    local_all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def split(self, n: int) -> tuple[int, int]:
        """[start, end) of this rank's contiguous share of n items (the first n % world get one more)."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            if self.local_all_reduce is not None:
                return self.local_all_reduce(x)
            self.group.allreduce([x]).wait()
        return x


SINGLE = TPShard()  # never given a group: one rank


def check_shardable(num_kv_heads: int, world_size: int) -> None:
    if world_size > num_kv_heads:
        raise ValueError(f"tensor_parallel_size={world_size} exceeds the model's {num_kv_heads} KV heads: "
                         "every rank needs at least one KV head group")


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th device after the instance's own (cuda:1 + rank 1 -> cuda:2)."""
    if base.type == "cpu":
        return base
    return torch.device(base.type, (base.index or 0) + rank)
