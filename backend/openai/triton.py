"""The Triton side of the OpenAI server: the generate models, their tokenizers, one streamed request.

Every completion is one Triton request on its own gRPC bidirectional stream (`tritonclient.grpc.aio`,
one channel for all): an error then belongs to that request alone. The stream is half-closed once
the final response has arrived, and cancelled only when the HTTP client went away before it: the
model then aborts the request and frees its KV blocks (docs/API.md, cancellation).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from tritonllm.core.multi_lora import read_multi_lora
from tritonllm.core.parameters import ConfigError
from tritonllm.openai.protocol import PASSED_ON, OpenAIError
from tritonllm.core.error_kinds import KIND_PARAMETER, split_kind

K = TypeVar("K")
V = TypeVar("V")

logger = logging.getLogger("tritonllm.openai")

_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.RESOURCE_EXHAUSTED: 503}
# A request's error comes as a message inside its stream; our models begin it with its kind when the
# request asks (core/error_kinds.py: the header that would make it the stream's status crashes
# tritonserver 2.51). A message without a kind is tritonserver's own, or another model's.
_KIND_STATUS = {"invalid_argument": 400, "unavailable": 503, "internal": 500}
# The model's sampling parameters that its messages start by naming; each request class says which of
# its fields sets each (RequestBody.field_of).
_PARAMETERS = frozenset(PASSED_ON + ("temperature", "max_tokens", "logit_bias", "logprobs", "best_of", "input_ids"))
_CODES = {400: "invalid_request", 404: "model_not_found", 503: "unavailable", 500: "internal_error"}
_DRAIN_S = 5.0  # after the final response, how long the stream's clean end is waited for


@dataclass
class ModelInfo:
    """A generate model of the repository, from Triton's model config."""

    name: str
    config: dict
    # A LoRA adapter of a generate model (its multi_lora.json) is a model of its own here, as in vLLM:
    # `parent` is the generate model that serves it, whose config this is; None for a generate model.
    parent: str | None = None

    @property
    def triton_model(self) -> str:
        """The Triton model the requests go to (the parent of an adapter)."""
        return self.parent or self.name

    @property
    def inputs(self) -> set[str]:
        return {tensor["name"] for tensor in self.config.get("input", [])}

    def parameter(self, key: str, default: str = "") -> str:
        return self.config.get("parameters", {}).get(key, {}).get("string_value", default)

    @property
    def max_model_len(self) -> int | None:
        value = self.parameter("max_model_len")
        return int(value) if value.strip().isdigit() else None


def is_generate_model(config: dict) -> bool:
    """Our generate models (and Triton's vLLM backend's): decoupled, with text_input and text_output."""
    inputs = {tensor["name"] for tensor in config.get("input", [])}
    outputs = {tensor["name"] for tensor in config.get("output", [])}
    decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)
    return decoupled and "text_input" in inputs and "text_output" in outputs


@dataclass
class TritonOutput:
    """One Triton response, per completion (`n` of them)."""

    texts: list[str]
    token_counts: list[int]  # this response's new tokens, per completion
    logprobs: list[list[float]] | None = None  # each new token's log-prob, per completion
    top_logprobs: list[list[dict]] | None = None  # per completion, per token: {id: {logprob, rank, decoded_token}}
    ids: list[list[int]] | None = None  # this response's new token ids, per completion (our models send them)
    finish_reasons: list[str] | None = None
    num_input_tokens: int | None = None
    prompt_logprobs: list | None = None
    final: bool = False


def _strings(result, name: str) -> list[str] | None:
    array = result.as_numpy(name)
    if array is None:
        return None
    return [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in array.reshape(-1)]


def parse_output(result) -> TritonOutput:
    texts = _strings(result, "text_output") or [""]
    counts_array = result.as_numpy("num_output_tokens")
    ids = result.as_numpy("output_ids")
    if counts_array is not None:
        counts = [int(c) for c in counts_array.reshape(-1)]
    else:  # a model that does not return counts: n = 1 assumed
        counts = [0 if ids is None else int(ids.size)]
    out = TritonOutput(texts=texts, token_counts=counts)
    if ids is not None:
        flat_ids, start, out.ids = ids.reshape(-1).tolist(), 0, []
        for count in counts:
            out.ids.append(flat_ids[start:start + count])
            start += count
    flat = result.as_numpy("output_log_probs")
    if flat is not None:
        flat, start, out.logprobs = flat.reshape(-1).tolist(), 0, []
        for count in counts:
            out.logprobs.append(flat[start:start + count])
            start += count
    top = _strings(result, "logprobs")
    if top is not None:
        out.top_logprobs = [json.loads(text) if text else [] for text in top]
    out.finish_reasons = _strings(result, "finish_reason")
    num_input = result.as_numpy("num_input_tokens")
    if num_input is not None:
        out.num_input_tokens = int(num_input.reshape(-1)[0])
    prompt = _strings(result, "prompt_logprobs")
    if prompt:
        out.prompt_logprobs = json.loads(prompt[0])
    final = result.get_response().parameters.get("triton_final_response")
    # Our model marks its last response by finish_reason too, which counts where the parameter is absent.
    out.final = bool(final.bool_param) if final is not None else out.finish_reasons is not None
    return out


def error_from_grpc(exc: grpc.aio.AioRpcError) -> OpenAIError:
    status = _HTTP_STATUS.get(exc.code(), 500)
    return OpenAIError(status, exc.details() or str(exc.code()), _CODES[status])


def error_in_stream(message: str) -> OpenAIError:
    """The OpenAI error of a request's error message inside its stream; `param` is the request field it
    starts by naming (the model's messages about a sampling parameter do: "temperature must be ...")."""
    kind, message = split_kind(message)
    status = _KIND_STATUS.get(kind, 500)
    named = re.match(r"([a-z_]+) ", message)
    param = named.group(1) if named and status == 400 and named.group(1) in _PARAMETERS else None
    return OpenAIError(status, message, _CODES[status], param)


@dataclass
class TritonRequest:
    """What one Triton request of a completion carries."""

    model: ModelInfo
    prompt: str | list[int]
    sampling: dict
    stream: bool
    logprobs: bool
    request_id: str = ""
    inputs: list = field(default_factory=list)

    def build(self) -> list:
        def tensor(name: str, value, dtype: str):
            t = grpcclient.InferInput(name, [1], dtype)
            t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else bool))
            return t

        declared = self.model.inputs
        if isinstance(self.prompt, str):
            inputs = [tensor("text_input", self.prompt.encode("utf-8"), "BYTES")]
        else:
            if "input_ids" not in declared:
                raise OpenAIError(400, f"model {self.model.name} takes no token ids (input_ids)", "invalid_request",
                                  "prompt")
            ids = grpcclient.InferInput("input_ids", [len(self.prompt)], "INT32")
            ids.set_data_from_numpy(np.array(self.prompt, dtype=np.int32))
            inputs = [ids]
        sampling = self.sampling if self.model.parent is None else {**self.sampling, "lora_name": self.model.name}
        inputs.append(tensor("sampling_parameters", json.dumps(sampling).encode("utf-8"), "BYTES"))
        flags = {"stream": self.stream, "exclude_input_in_output": True, "return_finish_reason": True,
                 "return_num_input_tokens": True, "return_num_output_tokens": True,
                 "return_logprobs": self.logprobs}
        inputs += [tensor(name, value, "BOOL") for name, value in flags.items() if name in declared]
        return inputs


class TritonBackend:
    """The connection to tritonserver's gRPC endpoint, shared by every HTTP request."""

    def __init__(self, url: str, model_repository: str | None = None):
        """`model_repository`: tritonserver's repository folder, where each model's multi_lora.json names its
        LoRA adapters (listed and served as models of their own); None: no adapters are listed."""
        self.url = url
        self.model_repository = Path(model_repository) if model_repository else None
        self.client: grpcaio.InferenceServerClient | None = None
        self._models: dict[str, ModelInfo] = {}
        self._not_ready: dict[str, tuple[str, str]] = {}  # in the repository, not serving: name -> (state, reason)
        self._tokenizers: dict[Path, asyncio.Future] = {}
        self._folders: dict[str, Path] = {}  # config.pbtxt `model` -> its prepared folder

    async def start(self) -> None:
        keepalive = grpcclient.KeepAliveOptions()
        channel_args = [  # tritonclient's own defaults, which channel_args replaces...
            ("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            # ...and a short reconnect backoff: this server starts before tritonserver listens (or outlives
            # a restart of it), and gRPC's default backoff grows to two minutes of failing every request.
            ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.client = grpcaio.InferenceServerClient(self.url, channel_args=channel_args)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready())
        except (InferenceServerException, grpc.RpcError):
            return False

    async def generate_models(self) -> dict[str, ModelInfo]:
        """The repository's generate models that can serve, asked of Triton each time (models load and
        unload): READY in the repository index and ready as /v2/models/NAME/ready says (a supervised
        server says not ready while a model restarts). The others are kept, with their state, for `model`."""
        try:
            index = await self.client.get_model_repository_index(as_json=True)
            models, not_ready = {}, {}
            for entry in index.get("models", []):
                name = entry.get("name")
                state, reason = entry.get("state", ""), entry.get("reason", "")
                if name in models:
                    continue
                if state != "READY" or not await self.client.is_model_ready(name):
                    if state == "READY":
                        state = "NOT_READY"
                    if not_ready.get(name, ("",))[0] not in ("LOADING", "NOT_READY"):  # a version loading wins
                        not_ready[name] = (state, reason)
                    continue
                not_ready.pop(name, None)
                config = (await self.client.get_model_config(name, as_json=True)).get("config", {})
                if is_generate_model(config):
                    models[name] = ModelInfo(name, config)
                    for adapter in self._adapters(name):
                        models.setdefault(adapter, ModelInfo(adapter, config, parent=name))
        except InferenceServerException as exc:
            raise OpenAIError(503, f"tritonserver at {self.url} does not answer: {exc.message()}", "unavailable")
        self._models, self._not_ready = models, not_ready
        return models

    def _adapters(self, name: str) -> list[str]:
        """The LoRA adapters of the repository's model `name` (its multi_lora.json), as the model reads them."""
        if self.model_repository is None:
            return []
        try:
            return [adapter for adapter, _ in read_multi_lora(self.model_repository / name)]
        except ConfigError:  # the model refuses the file at load too, and says why
            return []

    def _not_serving(self, name: str) -> OpenAIError | None:
        """503 for a model of the repository that is loading (or restarting): it will serve, so retry."""
        state, reason = self._not_ready.get(name, ("", ""))
        if state in ("LOADING", "NOT_READY"):
            doing = "is loading" if state == "LOADING" else "is not ready (it is starting again)"
            return OpenAIError(503, f"The model `{name}` {doing}; retry shortly", "model_not_ready", "model")
        return None

    async def model(self, name: str | None) -> ModelInfo:
        """The generate model `name` (the only one, where a request names none); 404 if there is none."""
        if name is not None and name in self._models:
            return self._models[name]
        models = await self.generate_models()
        if name is None:
            bases = [info for info in models.values() if info.parent is None]  # a LoRA adapter is never implied
            if len(bases) == 1:
                return bases[0]
            loading = sorted(n for n in self._not_ready if self._not_serving(n) is not None)
            if not models and loading:
                raise self._not_serving(loading[0])
            raise OpenAIError(400, f"model is required; the generate models are {sorted(models)}",
                              "invalid_request", "model")
        if name not in models:
            refusal = self._not_serving(name)
            if refusal is not None:
                raise refusal
            state, reason = self._not_ready.get(name, ("", ""))
            where = (f" (it is in the repository, {state or 'not loaded'}{': ' + reason if reason else ''})"
                     if name in self._not_ready
                     else " or does not generate text (an embedding model serves /v1/embeddings)")
            raise OpenAIError(404, f"The model `{name}` does not exist{where}; the generate models are "
                              f"{sorted(models)}", "model_not_found", "model")
        return models[name]

    async def tokenizer(self, model: ModelInfo):
        """The model's tokenizer, loaded once per model folder (the `model` parameter of config.pbtxt)."""
        from tritonllm.models.model_files import resolve_model_dir

        name = model.parameter("model", "default")
        if name not in self._folders:
            self._folders[name] = await asyncio.to_thread(resolve_model_dir, name)
        folder = self._folders[name]
        return await load_once(self._tokenizers, folder, partial(_load_tokenizer, folder))

    async def stream(self, request: TritonRequest) -> AsyncIterator[TritonOutput]:
        """The request's responses up to the final one; an error raises OpenAIError.

        Closing the iterator before the final response (the HTTP client went away) cancels the
        Triton request.
        """
        ended = asyncio.Event()
        inputs = request.build()

        async def requests():
            yield {"model_name": request.model.triton_model, "inputs": inputs, "request_id": request.request_id,
                   "parameters": {KIND_PARAMETER: True}}
            # The stream stays open until the final response: half-closing then ends it cleanly, where
            # cancelling a finished stream can leave tritonserver 2.51 unable to unload the model
            # (docs/CLIENT.md).
            await ended.wait()

        call = self.client.stream_infer(requests())
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise error_in_stream(error.message())
                out = parse_output(result)
                if out.final:
                    finished = True
                    ended.set()
                yield out
                if finished:
                    break
            else:
                finished = True
                raise OpenAIError(500, "tritonserver ended the stream before the final response", "internal_error")
        except grpc.aio.AioRpcError as exc:
            finished = True
            raise error_from_grpc(exc) from None
        finally:
            ended.set()
            if not finished:
                call.cancel()
        try:  # the server ends the stream after the half-close: wait for that, briefly
            await asyncio.wait_for(_drain(call), _DRAIN_S)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            pass


async def _drain(call) -> None:
    async for _ in call:
        pass


async def load_once(loads: dict[K, asyncio.Future], key: K, load: Callable[[], V]) -> V:
    """`load()`'s result for `key`, loaded in a worker thread once however many requests ask for it at
    the same time (each awaits the one future in `loads`). A failed load is forgotten: a later request
    tries again."""
    if key not in loads:
        loads[key] = asyncio.ensure_future(asyncio.to_thread(load))
    try:
        return await asyncio.shield(loads[key])
    except Exception:
        loads.pop(key, None)
        raise


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
