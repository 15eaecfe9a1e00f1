"""Which LoRA adapters have their weights in the model's slots, and loading the ones a step needs.

Every linear an adapter can target holds `max_loras` slots (`Linear.lora`, layers/lora.py). A step's
adapters each take one: an adapter already in a slot keeps it; another takes a free slot, or the one
whose adapter ran least recently and has no row in this step (the scheduler lets at most `max_loras`
adapters run at once, so there always is one). Adapters are read from their folders at load (every
declared one, which checks them all), and up to `max_cpu_loras` of them stay in host memory; one
evicted from there is read again from its folder when a request names it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from tritonllm.core.config import LoraConfig
from tritonllm.models.lora_adapters import LINEARS, LoraAdapter, read_adapter
from tritonllm.layers.lora import LoraWeights

logger = logging.getLogger(__name__)


class LoraSlots:
    def __init__(self, config: LoraConfig, model, device: torch.device, dtype: torch.dtype):
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_cpu = config.max_cpu_loras or len(config.adapters)
        self.folders = {name: Path(folder) for name, folder in config.adapters}
        self.model, self.device, self.dtype = model, device, dtype
        self.linears = {f"layers.{i}.{name}": model.get_submodule(f"layers.{i}.{name}")
                        for i in range(len(model.layers)) for name in LINEARS}
        for linear in self.linears.values():
            linear.lora = [None] * self.max_loras
        self.slot_names: list[str | None] = [None] * self.max_loras
        self._slot_of: dict[str, int] = {}
        self._last_used = [0] * self.max_loras
        self._clock = 0
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        for name in self.folders:
            adapter = read_adapter(name, self.folders[name], model, self.max_rank)
            if len(self._host) < self.max_cpu:
                self._host[name] = adapter
            logger.info("LoRA adapter %s: rank %d, %d linears, from %s", name, adapter.rank, len(adapter.weights),
                        self.folders[name])

    @property
    def names(self) -> list[str]:
        return list(self.folders)

    def activate(self, names: set[str]) -> dict[str, int]:
        """Slots for the step's adapters (at most max_loras), loading the ones not in a slot yet."""
        self._clock += 1
        for name in names:
            if name in self._slot_of:
                self._last_used[self._slot_of[name]] = self._clock
        for name in names:
            if name not in self._slot_of:
                self._load(name, self._free_slot(names))
        return {name: self._slot_of[name] for name in names}

    def _free_slot(self, keep: set[str]) -> int:
        candidates = [s for s, held in enumerate(self.slot_names) if held is None or held not in keep]
        if not candidates:
            raise RuntimeError(f"a step has more than max_loras={self.max_loras} adapters")
        return min(candidates, key=lambda s: (self.slot_names[s] is not None, self._last_used[s]))

    def _load(self, name: str, slot: int) -> None:
        adapter = self._host_adapter(name)
        if self.slot_names[slot] is not None:
            del self._slot_of[self.slot_names[slot]]
        for module_name, linear in self.linears.items():
            weights = adapter.weights.get(module_name)
            linear.lora[slot] = None if weights is None else LoraWeights(
                weights.a.to(self.device, self.dtype), weights.b.to(self.device, self.dtype), weights.parts)
        self.slot_names[slot] = name
        self._slot_of[name] = slot
        self._last_used[slot] = self._clock

    def _host_adapter(self, name: str) -> LoraAdapter:
        adapter = self._host.get(name)
        if adapter is None:  # evicted from host memory (max_cpu_loras): read its folder again
            adapter = read_adapter(name, self.folders[name], self.model, self.max_rank)
            self._host[name] = adapter
            while len(self._host) > self.max_cpu:
                self._host.popitem(last=False)
        self._host.move_to_end(name)
        return adapter
