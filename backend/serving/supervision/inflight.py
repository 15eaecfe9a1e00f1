"""Every request in flight through the front, by model: what the front ends with an error when the
request's model dies or a drain runs out of time (tritonserver would never end them itself)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("tritonllm.front")


@dataclass(eq=False)
class Entry:
    model: str
    fail: Callable[[str], None] | None  # ends the request with this error message


class Inflight:
    """Every request in flight through the front, by model; ended here when its model dies or the drain times out."""

    def __init__(self):
        self._entries: set[Entry] = set()
        self.changed = asyncio.Event()  # set whenever an entry leaves (drain waits on it)
        self.ended: dict[tuple[str, str], int] = {}  # (model, cause) -> requests the front ended with an error

    def add(self, model: str, fail: Callable[[str], None] | None = None) -> Entry:
        entry = Entry(model, fail)
        self._entries.add(entry)
        return entry

    def discard(self, entry: Entry) -> None:
        if entry in self._entries:
            self._entries.discard(entry)
            self.changed.set()

    def count(self, model: str | None = None) -> int:
        return sum(1 for e in self._entries if model is None or e.model == model)

    def fail(self, message: str, cause: str, model: str | None = None) -> int:
        """End every request of `model` (None: every request) with `message`; returns how many."""
        victims = [e for e in self._entries if model is None or e.model == model]
        for entry in victims:
            self.end(entry, message, cause)
        return len(victims)

    def end(self, entry: Entry, message: str, cause: str) -> None:
        """End one request with an error, counted by cause."""
        if entry not in self._entries:
            return
        self.discard(entry)
        key = (entry.model, cause)
        self.ended[key] = self.ended.get(key, 0) + 1
        try:
            entry.fail(message)
        except Exception:  # noqa: BLE001 - one broken connection must not keep the others waiting
            logger.exception("ending a request of %s failed", entry.model)
