"""Triton Python-backend glue: config.pbtxt -> Engine; requests in, streamed responses out.

initialize: parameters -> EngineConfig, an engine thread, a response thread.
execute:    validate and enqueue every request, return None (decoupled: responses come later).
responses:  one thread sends each request's new text (streaming) or the whole text (not
            streaming), and aborts requests whose client cancelled or went away.
finalize:   abort what is in flight, send their final responses, stop both threads.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import uuid

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside tritonserver (docs, linters): the module only exists in the stub
    pb_utils = None

from .config import ConfigError, EngineConfig, config_from_triton
from .engine import Engine, QueueFullError
from .engine_loop import EngineDeadError, EngineLoop
from .outputs import RequestOutput
from .metrics import EngineMetrics
from . import orphan_guard
from .request_parsing import ParsedRequest, parse_request
from .sampling_params import InvalidRequestError

logger = logging.getLogger("tritonllm")

_INPUT_NAMES = ("text_input", "input_ids", "stream", "sampling_parameters", "exclude_input_in_output",
                "apply_chat_template", "return_finish_reason", "return_num_input_tokens",
                "return_num_output_tokens", "return_logprobs", "return_cumulative_logprob")
_CANCEL_CHECK_S = 0.2  # is_cancelled() is a round trip to the server: a step or so is soon enough
_METRICS_REFRESH_S = 0.5
_ERROR_KINDS = {"InvalidRequestError": "invalid_argument", "QueueFullError": "unavailable",
                "EngineDeadError": "unavailable"}


def engine_config_from_triton(args: dict, model_config: dict) -> EngineConfig:
    """config.pbtxt `parameters` plus the instance kind/device id -> EngineConfig."""
    return config_from_triton(EngineConfig, args, model_config)


def instance_label(args: dict, model_name: str) -> str:
    """A name for this instance that no other instance of the model shares (the metrics label).

    Triton names instances "<group>_<index>" (smollm2_0_0, smollm2_0_1), but gives the instances
    of one KIND_GPU group on different GPUs (`gpus: [0, 1]`) the same name: add the GPU for those.
    """
    name = args.get("model_instance_name") or f"{model_name}_0"
    if args.get("model_instance_kind") == "GPU":
        name += f"_gpu{args.get('model_instance_device_id', '0')}"
    return name


_PARAMETERS_SUPPORTED: list[bool] = []


def _response_parameters_supported() -> bool:
    """Response parameters need Triton >= 24.11's Python backend; older stubs reject them."""
    if not _PARAMETERS_SUPPORTED:
        try:
            pb_utils.InferenceResponse(output_tensors=[], parameters={"probe": 1})
            _PARAMETERS_SUPPORTED.append(True)
        except TypeError:
            _PARAMETERS_SUPPORTED.append(False)
    return _PARAMETERS_SUPPORTED[0]


class _Active:
    """A request the response thread is serving."""

    __slots__ = ("request_id", "sender", "parsed", "text", "ids", "logprobs", "top_logprobs", "cumulative_logprob")

    def __init__(self, request_id: str, sender, parsed: ParsedRequest):
        self.request_id = request_id
        self.sender = sender
        self.parsed = parsed
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list = []  # per token, when the request asked for them
        self.cumulative_logprob = 0.0  # of every token so far (return_cumulative_logprob)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        self._orphan_guard = orphan_guard.start()  # this stub must not outlive tritonserver (orphan_guard.py)
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                "this model streams: set model_transaction_policy { decoupled: true } in config.pbtxt")
        try:
            config = engine_config_from_triton(args, self.model_config)
        except ConfigError as exc:
            raise pb_utils.TritonModelException(f"invalid config.pbtxt parameter: {exc}") from None
        logging.getLogger("tritonllm").setLevel(config.log_level.upper())
        self.model_name = args.get("model_name", "model")
        started = time.perf_counter()
        # Built and warmed on the loop thread that will run it (see EngineLoop on OpenMP pools).
        self.loop = EngineLoop.build(lambda: Engine(config))
        self.engine = self.loop.engine
        self.instance_name = instance_label(args, self.model_name)
        self.metrics = (EngineMetrics(pb_utils, self.model_name, args.get("model_version", "1"), self.instance_name)
                        if config.enable_metrics else None)
        if self.metrics is not None:
            # Right from the start: llm_engine_alive reads 0 until the first refresh otherwise.
            self.metrics.refresh(self.loop.stats, self.loop.alive)
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, _Active] = {}
        self._stopping = threading.Event()
        self._responder = threading.Thread(target=self._respond_loop, name="tritonllm-responses", daemon=True)
        self._responder.start()
        logger.info("model %s instance %s ready in %.1f s: device=%s dtype=%s kv_blocks=%d (verified paths: cpu)",
                    self.model_name, self.instance_name, time.perf_counter() - started, self.engine.device,
                    self.engine.dtype, self.engine.runner.num_blocks)

    # ---- requests in -------------------------------------------------------------------------
    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except InvalidRequestError as exc:
                self._send_error(sender, str(exc), "invalid_argument")
            except (QueueFullError, EngineDeadError) as exc:
                self._send_error(sender, str(exc), "unavailable")
            except Exception as exc:  # noqa: BLE001 - one bad request never stops the others
                logger.exception("request failed")
                self._send_error(sender, f"internal error: {exc}", "internal")
        return None

    def _submit(self, request, sender) -> None:
        inputs = {}
        for name in _INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        parsed = parse_request(inputs, request.parameters())
        active = _Active(uuid.uuid4().hex, sender, parsed)
        if not parsed.exclude_input_in_output and not parsed.stream and parsed.prompt is not None:
            active.text.append(parsed.prompt)  # vLLM-backend compatible: the prompt leads the full text
        # Registered before submitting: the first output may arrive before submit() returns.
        self._active[active.request_id] = active
        try:
            self.loop.submit(lambda out: self._outputs.put((active, out)), parsed.prompt, parsed.params,
                             prompt_token_ids=parsed.prompt_token_ids,
                             apply_chat_template=parsed.apply_chat_template, request_id=active.request_id)
        except BaseException:
            self._active.pop(active.request_id, None)
            raise

    # ---- responses out -----------------------------------------------------------------------
    def _respond_loop(self) -> None:
        last_cancel_check = last_refresh = time.monotonic()
        while not (self._stopping.is_set() and not self._active and self._outputs.empty()):
            try:
                active, out = self._outputs.get(timeout=_CANCEL_CHECK_S)
            except queue.Empty:
                active = out = None
            if active is not None:
                try:
                    self._handle(active, out)
                except Exception:  # noqa: BLE001 - keep serving the other streams
                    logger.exception("sending a response for %s failed", active.request_id)
                    self._active.pop(active.request_id, None)
                    self.loop.abort(active.request_id)  # nobody can receive its tokens any more
            now = time.monotonic()
            if now - last_cancel_check >= _CANCEL_CHECK_S:
                last_cancel_check = now
                self._check_cancelled()
            if self.metrics is not None and now - last_refresh >= _METRICS_REFRESH_S:
                last_refresh = now
                try:
                    self.metrics.refresh(self.loop.stats, self.loop.alive)
                except Exception:  # noqa: BLE001 - metrics must never stop the responses
                    logger.exception("refreshing metrics failed")

    def _handle(self, active: _Active, out: RequestOutput) -> None:
        if out.finished and out.error is None and self.metrics is not None:
            self.metrics.record_finished(out)
        if active.request_id not in self._active:
            return  # already closed (cancelled)
        if out.error is not None:
            self._active.pop(active.request_id, None)
            self._send_error(active.sender, out.error, _ERROR_KINDS.get(out.error_kind, "unavailable"))
            return
        p = active.parsed
        if p.return_cumulative_logprob:
            active.cumulative_logprob += math.fsum(out.new_logprobs)
        if p.stream:
            if out.new_token_ids or out.new_text or out.finished:
                response = self._response(p, out.new_text, out.new_token_ids, out.new_logprobs,
                                          out.new_top_logprobs, out, active.cumulative_logprob)
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
                active.sender.send(response, flags=flags)
        else:
            active.text.append(out.new_text)
            active.ids += out.new_token_ids
            active.logprobs += out.new_logprobs
            active.top_logprobs += out.new_top_logprobs
            if out.finished:
                response = self._response(p, "".join(active.text), active.ids, active.logprobs,
                                          active.top_logprobs, out, active.cumulative_logprob)
                active.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if out.finished:
            self._active.pop(active.request_id, None)

    def _response(self, p: ParsedRequest, text: str, ids: list[int], logprobs: list[float], top_logprobs: list,
                  out: RequestOutput, cumulative_logprob: float):
        tensors = [
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int32)),
        ]
        if p.return_logprobs:
            tensors.append(pb_utils.Tensor("output_log_probs", np.asarray(logprobs, dtype=np.float32)))
            if p.params.top_logprobs is not None:
                tensors.append(pb_utils.Tensor("logprobs", np.array([self._logprobs_json(top_logprobs)], dtype=np.object_)))
        if p.return_cumulative_logprob:  # the request's so far, as the vLLM backend's
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array([cumulative_logprob], dtype=np.float32)))
        if p.return_finish_reason and out.finished:
            tensors.append(pb_utils.Tensor("finish_reason", np.array([out.finish_reason.encode()], dtype=np.object_)))
        if p.return_num_input_tokens:
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([out.num_prompt_tokens], dtype=np.uint32)))
        if p.return_num_output_tokens:  # the tokens of this response, as the vLLM backend: a stream's sum is the total
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([len(ids)], dtype=np.uint32)))
        parameters = {}
        if out.finished:
            # Per-request timestamps (ns since the epoch) for clients and benchmarks.
            parameters = {f"timing_{k}_ns": int(v * 1e9) for k, v in out.times.items() if v}
            parameters["num_cached_prompt_tokens"] = out.num_cached_prompt_tokens
        if parameters and _response_parameters_supported():
            return pb_utils.InferenceResponse(output_tensors=tensors, parameters=parameters)
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _logprobs_json(self, top_logprobs: list) -> bytes:
        """The vLLM backend's `logprobs`: per token {token id: {logprob, rank, decoded_token}}."""
        decode = self.engine.tokenizer.decode
        return json.dumps([{str(t): {"logprob": lp, "rank": rank, "decoded_token": decode([t])} for t, lp, rank in entries}
                           for entries in top_logprobs]).encode("utf-8")

    def _check_cancelled(self) -> None:
        for request_id, active in list(self._active.items()):
            try:
                cancelled = active.sender.is_cancelled()
            except Exception:  # noqa: BLE001 - a sender that cannot answer is treated as gone
                cancelled = True
            if cancelled:
                self._active.pop(request_id, None)
                self.loop.abort(request_id)
                try:
                    active.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception:  # noqa: BLE001 - the client is gone; nothing to tell it
                    pass

    def _send_error(self, sender, message: str, kind: str) -> None:
        """A FINAL response carrying the error; kind: invalid_argument | unavailable | internal."""
        if self.metrics is not None:
            self.metrics.record_error(kind)
        code = {"invalid_argument": pb_utils.TritonError.INVALID_ARG, "unavailable": pb_utils.TritonError.UNAVAILABLE,
                "internal": pb_utils.TritonError.INTERNAL}[kind]
        error = pb_utils.TritonError(message, code)
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        """Abort in-flight requests (each gets a final error response) and stop the threads."""
        self.loop.shutdown()
        self._stopping.set()
        self._responder.join(timeout=30)
        logger.info("model %s instance %s finalized", self.model_name, self.instance_name)
