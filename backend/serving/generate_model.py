"""Triton Python-backend glue: config.pbtxt -> Engine; requests in, streamed responses out.

auto_complete_config: the inputs, outputs and decoupled policy config.pbtxt leaves out (model_io.py).
initialize: parameters -> EngineConfig, an engine thread, a response thread.
execute:    validate and enqueue every request, return None (decoupled: responses come later).
responses:  one thread turns each request's new text (streaming) or the whole text (not
            streaming) into responses, which leave through the sender threads (response_lanes.py),
            and aborts requests whose client cancelled or went away.
finalize:   abort what is in flight, send their final responses, stop both threads.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import queue
import signal
import threading
import time
import uuid

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside tritonserver (docs, linters): the module only exists in the stub
    pb_utils = None

from tritonllm.core.config import EngineConfig
from tritonllm.core.errors import EngineDeadError, QueueFullError
from tritonllm.core.outputs import RequestOutput
from tritonllm.core.parameters import ConfigError
from tritonllm.core.sampling_params import InvalidRequestError
from tritonllm.serving import engine_health, orphan_guard, stub_exit
from tritonllm.core.error_kinds import KIND_OF_ERROR, asks_for_kind, with_kind
from tritonllm.serving.instance_config import config_from_triton
from tritonllm.serving.metrics import EngineMetrics
from tritonllm.serving.model_io import GENERATE_INPUTS, GENERATE_OUTPUTS, complete_config, missing_inputs_error
from tritonllm.serving.request_parsing import parse_request
from tritonllm.serving.response_assembly import ResponseAssembler
from tritonllm.serving.response_lanes import ResponseLanes

logger = logging.getLogger("tritonllm")

_CANCEL_CHECK_S = 0.2  # is_cancelled() is a round trip to the server: a step or so is soon enough
_METRICS_REFRESH_S = 0.5


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

    __slots__ = ("request_id", "sender", "assembler", "lane", "cancelled", "lock", "send_queued", "closed",
                 "error_kind_in_message")

    def __init__(self, request_id: str, sender, assembler: ResponseAssembler, lane: int,
                 error_kind_in_message: bool = False):
        self.request_id = request_id
        self.sender = sender
        self.error_kind_in_message = error_kind_in_message  # its error, if any, begins with "[kind] " (error_kinds.py)
        self.assembler = assembler
        self.lane = lane  # every response of this request leaves through this lane (response_lanes.py)
        self.cancelled = False  # not streaming: aborted, its final response (what it had) on the way
        # Coalescing (`response_coalescing`): a send queued on the lane whose response is not built yet
        # takes every output that arrives meanwhile; the lock orders the lane's build and the new outputs.
        self.lock = threading.Lock()
        self.send_queued = False
        # Its FINAL response is built (and may be sent): its sender must not be asked is_cancelled() any
        # more. tritonserver frees a response factory with its FINAL response, and the Python backend's
        # is_cancelled() on a freed one crashes the server (Signal 11 in ResponseFactoryIsCancelled).
        # Set and read under `lock`, which a lane's build of the FINAL response also takes.
        self.closed = False


class _ToResponses:
    """A request's output callback: its outputs to the response thread (engine_loop.py's callbacks)."""

    __slots__ = ("active", "outputs")

    def __init__(self, active: _Active, outputs: queue.SimpleQueue):
        self.active, self.outputs = active, outputs

    def __call__(self, out: RequestOutput) -> None:
        self.outputs.put((self.active, out))


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """Triton asks before initialize: the tensors config.pbtxt does not list, and decoupled streaming."""
        stub_exit.skip_interpreter_teardown()  # this stub exits once it has answered (stub_exit.py)
        return complete_config(auto_complete_model_config, GENERATE_INPUTS, GENERATE_OUTPUTS, decoupled=True)

    def initialize(self, args: dict) -> None:
        stub_exit.skip_interpreter_teardown()  # tritonserver waits for this stub's exit (stub_exit.py)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        self._orphan_guard = orphan_guard.start()  # this stub must not outlive tritonserver (orphan_guard.py)
        # `kill -USR1 <stub pid>` writes every Python thread's stack into the server log: for a model that
        # stops answering, where its threads wait (the stub's stderr is tritonserver's).
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        # And a crash of the stub (in a C++ kernel, say) leaves the Python stacks there too.
        faulthandler.enable(all_threads=True)
        self.model_config = json.loads(args["model_config"])
        # First: with auto-complete off, the decoupled check below would fail too, naming the lesser cause.
        if (missing := missing_inputs_error(self.model_config, GENERATE_INPUTS)) is not None:
            raise pb_utils.TritonModelException(missing)
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                "this model streams: set model_transaction_policy { decoupled: true } in config.pbtxt, or leave it out")
        try:
            config = engine_config_from_triton(args, self.model_config)
        except ConfigError as exc:
            raise pb_utils.TritonModelException(f"invalid config.pbtxt parameter: {exc}") from None
        logging.getLogger("tritonllm").setLevel(config.serving.log_level.upper())
        self.model_name = args.get("model_name", "model")
        started = time.perf_counter()
        # A step's outputs as one list of (_ToResponses, engine output); outputs outside steps (aborts,
        # errors) one by one as (request, engine output).
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        # Built and warmed on the loop thread that will run it (see EngineLoop on OpenMP pools).
        # The engine (and torch with it) is imported here, not with this module: Triton's auto-complete
        # stub imports the module for auto_complete_config alone, and importing torch is most of that stub's start.
        from tritonllm.engine.engine import Engine
        from tritonllm.engine.engine_loop import EngineLoop

        self.loop = EngineLoop.build(lambda: Engine(config), deliver_step=self._outputs.put)
        self.engine = self.loop.engine
        self.instance_name = instance_label(args, self.model_name)
        self.metrics = (EngineMetrics(pb_utils, self.model_name, args.get("model_version", "1"), self.instance_name,
                                      self.engine.max_model_len, self.engine.step_num_tokens)
                        if config.serving.enable_metrics else None)
        if self.metrics is not None:
            # Right from the start: llm_engine_alive reads 0 until the first refresh otherwise.
            self.metrics.refresh(self.loop.stats, self.loop.alive)
        self._active: dict[str, _Active] = {}
        self._pending: dict[str, _Active] = {}  # streams with n > 1 whose news wait for the step's last output
        self._stopping = threading.Event()
        self._death_reported = False  # the engine died and the model is unloading itself (engine_health.py)
        self._lanes = ResponseLanes(config.serving.response_threads)
        self._coalesce = config.serving.response_coalescing and config.serving.response_threads > 0
        self._responder = threading.Thread(target=self._respond_loop, name="tritonllm-responses", daemon=True)
        self._responder.start()
        logger.info("model %s instance %s ready in %.1f s: device=%s dtype=%s kv_blocks=%d",
                    self.model_name, self.instance_name, time.perf_counter() - started, self.engine.device,
                    self.engine.dtype, self.engine.runner.num_blocks)

    # ---- requests in -------------------------------------------------------------------------
    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            parameters = request.parameters()
            tagged = asks_for_kind(parameters)
            try:
                self._submit(request, parameters, sender, tagged)
            except InvalidRequestError as exc:
                self._send_error(sender, str(exc), "invalid_argument", tagged=tagged)
            except (QueueFullError, EngineDeadError) as exc:
                self._send_error(sender, str(exc), "unavailable", tagged=tagged)
            except Exception as exc:  # noqa: BLE001 - one bad request never stops the others
                logger.exception("request failed")
                self._send_error(sender, f"internal error: {exc}", "internal", tagged=tagged)
        return None

    def _submit(self, request, parameters: str, sender, tagged: bool) -> None:
        inputs = {}
        for spec in GENERATE_INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            if tensor is not None:
                inputs[spec.name] = tensor.as_numpy()
        parsed = parse_request(inputs, parameters, self.engine.lora_names)
        assembler = ResponseAssembler(parsed, self.engine.tokenizer.decode, self.engine.config.scheduler.stream_interval)
        active = _Active(uuid.uuid4().hex, sender, assembler, self._lanes.lane(), tagged)
        # Registered before submitting: the first output may arrive before submit() returns.
        self._active[active.request_id] = active
        try:
            self.loop.submit(_ToResponses(active, self._outputs), parsed.prompt, parsed.params,
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
                item = self._outputs.get(timeout=_CANCEL_CHECK_S)
            except queue.Empty:
                item = None
            if isinstance(item, list):  # one step's outputs
                for to_responses, out in item:
                    self._handle_safely(to_responses.active, out)
                # A step's outputs have all arrived: one response per request with n > 1 for all of them.
                pending, self._pending = self._pending, {}
                for active in pending.values():
                    try:
                        self._send(active)
                    except Exception:  # noqa: BLE001 - keep serving the other streams
                        self._failed(active)
            elif item is not None:
                self._handle_safely(*item)
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
            if self.loop.error is not None and not self._death_reported:
                # The engine thread ends every request it held with an error (engine_loop.py); the
                # model must not stay READY refusing everything.
                self._death_reported = True
                if self.metrics is not None:  # llm_engine_alive 0 now, not at the next refresh
                    try:
                        self.metrics.refresh(self.loop.stats, False)
                    except Exception:  # noqa: BLE001 - metrics must never stop the responses
                        logger.exception("refreshing metrics failed")
                engine_health.report_engine_death(pb_utils, self.model_name, self.instance_name, self.loop.error)

    def _handle_safely(self, active: _Active, out: RequestOutput) -> None:
        try:
            self._handle(active, out)
        except Exception:  # noqa: BLE001 - keep serving the other streams
            self._failed(active)

    def _handle(self, active: _Active, out: RequestOutput) -> None:
        if out.finished and out.error is None and self.metrics is not None:
            self.metrics.record_finished(out, active.assembler.parsed.params.n)  # per completion: n > 1 counts n
        if active.request_id not in self._active:
            return  # already closed (cancelled, or an error ended it)
        if out.error is not None:
            self._active.pop(active.request_id, None)
            self._pending.pop(active.request_id, None)
            if active.assembler.parsed.params.n > 1:
                self.loop.abort(active.request_id)  # its other completions: nobody will hear them
            self._send_error(active.sender, out.error, KIND_OF_ERROR.get(out.error_kind, "unavailable"), active.lane,
                             active.error_kind_in_message)
            return
        assembler = active.assembler
        with active.lock:
            assembler.add(out)
            if active.send_queued:
                return  # the send waiting on its lane builds its response later: these tokens go in it
        if assembler.finished:
            self._pending.pop(active.request_id, None)
            self._send(active)
        elif assembler.parsed.stream and assembler.due:
            if assembler.parsed.params.n == 1:
                self._send(active)
            else:  # sent once this step's outputs of the other completions are in too
                self._pending[active.request_id] = active

    def _send(self, active: _Active) -> None:
        assembler = active.assembler
        on_failure = lambda _: self._failed(active)  # noqa: E731
        # Coalescing: a stream's later responses are built when its lane reaches them, so that while
        # the sends lag behind the steps a request's tokens of several steps leave in one response.
        # Its first response is built at once and carries its first token alone (the time to first
        # token is never traded), and a request with n > 1 keeps one response per step.
        if self._coalesce and assembler.parsed.stream and assembler.parsed.params.n == 1 and assembler.num_taken:
            with active.lock:
                active.send_queued = True
            self._lanes.send_built(active.lane, active.sender, lambda: self._build(active, queued=True), on_failure)
            return
        self._lanes.send(active.lane, active.sender, *self._build(active), on_failure=on_failure)

    def _build(self, active: _Active, queued: bool = False) -> tuple | None:
        """The next response of `active` and its flags (FINAL once it has finished); None for a queued
        build of a request that an error or a cancellation has ended meanwhile (its FINAL is on the way)."""
        assembler = active.assembler
        with active.lock:
            if queued:
                active.send_queued = False
                if self._active.get(active.request_id) is not active:
                    return None
            tensors = [pb_utils.Tensor(name, array) for name, array in assembler.take_outputs().items()]
            parameters = assembler.response_parameters()
            finished = active.closed = assembler.finished
        if parameters and _response_parameters_supported():
            response = pb_utils.InferenceResponse(output_tensors=tensors, parameters=parameters)
        else:
            response = pb_utils.InferenceResponse(output_tensors=tensors)
        flags = 0
        if finished:
            self._active.pop(active.request_id, None)
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        return response, flags

    def _failed(self, active: _Active) -> None:
        logger.exception("sending a response for %s failed", active.request_id)
        self._active.pop(active.request_id, None)
        self._pending.pop(active.request_id, None)
        self.loop.abort(active.request_id)  # nobody can receive its tokens any more

    def _check_cancelled(self) -> None:
        """Abort the requests whose client cancelled, answering as the vLLM backend does: a stream gets a
        FINAL response with a CANCELLED error; a whole-text request gets what it had generated (the
        engine's abort finishes its completions with finish_reason `abort`)."""
        for request_id, active in list(self._active.items()):
            with active.lock:  # a lane building its FINAL response meanwhile waits for the answer
                if active.cancelled or active.closed:
                    continue
                try:
                    cancelled = active.sender.is_cancelled()
                except Exception:  # noqa: BLE001 - a sender that cannot answer is treated as gone
                    cancelled = True
            if not cancelled:
                continue
            # The vLLM backend's log lines, which its CI (request_cancellation_test.py) looks for in the
            # server log; the engine drops the request before its next step.
            logger.info("[vllm] Cancelling the request %s", request_id)
            self.loop.abort(request_id)
            logger.info("[vllm] Successfully cancelled the request %s", request_id)
            if not active.assembler.parsed.stream:
                active.cancelled = True
                continue
            self._active.pop(request_id, None)
            self._pending.pop(request_id, None)
            code = getattr(pb_utils.TritonError, "CANCELLED", None)  # older stubs: an empty FINAL response
            response = (None if code is None else
                        pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError("Request was cancelled", code)))
            # A failure is not logged: the client is gone, there is nothing to tell it.
            self._lanes.send(active.lane, active.sender, response, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                             on_failure=lambda _: None)

    def _send_error(self, sender, message: str, kind: str, lane: int = -1, tagged: bool = False) -> None:
        """A FINAL response carrying the error; kind: invalid_argument | unavailable | internal.
        `lane`: the request's lane, after its responses already on the way (-1: at once). `tagged`: the
        request asked for the kind in the message (error_kinds.py)."""
        if self.metrics is not None:
            self.metrics.record_error(kind)
        code = {"invalid_argument": pb_utils.TritonError.INVALID_ARG, "unavailable": pb_utils.TritonError.UNAVAILABLE,
                "internal": pb_utils.TritonError.INTERNAL}[kind]
        error = pb_utils.TritonError(with_kind(kind, message) if tagged else message, code)
        self._lanes.send(lane, sender, pb_utils.InferenceResponse(output_tensors=[], error=error),
                         pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        """Abort in-flight requests (each gets a final error response) and stop the threads."""
        self.loop.shutdown()
        self._stopping.set()
        self._responder.join(timeout=30)
        self._lanes.close()
        if self.metrics is not None and not self._responder.is_alive():  # else it may still record
            self.metrics.close()
            self.metrics = None
        logger.info("model %s instance %s finalized", self.model_name, self.instance_name)
