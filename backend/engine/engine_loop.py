"""Drive an Engine from its own thread: callers submit and abort from any thread, outputs go to callbacks.

Validation and tokenization happen in the caller's thread (bad input raises right there); the loop
thread owns the scheduler and the device. If a step fails, every in-flight request gets an error
output and the loop stops: nothing hangs waiting for tokens that will never come.

With async scheduling (engine.py) each `step()` leaves the step it launched running on the device
and returns the previous step's outputs: the loop hands those to their callbacks, takes in new
requests and aborts, and builds the next step while the device computes.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable

from tritonllm.core.errors import EngineDeadError, QueueFullError  # noqa: F401 - raised here, importable from here
from tritonllm.core.outputs import RequestOutput
from tritonllm.core.sampling_params import InvalidRequestError
from tritonllm.engine.engine import Engine

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
# A step's outputs with each one's callback, handed over at once (EngineLoop's `deliver_step`).
StepDelivery = Callable[[list[tuple[OutputCallback, RequestOutput]]], None]


class EngineLoop:
    """`EngineLoop(engine)` drives an engine already built; `EngineLoop.build(make_engine)` builds it on
    the loop thread first, which is what serving should do.

    Why build on the loop thread: OpenMP (torch's CPU thread pool) keeps one pool of worker threads
    per thread that has run a parallel region. A process whose main thread built and warmed the
    model, and whose loop thread then runs it, holds two pools; once they have more threads than the
    machine has cores, GNU OpenMP stops spinning between regions and every small GEMM pays a
    thread wake-up, which slows small decode steps by half again.
    """

    def __init__(self, engine: Engine | None = None, idle_wait_s: float = 0.05, *,
                 deliver_step: StepDelivery | None = None,
                 _make_engine: Callable[[], Engine] | None = None):
        self._idle_wait_s = idle_wait_s
        # Where given, a step's outputs go to it in one call, as (callback, output) pairs, instead of one
        # callback call each; outputs outside steps (aborts, errors) still go to their callbacks. A
        # caller that hands outputs to another thread then wakes it once a step, not once a request
        # (each wake-up takes the GIL from this thread), and knows when a step's outputs are complete
        # (a request's n completions join in one response).
        self._deliver_step = deliver_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        # Held while a request enters the inbox and while the dying loop closes it, so that no
        # request lands in the inbox after the last drain (it would wait forever).
        self._inbox_lock = threading.Lock()
        self._closed = False
        self.error: str | None = None
        self.engine = engine
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(_make_engine,), name="tritonllm-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        self.stats: dict = self.engine.stats()  # snapshot taken by the engine thread, read by others

    @classmethod
    def build(cls, make_engine: Callable[[], Engine], idle_wait_s: float = 0.05,
              deliver_step: StepDelivery | None = None) -> "EngineLoop":
        """Build the engine on the loop thread (blocks until it is ready; its errors are raised here)."""
        return cls(None, idle_wait_s, deliver_step=deliver_step, _make_engine=make_engine)

    @property
    def alive(self) -> bool:
        return (self._thread.is_alive() and self.error is None and not self._stopping.is_set()
                and self.engine.failure is None)

    def submit(self, callback: OutputCallback, prompt: str | None = None, params=None, **kwargs) -> str:
        """Validate and queue a request; raises InvalidRequestError, QueueFullError or EngineDeadError."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running: {self.error or 'shut down'}")
        limit = self.engine.config.scheduler.max_queue_size
        if limit and self.engine.scheduler.num_waiting + self._inbox.qsize() >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        seqs = self.engine.make_sequences(prompt, params, **kwargs)
        with self._inbox_lock:
            if self._closed:  # the loop died or stopped while this request was being tokenized
                raise EngineDeadError(f"the engine is not running: {self.error or 'shut down'}")
            for seq in seqs:  # n > 1: one sequence per completion, each reported to the callback
                self._inbox.put(("add", seq, callback))
        self._wake.set()
        return seqs[0].parent_id

    def abort(self, request_id: str) -> None:
        """Stop a request (all its completions); its callback gets the final outputs."""
        self._inbox.put(("abort", request_id, None))
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item, callback = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_sequence(item)
                except (InvalidRequestError, QueueFullError) as exc:
                    callback(_error_output(item.request_id, str(exc), kind=type(exc).__name__))
                    continue
                self._callbacks[item.request_id] = callback
            else:
                for out in self.engine.abort(item):
                    self._deliver(out)

    def _callback_for(self, out: RequestOutput) -> OutputCallback | None:
        return self._callbacks.pop(out.request_id) if out.finished else self._callbacks.get(out.request_id)

    def _deliver_step_outputs(self, outputs: list[RequestOutput]) -> None:
        if self._deliver_step is None:
            for out in outputs:
                self._deliver(out)
            return
        batch = [(callback, out) for out in outputs if (callback := self._callback_for(out)) is not None]
        if not batch:
            return
        try:
            self._deliver_step(batch)
        except Exception:  # a broken caller must not stop everyone else's generation
            logger.exception("delivering a step's outputs failed")

    def _deliver(self, out: RequestOutput) -> None:
        callback = self._callback_for(out)
        if callback is None:
            return
        try:
            callback(out)
        except Exception:  # a broken caller must not stop everyone else's generation
            logger.exception("output callback for %s failed", out.request_id)

    def _run(self, make_engine: Callable[[], Engine] | None) -> None:
        if make_engine is not None:
            try:
                self.engine = make_engine()
            except BaseException as exc:  # noqa: BLE001 - raised again in the constructing thread
                self._build_error = exc
                return
            finally:
                self._built.set()
        self._built.set()
        try:
            while not self._stopping.is_set():
                if self.engine.failure:  # e.g. a tensor-parallel worker died while we were idle
                    raise RuntimeError(self.engine.failure)
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self.stats = self.engine.stats()
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self.stats = self.engine.stats()
                self._deliver_step_outputs(outputs)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            self.error = f"{type(exc).__name__}: {exc}"
            logger.error("engine thread died: %s\n%s", self.error, traceback.format_exc())
        finally:
            self._fail_all(self.error or "the engine is shutting down")

    def _fail_all(self, message: str) -> None:
        # Requests still in the inbox or the engine get an error: nobody waits forever.
        with self._inbox_lock:
            self._closed = True  # from here on submit() raises instead of queueing
        while True:
            try:
                kind, item, callback = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                callback(_error_output(item.request_id, message))
        for request_id, callback in list(self._callbacks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine may be broken; the caller must still hear
                pass
            callback(_error_output(request_id, message))
        self._callbacks.clear()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is in flight (callers get an error output), stop the thread, release the engine."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout_s)
        self.engine.close()


def _error_output(request_id: str, message: str, kind: str = "EngineDeadError") -> RequestOutput:
    return RequestOutput(request_id, [], [], "", True, "abort", 0, 0, error=message, error_kind=kind)
