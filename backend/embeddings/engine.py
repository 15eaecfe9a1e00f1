"""Prefill-only serving: an embedding engine with token-budget batching and asynchronous scheduling.

Two threads joined by one condition variable (SEEDS.md 003, "async scheduling"):
- the scheduler thread admits new requests (tokenizes them, refuses texts over max_model_len) and
  selects texts for the next forward under the token budget while the current forward runs. It
  packs them into host tensors just before the running forward is expected to end (from the
  measured tokens/s), or at once when the executor is idle or the batch is full: texts arriving
  during a forward still join the next one, and the executor finds its next batch ready, with no
  idle gap between forwards;
- the executor thread runs packed batches back to back and hands each request its rows; a request
  finishes with its last text and its callback gets an `EmbeddingOutput`.
Each finished request's timestamps (arrival, scheduled, inference_begin, inference_end, finish)
and derived durations are logged at debug level.

Offline use: `EmbeddingEngine(EmbeddingConfig(...)).encode(texts)`; serving: `submit` + callback.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tritonllm.core.errors import EngineDeadError, QueueFullError
from tritonllm.core.sampling_params import InvalidRequestError
from tritonllm.devices import platform as devices
from tritonllm.embeddings.config import EmbeddingConfig, resolve_embedding_model_dir
from tritonllm.embeddings.request import EmbeddingOutput, EmbeddingRequest, RequestRegistry, TextItem
from tritonllm.embeddings.runner import EmbeddingRunner, PreparedBatch
from tritonllm.embeddings.scheduler import EmbeddingScheduler
from tritonllm.models.loader import load_tokenizer

logger = logging.getLogger(__name__)

_PACK_MARGIN_S = 0.002  # pack this long (plus twice the packing time) before the running forward ends

Callback = Callable[[EmbeddingOutput], None]


@dataclass
class _Batch:
    items: list[TextItem]  # sorted by length; row i of the result belongs to items[i]
    prepared: PreparedBatch


class EmbeddingEngine:
    def __init__(self, config: EmbeddingConfig | None = None, **parameters):
        """`config`, with `parameters` (config.pbtxt names) changed."""
        self.config = (config or EmbeddingConfig()).with_parameters(**parameters)
        started = time.perf_counter()
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.device = devices.resolve_device(self.config.device)
        self.dtype = devices.resolve_dtype(self.config.dtype, self.device)
        devices.set_device(self.device)
        self.model_dir = resolve_embedding_model_dir(self.config.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        # Lengths are checked against max_model_len here; this only silences transformers' warning
        # about texts longer than the model's positions (they are refused, never run).
        self.tokenizer.model_max_length = 1 << 30
        self.runner = EmbeddingRunner(self.model_dir, self.device, self.dtype)
        self.dim = self.runner.dim
        self.max_model_len = self.config.max_model_len
        if self.max_model_len > self.runner.max_position_embeddings:
            logger.warning("max_model_len %d is more than the model's %d positions; using %d", self.max_model_len,
                           self.runner.max_position_embeddings, self.runner.max_position_embeddings)
            self.max_model_len = self.runner.max_position_embeddings
        tokens_per_s = 1e5  # a guess, corrected by the first forwards
        if self.config.warmup:
            seconds, tokens = self.runner.warmup(self.config.max_num_batched_tokens, self.max_model_len)
            tokens_per_s = tokens / seconds
        self.scheduler = EmbeddingScheduler(self.config.max_num_batched_tokens, self.config.max_num_seqs)

        self._cond = threading.Condition()  # guards everything the two threads share
        self._inbox: list[EmbeddingRequest] = []
        self._next: _Batch | None = None  # packed, not yet running
        self._executor_idle = True
        self._pack_at = 0.0  # time.monotonic() at which the next batch should be packed
        self._tokens_per_s = tokens_per_s  # forward speed estimate (moving average)
        self._pack_seconds = 0.0  # packing time estimate (moving average)
        self.requests = RequestRegistry()
        self._num_queued_texts = 0  # texts not yet placed in a batch (inbox + waiting)
        self._stopping = False
        self.error: str | None = None
        self.counters = {"batches": 0, "texts": 0, "tokens": 0, "padded_attention_tokens": 0, "busy_s": 0.0}
        self._threads = [threading.Thread(target=self._guard, args=(fn,), name=name, daemon=True) for fn, name in
                         ((self._schedule_loop, "tritonllm-embed-scheduler"), (self._execute_loop, "tritonllm-embed-executor"))]
        for thread in self._threads:
            thread.start()
        self.startup_seconds = time.perf_counter() - started
        logger.info("embedding engine ready in %.1f s on %s (%s): dim=%d max_model_len=%d token budget=%d",
                    self.startup_seconds, self.device, self.dtype, self.dim, self.max_model_len,
                    self.config.max_num_batched_tokens)

    # ---- callers ---------------------------------------------------------------------------------
    def submit(self, texts: list[str], callback: Callback, normalize: bool | None = None,
               request_id: str | None = None) -> str:
        """Queue a request; `callback` gets its EmbeddingOutput (from an engine thread).

        Raises InvalidRequestError (no texts, a non-string or empty text), QueueFullError or
        EngineDeadError here; texts over max_model_len are reported through the callback.
        """
        if not texts:
            raise InvalidRequestError("text_input holds no text")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidRequestError(f"text_input[{i}] must be a string, got {type(text).__name__}")
            if not text:
                raise InvalidRequestError(f"text_input[{i}] is empty")
        request = EmbeddingRequest(request_id or uuid.uuid4().hex, list(texts),
                                   self.config.normalize if normalize is None else bool(normalize), callback)
        with self._cond:
            if self._stopping or self.error is not None:
                raise EngineDeadError(f"the embedding engine is not running: {self.error or 'shut down'}")
            limit = self.config.max_queue_size
            if limit and self._num_queued_texts + len(texts) > limit:
                raise QueueFullError(f"the waiting queue is full ({limit} texts); retry later")
            self.requests.add(request)
            self._num_queued_texts += len(texts)
            self._inbox.append(request)
            self._cond.notify_all()
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Drop a request (its client went away): its waiting texts are skipped, no callback follows."""
        self.requests.abort(request_id)

    def encode(self, texts: list[str], normalize: bool | None = None, timeout: float | None = None) -> np.ndarray:
        """Blocking convenience: [len(texts), dim] float32 embeddings, or the request's error raised."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.submit(texts, future.set_result, normalize)
        out: EmbeddingOutput = future.result(timeout)
        if out.error is not None:
            raise (InvalidRequestError if out.error_kind == "InvalidRequestError" else RuntimeError)(out.error)
        return out.embeddings

    def stats(self) -> dict:
        with self._cond:
            return {**self.counters, "in_flight_requests": len(self.requests), "queued_texts": self._num_queued_texts}

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop both threads; requests still queued or running get an error output."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)
        self._fail_all(self.error or "the embedding engine is shutting down")

    # ---- scheduler thread --------------------------------------------------------------------------
    def _schedule_loop(self) -> None:
        selected: list[TextItem] = []  # chosen for the next forward, not packed yet
        num_tokens = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._inbox or self._can_select(selected, num_tokens)
                                    or self._publish_due(selected, num_tokens), timeout=self._time_to_pack(selected))
                if self._stopping:
                    return
                new, self._inbox = self._inbox, []
            if new:
                self._admit(new)
            dropped_before = self.scheduler.num_dropped
            added = self.scheduler.schedule(selected)
            if added:
                now = time.time()
                for item in added:
                    item.request.mark("scheduled", now)
                selected += added
                num_tokens += sum(item.num_tokens for item in added)
            with self._cond:
                self._num_queued_texts -= len(added) + self.scheduler.num_dropped - dropped_before
                publish = self._publish_due(selected, num_tokens)
            if publish:
                started = time.perf_counter()
                items = sorted(selected, key=lambda it: it.num_tokens)
                batch = _Batch(items, self.runner.prepare([it.request.token_ids[it.index] for it in items],
                                                          [it.request.normalize for it in items]))
                self._pack_seconds = 0.8 * self._pack_seconds + 0.2 * (time.perf_counter() - started)
                selected, num_tokens = [], 0
                with self._cond:
                    self._next = batch
                    self._cond.notify_all()

    def _can_select(self, selected: list[TextItem], num_tokens: int) -> bool:
        """Is there a waiting text that fits in the batch being selected?"""
        if not self.scheduler.waiting or len(selected) >= self.config.max_num_seqs:
            return False
        return num_tokens + self.scheduler.waiting[0].num_tokens <= self.config.max_num_batched_tokens

    def _publish_due(self, selected: list[TextItem], num_tokens: int) -> bool:
        """Pack the selected texts now? Only into an empty slot, and only when the executor is idle,
        the batch is full, or the running forward is about to end: texts arriving until then join."""
        if not selected or self._next is not None:
            return False
        if self._executor_idle or time.monotonic() >= self._pack_at:
            return True
        return bool(self.scheduler.waiting) and not self._can_select(selected, num_tokens)  # full

    def _time_to_pack(self, selected: list[TextItem]) -> float | None:
        if not selected or self._next is not None or self._executor_idle:
            return None
        return max(0.0, self._pack_at - time.monotonic())

    def _admit(self, requests: list[EmbeddingRequest]) -> None:
        """Tokenize all newly arrived texts in one call; refuse requests with a text that is too long."""
        try:
            encoded = self._tokenize([text for r in requests for text in r.texts])
        except Exception:  # noqa: BLE001 - find the request at fault; the others go on
            if len(requests) > 1:
                for request in requests:
                    self._admit([request])
                return
            with self._cond:
                self._num_queued_texts -= len(requests[0].texts)
            logger.exception("tokenizing a request failed")
            self.requests.fail(requests[0], "the tokenizer failed on text_input", "InvalidRequestError")
            return
        offset = 0
        for request in requests:
            request.token_ids = encoded[offset:offset + len(request.texts)]
            offset += len(request.texts)
            too_long = [(i, len(ids)) for i, ids in enumerate(request.token_ids) if len(ids) > self.max_model_len]
            if too_long:
                i, n = too_long[0]
                with self._cond:
                    self._num_queued_texts -= len(request.texts)
                self.requests.fail(request, f"text_input[{i}] has {n} tokens, more than max_model_len "
                                            f"({self.max_model_len}); shorten it (or set parameter truncate=true)",
                                   "InvalidRequestError")
                continue
            request.embeddings = np.empty((len(request.texts), self.dim), dtype=np.float32)
            self.scheduler.add([TextItem(request, i) for i in range(len(request.texts))])

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        truncate = self.config.truncate
        return self.tokenizer(texts, add_special_tokens=True, truncation=truncate,
                              max_length=self.max_model_len if truncate else None,
                              return_attention_mask=False, return_token_type_ids=False)["input_ids"]

    # ---- executor thread ---------------------------------------------------------------------------
    def _execute_loop(self) -> None:
        while True:
            with self._cond:
                if self._next is None:
                    self._executor_idle = True
                    self._cond.notify_all()  # the scheduler packs whatever it has selected, now
                    self._cond.wait_for(lambda: self._stopping or self._next is not None)
                if self._stopping:
                    return
                batch, self._next = self._next, None
                self._executor_idle = False
                # The scheduler packs the next batch just before this one is expected to end.
                expected_s = batch.prepared.num_tokens / self._tokens_per_s
                self._pack_at = time.monotonic() + expected_s - 2 * self._pack_seconds - _PACK_MARGIN_S
                self._cond.notify_all()
            begin = time.time()
            for item in batch.items:
                item.request.mark("inference_begin", begin)
            try:
                rows = self.runner.run(batch.prepared).numpy()
            except Exception as exc:  # noqa: BLE001 - this batch fails, the engine keeps serving
                logger.exception("an embedding forward failed")
                for item in batch.items:
                    self.requests.fail(item.request, f"internal error: {type(exc).__name__}: {exc}", "InternalError")
                continue
            end = time.time()
            self._tokens_per_s = 0.7 * self._tokens_per_s + 0.3 * batch.prepared.num_tokens / max(end - begin, 1e-6)
            self._count(batch, end - begin)
            for row, item in enumerate(batch.items):
                request = item.request
                if request.done:
                    continue
                request.embeddings[item.index] = rows[row]
                request.mark("inference_end", end)
                request.num_pending -= 1
                if request.num_pending == 0:
                    self.requests.finish(request)

    def _count(self, batch: _Batch, seconds: float) -> None:
        padded = batch.prepared.packed.num_padded_tokens
        with self._cond:
            c = self.counters
            c["batches"] += 1
            c["texts"] += len(batch.items)
            c["tokens"] += batch.prepared.num_tokens
            c["padded_attention_tokens"] += padded
            c["busy_s"] += seconds

    def _fail_all(self, message: str) -> None:
        with self._cond:
            self._inbox, self._next = [], None
        self.requests.fail_all(message)  # the inbox's and the batches' requests are registered too

    def _guard(self, loop: Callable[[], None]) -> None:
        """Run a thread's loop; if it dies, every waiting request hears about it and submit refuses."""
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            with self._cond:
                self.error = f"{type(exc).__name__}: {exc}"
                self._stopping = True
                self._cond.notify_all()
            logger.exception("embedding engine thread died")
            self._fail_all(self.error)
