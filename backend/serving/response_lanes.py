"""Responses leave through a few sender threads ("lanes"), each request's always through the same one.

Why: the Python backend's `send()` is a round trip to tritonserver. The response goes through shared
memory to one of the server's pool threads, which hands it to the frontend and then wakes the stub.
The GIL is released meanwhile, but one thread sending one response at a time spends most of its time
waiting. Where a step takes less than that wait times the number of streams (a GPU's few
milliseconds at 64 streams), a single sender sets the pace of every stream. Several lanes keep
several round trips in flight. One lane per request keeps its responses in order, its FINAL last.

With no lanes (`response_threads` 0), `send` sends at once from the calling thread.

`send_built` queues a send whose response is built only when the lane reaches it: what a request
produced while its send waited in line then goes out in that one response (generate_model.py's
`response_coalescing`), rather than one more round trip per token behind it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Callable

logger = logging.getLogger("tritonllm")

_STOP = object()


class ResponseLanes:
    def __init__(self, count: int, name: str = "tritonllm-send"):
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(count)]
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"{name}-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        self._next = itertools.count()
        for thread in self._threads:
            thread.start()

    def lane(self) -> int:
        """A lane for a new request (round robin); -1 without lanes."""
        return next(self._next) % len(self._queues) if self._queues else -1

    def send(self, lane: int, sender, response=None, flags: int = 0,
             on_failure: Callable[[BaseException], None] | None = None) -> None:
        """`sender.send(response, flags=flags)` on `lane` (at once when there are no lanes), after
        everything sent on that lane before. `on_failure(exc)`, in the sending thread, if it raises."""
        if lane < 0 or not self._queues:
            _send(sender, response, flags, on_failure)
        else:
            self._queues[lane].put((sender, response, flags, on_failure))

    def send_built(self, lane: int, sender, build: Callable[[], tuple | None],
                   on_failure: Callable[[BaseException], None] | None = None) -> None:
        """As `send`, the response and flags being `build()`'s, called when the lane reaches it (at once
        without lanes); a build that returns None sends nothing."""
        if lane < 0 or not self._queues:
            _send_built(sender, build, on_failure)
        else:
            self._queues[lane].put((sender, build, on_failure))

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued, then stop the threads."""
        for q in self._queues:
            q.put(_STOP)
        for thread in self._threads:
            thread.join(timeout=timeout_s)

    @staticmethod
    def _run(q: queue.SimpleQueue) -> None:
        while (item := q.get()) is not _STOP:
            if len(item) == 3:
                _send_built(*item)
            else:
                _send(*item)


def _send(sender, response, flags: int, on_failure) -> None:
    try:
        if response is None:
            sender.send(flags=flags)
        else:
            sender.send(response, flags=flags)
    except Exception as exc:  # noqa: BLE001 - one failed send never stops the lane
        if on_failure is None:
            logger.exception("sending a response failed")
        else:
            on_failure(exc)


def _send_built(sender, build, on_failure) -> None:
    try:
        built = build()
    except Exception as exc:  # noqa: BLE001 - one failed build never stops the lane
        if on_failure is None:
            logger.exception("building a response failed")
        else:
            on_failure(exc)
        return
    if built is not None:
        _send(sender, *built, on_failure)
