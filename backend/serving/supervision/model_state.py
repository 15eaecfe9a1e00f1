"""What the supervisor knows of one model: its state, why it cannot serve, its stubs, its restarts."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field


@dataclass
class Model:
    name: str
    state: str = "loading"  # loading | ready | dead | failed | unloaded (by an operator)
    reason: str = ""  # why it is not ready, in words for a client
    stubs: dict[int, str] = field(default_factory=dict)  # stub pid -> instance name
    retired: set[int] = field(default_factory=set)  # stubs of an earlier load, maybe still finishing their unload
    restarts: collections.deque = field(default_factory=collections.deque)  # monotonic times of recent restarts
    restarts_total: int = 0
    deaths: collections.Counter = field(default_factory=collections.Counter)  # cause -> count
    died_at: float | None = None
    zombie: bool = False  # a stub died: tritonserver keeps that version UNLOADING for good
    task: asyncio.Task | None = None
    ready_at: float = 0.0  # monotonic time it last became ready: what tritonserver said before is stale
    unready_polls: int = 0  # index polls in a row that found it not READY while it was ready here

    def serves(self) -> None:
        """It has loaded and serves."""
        self.state, self.reason, self.zombie = "ready", "", False
        self.ready_at = time.monotonic()
