"""One embedding request's state: its texts, their rows of the result, timestamps and the outcome.

A request may carry many texts; each text is scheduled on its own (a request's texts can land in
different forwards), and the request finishes when its last text has been embedded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tritonllm.core.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

TIMESTAMPS = ("arrival", "scheduled", "inference_begin", "inference_end", "finish")


@dataclass
class EmbeddingOutput:
    """What the engine hands back for a finished (or failed) request."""

    request_id: str
    embeddings: np.ndarray | None  # [texts, dim] float32, in the request's text order
    num_tokens: int  # tokens of all its texts, [CLS] and [SEP] included
    times: dict[str, float] = field(default_factory=dict)  # time.time() seconds, see TIMESTAMPS
    error: str | None = None
    error_kind: str | None = None  # "InvalidRequestError", "QueueFullError", "EngineDeadError", "InternalError"


class EmbeddingRequest:
    """Mutable state, touched by the scheduler thread and the executor thread (never both at once
    for the same field: the scheduler sets token ids and `scheduled`, the executor fills rows)."""

    __slots__ = ("request_id", "texts", "normalize", "callback", "token_ids", "embeddings",
                 "num_pending", "times", "done")

    def __init__(self, request_id: str, texts: list[str], normalize: bool,
                 callback: Callable[[EmbeddingOutput], None]):
        self.request_id = request_id
        self.texts = texts
        self.normalize = normalize
        self.callback = callback
        self.token_ids: list[list[int]] = []
        self.embeddings: np.ndarray | None = None
        self.num_pending = len(texts)
        self.times: dict[str, float] = {"arrival": time.time()}
        self.done = False  # finished, failed or aborted: later rows are ignored

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    def mark(self, name: str, when: float) -> None:
        """Record a timestamp once: the first text scheduled/begun, the last text ended."""
        if name == "inference_end" or name not in self.times:
            self.times[name] = when

    def derived_times(self) -> dict[str, float]:
        """SEEDS.md 003: waiting, scheduling-to-inference, inference and end-to-end latency (seconds)."""
        t = self.times
        out = {}
        if "scheduled" in t:
            out["waiting_time"] = t["scheduled"] - t["arrival"]
        if "inference_begin" in t and "scheduled" in t:
            out["scheduling_to_inference"] = t["inference_begin"] - t["scheduled"]
        if "inference_end" in t and "inference_begin" in t:
            out["inference_time"] = t["inference_end"] - t["inference_begin"]
        if "finish" in t:
            out["latency"] = t["finish"] - t["arrival"]
        return out


@dataclass
class TextItem:
    """One text of a request, waiting for (or placed in) a forward."""

    request: EmbeddingRequest
    index: int  # row of the request's result

    @property
    def num_tokens(self) -> int:
        return len(self.request.token_ids[self.index])


class RequestRegistry:
    """The requests in flight, and each one's single outcome: completion, failure and abort can race
    (executor, scheduler and caller threads), and whichever comes first wins."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: dict[str, EmbeddingRequest] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request: EmbeddingRequest) -> None:
        with self._lock:
            if request.request_id in self._requests:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
            self._requests[request.request_id] = request

    def abort(self, request_id: str) -> None:
        """Drop a request without a callback (its client went away)."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is not None:
                request.done = True

    def _close(self, request: EmbeddingRequest) -> bool:
        with self._lock:
            if request.done:
                return False
            request.done = True
            self._requests.pop(request.request_id, None)
        request.times["finish"] = time.time()
        return True

    def finish(self, request: EmbeddingRequest) -> None:
        """All rows are in: log the timestamps (debug) and hand the embeddings to the callback."""
        if not self._close(request):
            return
        if logger.isEnabledFor(logging.DEBUG):
            t0 = request.times["arrival"]
            logger.debug("embedding request %s: %d texts, %d tokens; timestamps %s; %s", request.request_id,
                         len(request.texts), request.num_tokens,
                         " ".join(f"{k}=+{(v - t0) * 1e3:.2f}ms" for k, v in request.times.items()),
                         " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in request.derived_times().items()))
        _deliver(request, EmbeddingOutput(request.request_id, request.embeddings, request.num_tokens,
                                          dict(request.times)))

    def fail(self, request: EmbeddingRequest, message: str, kind: str) -> None:
        if self._close(request):
            _deliver(request, EmbeddingOutput(request.request_id, None, request.num_tokens, dict(request.times),
                                              error=message, error_kind=kind))

    def fail_all(self, message: str, kind: str = "EngineDeadError") -> None:
        with self._lock:
            pending = list(self._requests.values())
        for request in pending:
            self.fail(request, message, kind)


def _deliver(request: EmbeddingRequest, out: EmbeddingOutput) -> None:
    try:
        request.callback(out)
    except Exception:  # noqa: BLE001 - a broken caller must not stop the others
        logger.exception("output callback for %s failed", request.request_id)
