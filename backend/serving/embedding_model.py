"""Triton Python-backend glue for embedding models: config.pbtxt -> EmbeddingEngine; texts in, vectors out.

Transaction policy: NOT decoupled, so plain unary gRPC/HTTP `infer` calls work (one request, one
response). execute() still does not block: it validates and enqueues each request, takes its
response sender and returns None; a response thread sends each request's single FINAL response
when the engine is done with it. The Python backend of Triton 24.10 (server 2.51) supports this
response-sender path for non-decoupled models (verified: eight concurrent one-second requests on one
instance finish in one second), so our scheduler, not Triton's, batches across requests
(max_batch_size: 0, no dynamic_batching). The same code also works with `decoupled: true`.

Inputs: `text_input` STRING [-1] (one or many texts), optional `normalize` BOOL [1] (or a request
parameter `normalize`). Output: `embedding` FP32 [texts, dim]. A bad request gets an INVALID_ARG
error response; the other requests are unaffected. They are defined in model_io.py, and
auto_complete_config gives Triton those config.pbtxt does not list.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside tritonserver (docs, tests of the parsing): the module only exists in the stub
    pb_utils = None

from tritonllm.core.parameters import ConfigError
from tritonllm.core.sampling_params import InvalidRequestError
from tritonllm.embeddings.config import EmbeddingConfig, resolve_embedding_model_dir
from tritonllm.embeddings.request import EmbeddingOutput
from tritonllm.serving import orphan_guard, stub_exit
from tritonllm.core.error_kinds import KIND_OF_ERROR
from tritonllm.serving.instance_config import config_from_triton
from tritonllm.serving.model_io import EMBEDDING_INPUTS, complete_config, embedding_outputs, missing_inputs_error
from tritonllm.serving.request_parsing import MAX_TEXT_BYTES, _bool, _scalar, _text

logger = logging.getLogger("tritonllm")

_CANCEL_CHECK_S = 0.05


def embedding_config_from_triton(args: dict, model_config: dict) -> EmbeddingConfig:
    """config.pbtxt `parameters` plus the instance kind/device id -> EmbeddingConfig."""
    return config_from_triton(EmbeddingConfig, args, model_config)


def parse_embedding_request(inputs: dict[str, np.ndarray], parameters_json: str | None) -> tuple[list[str], bool | None]:
    """(texts, normalize or None for the model's default) from a request's tensors and parameters."""
    normalize = None
    if parameters_json:
        try:
            params = json.loads(parameters_json)
        except json.JSONDecodeError:
            params = {}
        if "normalize" in params:
            normalize = _bool(params["normalize"], "normalize")
    if "normalize" in inputs:
        normalize = _bool(_scalar(inputs["normalize"], "normalize"), "normalize")
    if "text_input" not in inputs:
        raise InvalidRequestError("the request has no text_input")
    values = np.asarray(inputs["text_input"], dtype=object).reshape(-1)
    if values.size == 0:
        raise InvalidRequestError("text_input holds no text")
    total = sum(len(v) for v in values if isinstance(v, (bytes, str)))
    if total > 16 * MAX_TEXT_BYTES:  # bounded request size, whatever the number of texts
        raise InvalidRequestError(f"text_input is larger than {16 * MAX_TEXT_BYTES} bytes in all")
    texts = [_text(v, f"text_input[{i}]") for i, v in enumerate(values)]
    for i, text in enumerate(texts):
        if not text:
            raise InvalidRequestError(f"text_input[{i}] is empty")
    return texts, normalize


def _embedding_size(model_config: dict) -> int:
    """The `model` parameter's hidden size (the embedding's length) from its config.json; -1 if unknown.

    Read without loading the model, so the served config can say [texts, 384] as it did when
    config.pbtxt wrote it. Anything wrong with the model is left for initialize to report.
    """
    model = model_config.get("parameters", {}).get("model", {}).get("string_value", "")
    try:
        with open(resolve_embedding_model_dir(model) / "config.json") as f:
            size = json.load(f)["hidden_size"]
        return size if isinstance(size, int) and size > 0 else -1
    except (OSError, ValueError, KeyError, TypeError):
        return -1


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """Triton asks before initialize: the tensors config.pbtxt does not list. Not decoupled (see above)."""
        stub_exit.skip_interpreter_teardown()  # this stub exits once it has answered (stub_exit.py)
        outputs = embedding_outputs(_embedding_size(auto_complete_model_config.as_dict()))
        return complete_config(auto_complete_model_config, EMBEDDING_INPUTS, outputs)

    def initialize(self, args: dict) -> None:
        stub_exit.skip_interpreter_teardown()  # tritonserver waits for this stub's exit (stub_exit.py)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        self._orphan_guard = orphan_guard.start()  # this stub must not outlive tritonserver (orphan_guard.py)
        self.model_config = json.loads(args["model_config"])
        if (missing := missing_inputs_error(self.model_config, EMBEDDING_INPUTS)) is not None:
            raise pb_utils.TritonModelException(missing)
        try:
            config = embedding_config_from_triton(args, self.model_config)
        except ConfigError as exc:
            raise pb_utils.TritonModelException(f"invalid config.pbtxt parameter: {exc}") from None
        self.model_name = args.get("model_name", "model")
        # Imported here, not with this module: Triton's auto-complete stub imports the module for
        # auto_complete_config alone, and importing the engine's torch is most of that stub's start.
        from tritonllm.embeddings.engine import EmbeddingEngine

        self.engine = EmbeddingEngine(config)
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, object] = {}  # request id -> response sender, for cancellation checks
        self._stopping = threading.Event()
        self._responder = threading.Thread(target=self._respond_loop, name="tritonllm-embed-responses", daemon=True)
        self._responder.start()
        logger.info("embedding model %s ready: device=%s dtype=%s dim=%d",
                    self.model_name, self.engine.device, self.engine.dtype, self.engine.dim)

    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {}
                for spec in EMBEDDING_INPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
                    if tensor is not None:
                        inputs[spec.name] = tensor.as_numpy()
                texts, normalize = parse_embedding_request(inputs, request.parameters())
                request_id = uuid.uuid4().hex
                self._active[request_id] = sender  # before submit: the answer may come before it returns
                try:
                    self.engine.submit(texts, lambda out, s=sender: self._outputs.put((s, out)), normalize,
                                       request_id=request_id)
                except BaseException:
                    self._active.pop(request_id, None)
                    raise
            except Exception as exc:  # noqa: BLE001 - one bad request never stops the others
                kind = KIND_OF_ERROR.get(type(exc).__name__, "internal")
                if kind == "internal":
                    logger.exception("embedding request failed")
                self._send_error(sender, str(exc) if kind != "internal" else f"internal error: {exc}", kind)
        return None

    def _respond_loop(self) -> None:
        last_check = time.monotonic()
        while not (self._stopping.is_set() and self._outputs.empty()):
            try:
                sender, out = self._outputs.get(timeout=_CANCEL_CHECK_S)
            except queue.Empty:
                sender = out = None
            if out is not None:
                self._active.pop(out.request_id, None)
                try:
                    self._respond(sender, out)
                except Exception:  # noqa: BLE001 - keep serving the other requests
                    logger.exception("sending the response of %s failed", out.request_id)
            if time.monotonic() - last_check >= _CANCEL_CHECK_S:
                last_check = time.monotonic()
                self._check_cancelled()

    def _respond(self, sender, out: EmbeddingOutput) -> None:
        if out.error is not None:
            self._send_error(sender, out.error, KIND_OF_ERROR.get(out.error_kind, "internal"))
            return
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("embedding", out.embeddings)])
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _check_cancelled(self) -> None:
        for request_id, sender in list(self._active.items()):
            try:
                cancelled = sender.is_cancelled()
            except Exception:  # noqa: BLE001 - a sender that cannot answer is treated as gone
                cancelled = True
            if cancelled and self._active.pop(request_id, None) is not None:
                self.engine.abort(request_id)
                self._send_error(sender, "the request was cancelled", "cancelled")

    def _send_error(self, sender, message: str, kind: str) -> None:
        """The request's one FINAL response, carrying the error."""
        code = {"invalid_argument": pb_utils.TritonError.INVALID_ARG, "unavailable": pb_utils.TritonError.UNAVAILABLE,
                "cancelled": pb_utils.TritonError.CANCELLED, "internal": pb_utils.TritonError.INTERNAL}[kind]
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001 - the client is gone; nothing to tell it
            logger.debug("could not send an error response: %s", message)

    def finalize(self) -> None:
        """Fail what is in flight (each request gets its error response) and stop the threads."""
        self.engine.shutdown()
        self._stopping.set()
        self._responder.join(timeout=30)
        logger.info("embedding model %s finalized", self.model_name)
