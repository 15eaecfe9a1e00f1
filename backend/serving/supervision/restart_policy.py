"""How often a dead model (or tritonserver) is started again: back-off, and a limit within a window.

A model that keeps dying on load would otherwise be restarted for ever, each load costing its weights'
read and a warm-up; past the limit it is marked failed, with its last reason, for an operator to see.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass


@dataclass
class RestartPolicy:
    max_restarts: int = 5  # automatic restarts of one model (or of tritonserver) ...
    window_s: float = 600.0  # ... within this many seconds; one more and it is marked failed
    backoff_initial_s: float = 1.0  # wait before the first restart; doubles with each restart in the window
    backoff_max_s: float = 60.0

    def backoff(self, recent: int) -> float:
        return min(self.backoff_max_s, self.backoff_initial_s * (2 ** recent))

    def prune(self, times: collections.deque) -> None:
        """Forget the restarts (monotonic times, oldest first) that left the window."""
        while times and time.monotonic() - times[0] > self.window_s:
            times.popleft()
