"""The OpenAI-compatible HTTP server: FastAPI routes over `TritonBackend`; `main` runs it with uvicorn.

    python -m tritonllm.openai --triton-url 127.0.0.1:8001 --port 9000

`tritonllm-serve --openai-port 9000` starts it beside tritonserver (`child_process.py`). It holds no
model: every completion is a Triton request, so it can start before tritonserver is ready (requests
then get 503) and follows models as they are loaded and unloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tritonllm.openai.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, check_context, invalid,
                                      parse_body, warn_ignored)
from tritonllm.openai.reasoning import PARSERS, answer_starts_thinking
from tritonllm.openai.choices import Choices
from tritonllm.openai.background_responses import BackgroundResponses
from tritonllm.openai.responses_api import ResponseOutput, ResponsesRequest, ResponseStore
from tritonllm.openai.token_bytes import token_bytes_of
from tritonllm.openai.tool_parsers import FORMATS
from tritonllm.openai.tools import ToolSettings, plan_tools, read_chat_template
from tritonllm.openai.triton import TritonBackend, TritonOutput, TritonRequest

logger = logging.getLogger("tritonllm.openai")

DEFAULT_PORT = 9000  # scripts/serve.sh's; tritonllm-serve starts this server only with --openai-port
OPTIONS_ENV = "TRITONLLM_OPENAI_ARGS"  # more options, e.g. "--enable-auto-tool-choice --tool-call-parser hermes"


class _AnswerUnexpected:
    """A failure of this server's own, before its answer started: logged, and answered with a 500 in
    OpenAI's shape (clients read `error`). Not as an exception handler: Starlette re-raises after those,
    and the connection is then dropped under the client's next request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:  # noqa: BLE001 - answered, and logged with its traceback
            if started:
                raise
            logger.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=exc)
            error = OpenAIError(500, f"{type(exc).__name__}: {exc}", "internal_error")
            await JSONResponse(error.body(), status_code=500)(scope, receive, send)


class _ClientGone(Exception):
    """The HTTP client disconnected: nobody is left to answer."""


class _Jobs:
    """A request's Triton requests (one per prompt), run at once; their outputs merged in arrival order."""

    def __init__(self, backend: TritonBackend, requests: list[TritonRequest]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending = len(requests)
        self._buffer: list[tuple[int, TritonOutput]] = []
        self._tasks = [asyncio.ensure_future(self._run(backend, k, r)) for k, r in enumerate(requests)]

    async def _run(self, backend: TritonBackend, k: int, request: TritonRequest) -> None:
        try:
            async for out in backend.stream(request):
                self._queue.put_nowait((k, out, None))
        except OpenAIError as exc:
            self._queue.put_nowait((k, None, exc))
        except Exception as exc:  # noqa: BLE001 - reported to the client as a 500, never lost
            logger.exception("Triton request %s failed", request.request_id)
            self._queue.put_nowait((k, None, OpenAIError(500, f"{type(exc).__name__}: {exc}", "internal_error")))
        finally:
            self._queue.put_nowait((k, None, None))

    async def _next(self):
        """(prompt index, output), or None when every request has ended; raises a request's error."""
        while self._pending:
            k, out, error = await self._queue.get()
            if error is not None:
                raise error
            if out is not None:
                return k, out
            self._pending -= 1
        return None

    async def prime(self) -> None:
        """Wait for every request's first response, so that a refused request is answered with its
        HTTP status before a stream's headers go out."""
        started: set[int] = set()
        while len(started) < len(self._tasks):
            item = await self._next()
            if item is None:
                return
            self._buffer.append(item)
            started.add(item[0])

    async def outputs(self) -> AsyncIterator[tuple[int, TritonOutput]]:
        while self._buffer:
            yield self._buffer.pop(0)
        while (item := await self._next()) is not None:
            yield item

    async def close(self) -> None:
        """Cancel the requests still running (each then cancels its Triton request)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    """Returns when the HTTP client has gone (the body is already read, so only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelling it if the client disconnects first (then _ClientGone)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone()
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


def _import_tokenizer_libraries() -> None:
    """transformers' tokenizer and configuration classes, torch beneath them, and transformers.activations,
    which a model's configuration class pulls in with its type checks (and with it torch.distributed.tensor):
    nearly all of a tokenizer's first load, and the same for every model."""
    from transformers import AutoTokenizer, PretrainedConfig  # noqa: F401

    with suppress(ImportError):  # a later transformers may move it: only this head start is lost
        import transformers.activations  # noqa: F401


async def _load_tokenizers(backend: TritonBackend, embeddings=None, wait_s: float = 1800, poll_s: float = 0.2) -> None:
    """Load the generate models' tokenizers once tritonserver is ready, so that the first chat request
    does not wait for transformers (seconds), and those of the embedding models ready by then
    (`embeddings`: the EmbeddingsFront, embeddings.py). Which tokenizers is known only once the models
    are ready, but the libraries they need are imported at once, while the models load (this server starts
    with tritonserver under `tritonllm-serve`). Bounded: gives up after `wait_s`; requests load them anyway."""
    try:
        await asyncio.to_thread(_import_tokenizer_libraries)
    except Exception:  # noqa: BLE001 - a request that needs a tokenizer reports the error
        logger.warning("importing transformers ahead of requests failed", exc_info=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if await backend.ready():
                models = await backend.generate_models()
                if models:
                    for info in models.values():
                        await backend.tokenizer(info)
                    for model in (await embeddings.models()).values() if embeddings is not None else ():
                        await embeddings.tokenizer(model)
                    return
        except Exception:  # noqa: BLE001 - a request that needs the tokenizer reports the error
            logger.warning("loading a tokenizer ahead of requests failed", exc_info=True)
            return
        await asyncio.sleep(poll_s)


async def _parse(model_class, raw: Request):
    """The JSON body, whatever the Content-Type says (curl -d sends form encoding unless told)."""
    return parse_body(model_class, await raw.body())


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def create_app(triton_url: str, tools: ToolSettings | None = None, model_repository: str | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """The app; `tools`: the chat template and tool call options (vLLM's --chat-template,
    --enable-auto-tool-choice, --tool-call-parser), for every generate model; `model_repository`: where the
    models' multi_lora.json files are (their LoRA adapters then are models here too); `reasoning_parser`:
    vLLM's --reasoning-parser (reasoning.py)."""
    backend = TritonBackend(triton_url, model_repository)
    tools = tools or ToolSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        warm = asyncio.ensure_future(_load_tokenizers(backend, getattr(app.state, "embeddings", None)))
        yield
        warm.cancel()
        await asyncio.gather(warm, return_exceptions=True)
        await background.close()
        await backend.close()

    app = FastAPI(title="tritonllm OpenAI-compatible API", lifespan=lifespan)
    app.state.backend = backend

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(invalid(exc.errors()).body(), status_code=400)

    app.add_middleware(_AnswerUnexpected)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        """An unknown path or method, in OpenAI's error shape too (clients read `error.message`)."""
        error = OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                            {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))
        body = error.body()
        body["error"]["type"] = "invalid_request_error" if exc.status_code < 500 else body["error"]["type"]
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health():
        """200 when tritonserver is ready (the probe of this server's readiness)."""
        if await backend.ready():
            return Response(status_code=200)
        return JSONResponse(OpenAIError(503, f"tritonserver at {triton_url} is not ready", "unavailable").body(),
                            status_code=503)

    def model_card(info) -> dict:
        card = {"id": info.name, "object": "model", "created": started, "owned_by": "tritonllm"}
        if info.parent is not None:  # a LoRA adapter: its base model, as vLLM lists one
            card["parent"] = card["root"] = info.parent
        if info.max_model_len is not None:
            card["max_model_len"] = info.max_model_len
        return card

    started = int(time.time())

    @app.get("/v1/models")
    async def list_models():
        models = await backend.generate_models()
        return {"object": "list", "data": [model_card(info) for _, info in sorted(models.items())]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        return model_card(await backend.model(name))

    @app.post("/v1/completions")
    async def completions(raw: Request):
        body = await _parse(CompletionRequest, raw)
        return await _in_its_words(body, complete(raw, body))

    async def complete(raw: Request, body: CompletionRequest):
        body.check()
        body.warn_ignored()
        model = await backend.model(body.model)
        prompts = body.prompts()
        if model.max_model_len is not None:
            for p in prompts:
                if isinstance(p, str):
                    # A text has at most a token per byte (plus special tokens): only a long one is counted.
                    if len(p.encode("utf-8")) + 8 + (body.max_tokens or 0) <= model.max_model_len:
                        continue
                    tokenizer = await backend.tokenizer(model)
                    p = await asyncio.to_thread(tokenizer.encode, p)
                check_context(model.max_model_len, len(p), body.max_tokens, body.truncate_prompt_tokens, "prompt")
        echo = None
        if body.echo:
            tokenizer = None
            echo = []
            for p in prompts:
                if isinstance(p, str):
                    echo.append(p)
                else:
                    tokenizer = tokenizer or await backend.tokenizer(model)
                    echo.append(tokenizer.decode(p))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        sampling = body.sampling_parameters()
        requests = [TritonRequest(model, p, sampling, body.stream, body.return_logprobs, f"{request_id}-{k}")
                    for k, p in enumerate(prompts)]
        choices = Choices(chat=False, n=body.n, num_prompts=len(prompts), top_logprobs=body.logprobs, echo=echo)
        return await _answer(backend, raw, body, model.name, request_id, requests, choices)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        body = await _parse(ChatCompletionRequest, raw)
        return await _in_its_words(body, chat(raw, body))

    async def chat(raw: Request, body: ChatCompletionRequest):
        body.check()
        body.warn_ignored()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        model, requests, choices = await prepare_chat(body, request_id)
        return await _answer(backend, raw, body, model.name, request_id, requests, choices)

    async def prepare_chat(body: ChatCompletionRequest, request_id: str):
        """A checked chat request -> its model, its Triton request and the choices its outputs fill."""
        plan = plan_tools(body, tools)
        model = await backend.model(body.model)
        messages = body.template_messages()
        tokenizer = await backend.tokenizer(model)
        template_kwargs = body.template_kwargs()
        if plan is not None:
            template_kwargs["tools"] = plan.tools  # as transformers passes them: `tools` in the template
        if tools.chat_template is not None:
            template_kwargs["chat_template"] = tools.chat_template
        try:
            # The model's own `apply_chat_template` input wraps one user message; the tokenizer's
            # template takes any conversation, and gives the same tokens for one user message.
            ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages, tokenize=True, return_dict=False,
                                          **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja's errors name the template's complaint
            raise OpenAIError(400, f"the chat template cannot render these messages: {exc}", "invalid_request",
                              "messages") from None
        check_context(model.max_model_len, len(ids), body.max_new_tokens, body.truncate_prompt_tokens)
        sampling = body.sampling_parameters(plan.guide if plan is not None else None)
        thinking = None
        if reasoning_parser is not None:
            thinking = await asyncio.to_thread(answer_starts_thinking, tokenizer, messages, template_kwargs)
            if "guided_decoding" in sampling:  # the answer is guided, the thinking before it is free
                sampling["guided_decoding"] = {**sampling["guided_decoding"], "thinking": "open" if thinking else "allowed"}
        requests = [TritonRequest(model, list(ids), sampling, body.stream, body.return_logprobs, request_id)]
        choices = Choices(chat=True, n=body.n, num_prompts=1, top_logprobs=body.top_logprobs, tools=plan,
                          token_bytes=token_bytes_of(tokenizer) if body.logprobs else None, thinking=thinking,
                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        return model, requests, choices

    stored = ResponseStore()
    background = BackgroundResponses(stored)

    @app.post("/v1/responses")
    async def create_response(raw: Request):
        body = await _parse(ResponsesRequest, raw)
        body.check()
        warn_ignored(body.ignored_fields())
        conversation = (stored.history(body.previous_response_id) if body.previous_response_id else [])
        conversation += body.input_messages()
        chat = body.chat_request(conversation)  # its errors name the Responses fields already
        return await _in_its_words(body, respond(raw, body, conversation, chat))

    async def respond(raw: Request, body: ResponsesRequest, conversation: list[dict], chat: ChatCompletionRequest):
        chat.check()
        if body.background:
            chat.stream = True  # its tokens as they come, so that what it has written shows while it runs
        output = ResponseOutput(body, "")
        model, requests, choices = await prepare_chat(chat, output.id)
        output.response["model"] = model.name
        items = body.input_items() if body.store else None
        if body.background:
            first = background.start(output, body.stream, _background_generation(backend, requests, choices, output),
                                     lambda events: stored.put(output, conversation, items, events))
            if not body.stream:
                return first[0]["response"]  # queued
            return _sse_response(await background.follow(output.id, None))
        return await _answer_response(backend, raw, body, requests, choices, output,
                                      lambda: stored.put(output, conversation, items) if body.store else None)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False, starting_after: int | None = None):
        if stream:
            return _sse_response(await background.follow(response_id, starting_after))
        return stored.get(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await background.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, after: str | None = None, limit: int = 20, order: str = "desc"):
        return stored.input_items(response_id, after, limit, order)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if stored.get(response_id)["status"] in ("queued", "in_progress"):
            await background.cancel(response_id)  # nothing runs on for a response nobody can fetch
        return stored.delete(response_id)

    from tritonllm.openai.embeddings import register_embeddings  # /v1/embeddings (embeddings.py)
    register_embeddings(app, backend)
    return app


async def _in_its_words(body, work):
    """Await a request's `work`; its errors name the fields this request's client sent (RequestBody.named)."""
    try:
        return await work
    except OpenAIError as exc:
        raise body.named(exc) from None


def _sse_event(event: dict) -> str:
    """A Responses API event, named as OpenAI's are (`event:` beside `data:`)."""
    return f"event: {event['type']}\n" + _sse(event)


async def _answer_response(backend: TritonBackend, raw: Request, body: ResponsesRequest, requests: list[TritonRequest],
                           choices: Choices, output: ResponseOutput, keep):
    """A Responses API answer: the whole response, or its events; `keep` stores it once whole."""
    jobs = _Jobs(backend, requests)

    def ending() -> list[dict]:
        events = output.finish(choices.choices[0].finish_reason, choices.tool_calls(0), choices.usage())
        keep()
        return events

    async def whole():
        async for k, out in jobs.outputs():
            for delta in choices.add(k, out):
                output.add(delta)
        ending()
        return output.response

    async def events():
        try:
            for event in output.start():
                yield _sse_event(event)
            async for k, out in jobs.outputs():
                for delta in choices.add(k, out):
                    for event in output.add(delta):
                        yield _sse_event(event)
            for event in ending():
                yield _sse_event(event)
        except Exception as exc:  # noqa: BLE001 - after the first event: the stream ends as failed, never cut
            if not isinstance(exc, OpenAIError):
                logger.exception("response %s failed", output.id)
                exc = OpenAIError(500, f"{type(exc).__name__}: {exc}", "internal_error")
            for event in output.failed(body.named(exc)):
                yield _sse_event(event)

    return await _run(raw, jobs, body.stream, whole, events)


def _background_generation(backend: TritonBackend, requests: list[TritonRequest], choices: Choices,
                           output: ResponseOutput):
    """A background response's generation (background_responses.py): no client watches it."""
    async def generate(record) -> None:
        jobs = _Jobs(backend, requests)
        try:
            async for k, out in jobs.outputs():
                for delta in choices.add(k, out):
                    record(output.add(delta))
            record(output.finish(choices.choices[0].finish_reason, choices.tool_calls(0), choices.usage()))
        finally:
            await jobs.close()
    return generate


def _sse_response(events) -> StreamingResponse:
    """Responses API events as they come; a client that goes away stops only its own reading."""
    async def text():
        async for event in events:
            yield _sse_event(event)
    return StreamingResponse(text(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _answer(backend: TritonBackend, raw: Request, body, model: str, request_id: str,
                  requests: list[TritonRequest], choices: Choices):
    jobs = _Jobs(backend, requests)

    async def whole():
        async for k, out in jobs.outputs():
            choices.add(k, out)
        return choices.response(request_id, model, body.return_logprobs)

    final_usage, continuous_usage = body.wants_usage()

    async def events():
        try:
            first = choices.first_chunk_choices()
            if first:
                yield _sse(choices.chunk(request_id, model, first, choices.usage() if continuous_usage else None))
            async for k, out in jobs.outputs():
                for delta in choices.add(k, out):
                    chunk = choices.chunk(request_id, model, [choices.delta_choice(delta)],
                                          choices.usage() if continuous_usage else None)
                    yield _sse(chunk)
            if final_usage:
                yield _sse(choices.chunk(request_id, model, [], choices.usage()))
        except OpenAIError as exc:  # after the headers: the error goes in the stream, as vLLM's does
            yield _sse(body.named(exc).body())
        yield "data: [DONE]\n\n"

    return await _run(raw, jobs, body.stream, whole, events)


async def _run(raw: Request, jobs: _Jobs, stream: bool, whole, events):
    """Serve a request's Triton jobs: `whole()`'s answer, or (streaming) the text `events()` yields. A
    refused request is answered with its HTTP status before a stream's headers go out; a client that
    goes away cancels the jobs (Starlette cancels the stream's generator, whose `finally` closes them)."""
    if not stream:
        try:
            return await _unless_disconnected(raw, whole())
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the Triton requests are cancelled
        finally:
            await jobs.close()
    try:
        await _unless_disconnected(raw, jobs.prime())
    except BaseException as exc:
        await jobs.close()
        if isinstance(exc, _ClientGone):
            return Response(status_code=499)
        raise

    async def closing():
        try:
            async for text in events():
                yield text
        finally:
            await jobs.close()

    return StreamingResponse(closing(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- running it ------------------------------------------------------------------------------

def _exit_with_parent(parent_pid: int) -> None:
    """Stop this server when the process that started it is gone (tritonllm-serve, or the tritonserver it
    became by exec): the server must not outlive it and keep the port."""
    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonllm.openai",
                                     description="OpenAI-compatible HTTP API in front of tritonserver")
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process is gone")
    parser.add_argument("--model-repository", default=None,
                        help="tritonserver's model repository: each model's multi_lora.json adapters are listed and "
                             "served as models of their own")
    parser.add_argument("--chat-template", default=None,
                        help="chat template for every model: a file, a shipped template's name (chatml_hermes_tools), "
                             "or the template's text; default: each model's tokenizer's")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto" (needs --tool-call-parser)')
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(FORMATS),
                        help="how the models write tool calls")
    parser.add_argument("--reasoning-parser", default=None, choices=PARSERS,
                        help="give a reasoning model's thinking (between <think> and </think>) apart from its answer: "
                             "chat's `reasoning`, a Responses API reasoning item")
    # Options for this server from the environment, before the command line's: how they reach it when
    # tritonllm-serve (scripts/serve.sh) starts it.
    argv = shlex.split(os.environ.get(OPTIONS_ENV, "")) + list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        template = read_chat_template(args.chat_template) if args.chat_template is not None else None
        tools = ToolSettings(template, args.enable_auto_tool_choice, args.tool_call_parser)
    except ValueError as exc:
        parser.error(str(exc))
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if args.exit_with_parent:
        _exit_with_parent(os.getppid())
    uvicorn.run(create_app(args.triton_url, tools, args.model_repository, args.reasoning_parser), host=args.host,
                port=args.port, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=5)
