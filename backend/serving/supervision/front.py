"""The front door of `tritonllm-serve`: the public gRPC, HTTP and metrics ports, in front of tritonserver.

Why a front at all: when a model's stub process dies (an OOM kill, a segfault in a kernel), tritonserver
2.51 keeps every request that stub had accepted open forever. Its Python backend holds their response
factories, so no FINAL response and no error ever comes; unloading the model leaves that version in
UNLOADING for good (the factories keep it alive), loading it again serves new requests but never ends
the old ones, and the server can then not even shut down. Only the end of the tritonserver process
would end those streams, which would take every other model down with it. So clients talk to this front
and tritonserver listens on private loopback ports: the front knows which model each request in flight
is for, and when the supervisor (supervisor.py) finds a model dead it ends that model's requests here,
each with one error that names what happened, while the other models' requests go on untouched.

What passes through unchanged: every gRPC method and HTTP path of tritonserver, as raw bytes (nothing
is re-encoded), with metadata, headers and status codes. What the front decides itself:
- readiness (`/v2/health/ready`, `/v2/models/<m>/ready`, gRPC ServerReady/ModelReady): not ready while
  a model the supervisor serves cannot serve (dead, reloading, failed), while starting and while
  draining, whatever tritonserver would say;
- inference requests for a model that cannot serve, and every new one while draining: refused at once
  (UNAVAILABLE; HTTP 503; on a gRPC stream an error response for that request), with the reason;
- requests in flight when their model dies, or still running at the end of a drain: ended with an
  error response (a stream keeps its other requests);
- `/metrics`: tritonserver's text with `llm_engine_alive` forced to 0 for models that cannot serve (the
  gauge of a dead stub keeps its last value), plus the supervisor's own families (docs/METRICS.md).

A stream request is tracked from the moment it is forwarded until its final response (every response
of a decoupled model carries `triton_final_response`; one without it is a non-decoupled model's only
response) or its error. Give each request on a stream an id when several share one: responses are
matched to requests by (model, id).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import grpc
from aiohttp import web
from tritonclient.grpc import service_pb2

logger = logging.getLogger("tritonllm.front")

SERVICE = "/inference.GRPCInferenceService/"
_UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# HTTP/1.1 hop-by-hop headers (RFC 9110 7.6.1), never forwarded; lengths are set again by aiohttp.
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length"}
_MODEL_PATH = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?(?:/(?P<action>[^/]+))?$")
_REPOSITORY_PATH = re.compile(r"^/v2/repository/models/(?P<model>[^/]+)/(?P<action>load|unload)$")
_INFER_ACTIONS = {"infer", "generate", "generate_stream"}


@dataclass
class Policy:
    """What the front asks of the supervisor; plain callables so the front can be used (and tested) alone."""

    # None when `model` may take requests now; else why not (the client's error message).
    refusal: Callable[[str], str | None] = lambda model: None
    # Whether the server as a whole is ready (every served model serving, not starting, not draining).
    server_ready: Callable[[], bool] = lambda: True
    # Whether tritonserver's answer on a model's readiness is to be asked (False: not ready, say `refusal`).
    model_serving: Callable[[str], bool] = lambda model: True
    # An operator loads (True) or unloads (False) a model through the repository API: called with ok=None
    # before the call goes to tritonserver, then with its outcome.
    on_repository: Callable[[str, bool, bool | None], None] = lambda model, load, ok: None
    # Why the server is not ready (the body of a 503 on /v2/health/ready).
    not_ready_reason: Callable[[], str] = lambda: "not ready"
    # Lines appended to /metrics (the supervisor's own families).
    extra_metrics: Callable[[], str] = lambda: ""


# ---- requests in flight ----------------------------------------------------------------------------
@dataclass(eq=False)
class _Entry:
    model: str
    fail: Callable[[str], None] | None  # ends the request with this error message


class Inflight:
    """Every request in flight through the front, by model; ended here when its model dies or the drain times out."""

    def __init__(self):
        self._entries: set[_Entry] = set()
        self.changed = asyncio.Event()  # set whenever an entry leaves (drain waits on it)
        self.ended: dict[tuple[str, str], int] = {}  # (model, cause) -> requests the front ended with an error

    def add(self, model: str, fail: Callable[[str], None] | None = None) -> _Entry:
        entry = _Entry(model, fail)
        self._entries.add(entry)
        return entry

    def discard(self, entry: _Entry) -> None:
        if entry in self._entries:
            self._entries.discard(entry)
            self.changed.set()

    def count(self, model: str | None = None) -> int:
        return sum(1 for e in self._entries if model is None or e.model == model)

    def fail(self, message: str, cause: str, model: str | None = None) -> int:
        """End every request of `model` (None: every request) with `message`; returns how many."""
        victims = [e for e in self._entries if model is None or e.model == model]
        for entry in victims:
            self.end(entry, message, cause)
        return len(victims)

    def end(self, entry: _Entry, message: str, cause: str) -> None:
        """End one request with an error, counted by cause."""
        if entry not in self._entries:
            return
        self.discard(entry)
        key = (entry.model, cause)
        self.ended[key] = self.ended.get(key, 0) + 1
        try:
            entry.fail(message)
        except Exception:  # noqa: BLE001 - one broken connection must not keep the others waiting
            logger.exception("ending a request of %s failed", entry.model)


# ---- gRPC ------------------------------------------------------------------------------------------
def _stream_error(model: str, request_id: str, message: str) -> bytes:
    """A stream response that ends one request with an error, as tritonserver writes them."""
    response = service_pb2.ModelStreamInferResponse(error_message=message)
    response.infer_response.model_name = model
    response.infer_response.id = request_id
    response.infer_response.parameters["triton_final_response"].bool_param = True
    return response.SerializeToString()


def _forwarded_metadata(context) -> tuple:
    # grpc-* and pseudo headers belong to the connection, not to the call.
    return tuple((k, v) for k, v in (context.invocation_metadata() or ())
                 if not k.startswith(("grpc-", ":")) and k not in ("user-agent", "content-type", "te"))


class _Stream:
    """One client's ModelStreamInfer call: its requests in flight, by (model, id)."""

    def __init__(self, inflight: Inflight, out: asyncio.Queue, status_errors: bool = False):
        self.inflight = inflight
        self.out = out
        # The client takes errors as the stream's gRPC status (triton_grpc_error): an ended request ends
        # the whole stream with `abort` (code, message), as tritonserver does for such a client.
        self.status_errors = status_errors
        self.abort: tuple | None = None
        self.live: dict[tuple[str, str], list[_Entry]] = {}
        self.untracked = 0  # requests the front could not read (tritonserver answers them)
        # The front ended a request that tritonserver still holds: the upstream stream cannot end by itself.
        self.abandoned = False

    def track(self, model: str, request_id: str) -> None:
        key = (model, request_id)
        entry = self.inflight.add(model)

        def fail(message: str) -> None:
            entries = self.live.get(key, [])
            if entry in entries:
                entries.remove(entry)
            if not entries:
                self.live.pop(key, None)
            self.abandoned = True
            if self.status_errors:
                self.abort = self.abort or (grpc.StatusCode.UNAVAILABLE, message)
                self.out.put_nowait(None)
            else:
                self.out.put_nowait(_stream_error(model, request_id, message))

        entry.fail = fail
        self.live.setdefault(key, []).append(entry)

    def settle(self, raw: bytes) -> bool:
        """A response from tritonserver: whether it goes to the client (False: its request was ended here)."""
        try:
            response = service_pb2.ModelStreamInferResponse.FromString(raw)
        except Exception:  # noqa: BLE001 - not ours to judge: pass it on
            return True
        infer = response.infer_response
        key = (infer.model_name, infer.id)
        entries = self.live.get(key)
        if entries is None:
            match = [k for k in self.live if k[1] == infer.id]  # error responses may lack the model name
            entries = self.live.get(match[0]) if match else None
            key = match[0] if match else key
        if entries is None:
            if self.untracked:
                if response.error_message or _is_final(infer):
                    self.untracked -= 1
                return True
            return False  # its request was ended by the front already
        if response.error_message or _is_final(infer):
            entry = entries.pop(0)
            if not entries:
                self.live.pop(key, None)
            self.inflight.discard(entry)
        return True

    def fail_all(self, message: str, cause: str) -> None:
        for entry in [e for group in self.live.values() for e in group]:
            self.inflight.end(entry, message, cause)

    def release(self) -> None:
        for group in list(self.live.values()):
            for entry in group:
                self.inflight.discard(entry)
        self.live.clear()

    @property
    def busy(self) -> bool:
        return bool(self.live) or self.untracked > 0


def _is_final(infer) -> bool:
    params = infer.parameters
    return params["triton_final_response"].bool_param if "triton_final_response" in params else True


class _GrpcFront(grpc.GenericRpcHandler):
    def __init__(self, front: "Front"):
        self.front = front

    def service(self, details):
        method = details.method
        if not method.startswith(SERVICE):
            return None
        name = method[len(SERVICE):]
        if name == "ModelStreamInfer":
            return grpc.stream_stream_rpc_method_handler(self.front._grpc_stream)
        front = self.front

        async def unary(raw: bytes, context) -> bytes:  # a coroutine function: grpc.aio runs it on its loop
            return await front._grpc_unary(name, raw, context)

        return grpc.unary_unary_rpc_method_handler(unary)


# ---- the front ---------------------------------------------------------------------------------------
class Front:
    """Public ports -> tritonserver's private ones. Start with `await start()`, stop with `await stop()`."""

    def __init__(self, upstream_http: str, upstream_grpc: str, upstream_metrics: str | None, policy: Policy,
                 host: str, http_port: int | None, grpc_port: int | None, metrics_port: int | None):
        self.upstream_http, self.upstream_grpc, self.upstream_metrics = upstream_http, upstream_grpc, upstream_metrics
        self.policy = policy
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        self.inflight = Inflight()
        self.refused: collections.Counter = collections.Counter()  # model -> requests refused here
        self.draining = False
        self._channel: grpc.aio.Channel | None = None
        self._grpc_server: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None

    # -- lifecycle
    async def start(self) -> None:
        # No connection limit: a long stream holds its upstream connection, and none may wait behind it.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        if self.upstream_grpc is not None:
            await self.reconnect()
        if self.grpc_port is not None:
            self._grpc_server = grpc.aio.server(options=_UNLIMITED)
            self._grpc_server.add_generic_rpc_handlers((_GrpcFront(self),))
            if not self._grpc_server.add_insecure_port(f"{self.host}:{self.grpc_port}"):
                raise OSError(f"cannot listen for gRPC on {self.host}:{self.grpc_port}")
            await self._grpc_server.start()
        for port, handler in ((self.http_port, self._http), (self.metrics_port, self._metrics)):
            if port is None:
                continue
            app = web.Application(client_max_size=0)  # tensors in a request body have no size limit here
            app.router.add_route("*", "/{tail:.*}", handler)
            # Stopped after the drain: whatever is still open then is ended, not waited for.
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
            await runner.setup()
            await web.TCPSite(runner, self.host, port).start()
            self._runners.append(runner)

    async def reconnect(self) -> None:
        """A channel to tritonserver's gRPC port as it is now (it changes when tritonserver is restarted)."""
        old, self._channel = self._channel, grpc.aio.insecure_channel(self.upstream_grpc, options=_UNLIMITED)
        if old is not None:
            await old.close()

    async def stop(self) -> None:
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace=1.0)
        for runner in self._runners:
            await runner.cleanup()
        if self._channel is not None:
            await self._channel.close()
        if self._session is not None:
            await self._session.close()

    # -- decisions shared by both protocols
    def refusal(self, model: str) -> str | None:
        if self.draining:
            return "the server is shutting down and takes no new requests; retry on another replica"
        if self._channel is None:
            return "the server is starting; retry later"
        return self.policy.refusal(model)

    def _refuse(self, model: str) -> str | None:
        """refusal(), counted: for an inference request about to be answered with it."""
        message = self.refusal(model)
        if message is not None:
            self.refused[model] += 1
        return message

    def fail_model(self, model: str, message: str, cause: str) -> int:
        return self.inflight.fail(message, cause, model)

    def fail_all(self, message: str, cause: str) -> int:
        return self.inflight.fail(message, cause)

    # -- gRPC
    async def _grpc_unary(self, name: str, raw: bytes, context):
        if name == "ServerLive":  # the launcher answers: it lives, and restarts tritonserver if that dies
            return service_pb2.ServerLiveResponse(live=True).SerializeToString()
        if self._channel is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is starting; retry later")
        if name == "ServerReady" and (self.draining or not self.policy.server_ready()):
            return service_pb2.ServerReadyResponse(ready=False).SerializeToString()
        if name == "ModelReady":
            model = service_pb2.ModelReadyRequest.FromString(raw).name
            if self.draining or not self.policy.model_serving(model):
                return service_pb2.ModelReadyResponse(ready=False).SerializeToString()
        if name == "ModelInfer":
            model = service_pb2.ModelInferRequest.FromString(raw).model_name
            refusal = self._refuse(model)
            if refusal is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
            return await self._grpc_tracked_unary(name, model, raw, context)
        if name in ("RepositoryModelLoad", "RepositoryModelUnload"):
            model = getattr(service_pb2, name + "Request").FromString(raw).model_name
            self.policy.on_repository(model, name == "RepositoryModelLoad", None)
            try:
                response = await self._grpc_forward(name, raw, context)
            except grpc.aio.AioRpcError as exc:
                self.policy.on_repository(model, name == "RepositoryModelLoad", False)
                await context.abort(exc.code(), exc.details() or "")
            self.policy.on_repository(model, name == "RepositoryModelLoad", True)
            return response
        try:
            return await self._grpc_forward(name, raw, context)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")

    async def _grpc_forward(self, name: str, raw: bytes, context) -> bytes:
        remaining = context.time_remaining()
        return await self._channel.unary_unary(SERVICE + name)(
            raw, metadata=_forwarded_metadata(context), timeout=remaining if remaining and remaining < 1e8 else None)

    async def _grpc_tracked_unary(self, name: str, model: str, raw: bytes, context) -> bytes:
        failed: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = self.inflight.add(model, lambda message: failed.done() or failed.set_result(message))
        call = asyncio.ensure_future(self._grpc_forward(name, raw, context))
        try:
            done, _ = await asyncio.wait({call, failed}, return_when=asyncio.FIRST_COMPLETED)
            if call in done:
                try:
                    return call.result()
                except grpc.aio.AioRpcError as exc:
                    await context.abort(exc.code(), exc.details() or "")
            await context.abort(grpc.StatusCode.UNAVAILABLE, failed.result())
        finally:
            self.inflight.discard(entry)
            if not call.done():
                call.cancel()

    async def _grpc_stream(self, requests, context):
        """One client stream. Its requests go to tritonserver on a stream of the front's that lives only while
        requests are in flight, then is closed: tritonserver finishes unloading a model only once every
        stream that carried requests to it has ended, so a client's idle stream must not hold one open."""
        if self._channel is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is starting; retry later")
        out: asyncio.Queue = asyncio.Queue()
        metadata = _forwarded_metadata(context)
        # A client that sets triton_grpc_error takes errors as the stream's gRPC status (tritonserver then ends
        # the stream at the first error), not as error messages inside it: the front answers it the same way.
        stream = _Stream(self.inflight, out, status_errors=("triton_grpc_error", "true") in metadata)
        wake = None
        calls: set = set()  # upstream streams not yet ended
        state: dict = {"current": None, "client_done": False}

        async def pump_responses(call) -> None:
            try:
                async for raw in call:
                    out.put_nowait(raw if stream.settle(raw) else wake)
                if call is state["current"] and stream.busy:  # never seen: tritonserver ends a stream last
                    stream.fail_all("tritonserver ended the stream before the request's final response", "upstream")
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED and call is state["current"] and stream.status_errors:
                    stream.abort = stream.abort or (exc.code(), exc.details() or "")
                elif exc.code() != grpc.StatusCode.CANCELLED and call is state["current"]:
                    stream.fail_all(f"the stream to tritonserver broke ({exc.code().name}: {exc.details()}); "
                                    "the request was lost", "upstream")
            finally:
                calls.discard(call)
                if call is state["current"]:
                    state["current"] = None
                out.put_nowait(wake)

        def upstream():
            if state["current"] is None:
                call = self._channel.stream_stream(SERVICE + "ModelStreamInfer")(metadata=metadata)
                calls.add(call)
                asyncio.ensure_future(pump_responses(call))
                state["current"] = call
            return state["current"]

        async def retire(call, abandoned: bool) -> None:
            if abandoned:
                call.cancel()  # what it still holds was ended here and will never finish in tritonserver
                return
            with contextlib.suppress(Exception):
                await call.done_writing()

        async def pump_requests() -> None:
            try:
                async for raw in requests:
                    try:
                        request = service_pb2.ModelInferRequest.FromString(raw)
                    except Exception:  # noqa: BLE001 - tritonserver answers what it cannot read
                        call = upstream()
                        stream.untracked += 1
                        await call.write(raw)
                        continue
                    refusal = self._refuse(request.model_name)
                    if refusal is not None and stream.status_errors:
                        stream.abort = stream.abort or (grpc.StatusCode.UNAVAILABLE, refusal)
                        return
                    if refusal is not None:
                        out.put_nowait(_stream_error(request.model_name, request.id, refusal))
                        continue
                    call = upstream()
                    stream.track(request.model_name, request.id)  # before any await: busy, never retired first
                    try:
                        await call.write(raw)
                    except Exception:  # noqa: BLE001 - it broke: pump_responses ends what it held
                        pass
            finally:
                state["client_done"] = True
                out.put_nowait(wake)

        reader = asyncio.ensure_future(pump_requests())
        try:
            while True:
                if stream.abort is not None:
                    await context.abort(*stream.abort)
                current = state["current"]
                if current is not None and not stream.busy:
                    state["current"] = None
                    asyncio.ensure_future(retire(current, stream.abandoned))
                    stream.abandoned = False
                if state["client_done"] and out.empty() and not stream.busy:
                    break
                item = await out.get()
                if item is not wake:
                    await context.write(item)
        finally:
            stream.release()
            reader.cancel()
            for call in list(calls):
                call.cancel()

    # -- HTTP
    async def _http(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/v2/health/live" and request.method == "GET":
            return web.Response(status=200)  # the launcher answers: it lives, and restarts tritonserver if that dies
        if self.upstream_http is None:
            return web.json_response({"error": "the server is starting; retry later"}, status=503)
        if path == "/v2/health/ready" and request.method == "GET":
            if self.draining:
                return web.json_response({"error": "the server is shutting down"}, status=503)
            if not self.policy.server_ready():
                return web.json_response({"error": self.policy.not_ready_reason()}, status=503)
        match = _MODEL_PATH.match(path)
        if match is not None:
            model, action = match["model"], match["action"]
            if action == "ready" and request.method == "GET" and (not self.policy.model_serving(model) or self.draining):
                return web.json_response({"error": self.refusal(model) or f"model '{model}' is not ready"}, status=503)
            if action in _INFER_ACTIONS and request.method == "POST":
                refusal = self._refuse(model)
                if refusal is not None:
                    return web.json_response({"error": refusal}, status=503)
                return await self._http_tracked(request, model)
        match = _REPOSITORY_PATH.match(path)
        if match is not None and request.method == "POST":
            self.policy.on_repository(match["model"], match["action"] == "load", None)
            response = await self._http_forward(request, self.upstream_http)
            self.policy.on_repository(match["model"], match["action"] == "load", response.status == 200)
            return response
        return await self._http_forward(request, self.upstream_http)

    async def _http_tracked(self, request: web.Request, model: str) -> web.StreamResponse:
        failed: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = self.inflight.add(model, lambda message: failed.done() or failed.set_result(message))
        try:
            return await self._http_forward(request, self.upstream_http, failed)
        finally:
            self.inflight.discard(entry)

    async def _http_forward(self, request: web.Request, upstream: str,
                            failed: asyncio.Future | None = None) -> web.StreamResponse:
        body = await request.read() if request.body_exists else None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        response: web.StreamResponse | None = None
        sse = False

        async def relay() -> web.StreamResponse:
            nonlocal response, sse
            async with self._session.request(request.method, f"http://{upstream}{request.path_qs}", headers=headers,
                                             data=body, allow_redirects=False) as up:
                out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
                response = web.StreamResponse(status=up.status, reason=up.reason, headers=out_headers)
                sse = up.headers.get("Content-Type", "").startswith("text/event-stream")
                await response.prepare(request)
                async for chunk in up.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response

        task = asyncio.ensure_future(relay())
        try:
            waits = {task} if failed is None else {task, failed}
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                try:
                    return task.result()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    message = f"tritonserver did not answer ({type(exc).__name__}: {exc})"
            else:
                message = failed.result()
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            if response is None or not response.prepared:
                return web.json_response({"error": message}, status=503)
            if sse:  # what tritonserver itself writes when a generate_stream request fails mid-way
                with contextlib.suppress(Exception):
                    await response.write(b"data: " + json.dumps({"error": message}).encode() + b"\n\n")
                    await response.write_eof()
            elif request.transport is not None:
                request.transport.close()  # a half-sent body cannot be ended cleanly: the client sees the cut
            return response
        finally:
            if not task.done():
                task.cancel()

    # -- metrics
    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if request.path != "/metrics" or self.upstream_metrics is None:
            if self.upstream_metrics is None:
                return web.Response(status=404)
            return await self._http_forward(request, self.upstream_metrics)
        text = ""
        try:
            async with self._session.get(f"http://{self.upstream_metrics}/metrics",
                                         timeout=aiohttp.ClientTimeout(total=10)) as up:
                if up.status == 200:
                    text = (await up.read()).decode("utf-8", "replace")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass  # tritonserver down or restarting: our own families still tell why
        return web.Response(text=rewrite_metrics(text, self.policy.model_serving) + self.policy.extra_metrics(),
                            content_type="text/plain", charset="utf-8")


_ALIVE = re.compile(r'^(llm_engine_alive\{[^}]*model="(?P<model>[^"]*)"[^}]*\}) (?P<value>\S+)$')


def rewrite_metrics(text: str, serving: Callable[[str], bool]) -> str:
    """tritonserver's metrics, with `llm_engine_alive` 0 for every model that cannot serve now.

    The gauge lives in tritonserver's process but is set by the model's stub: a stub that died leaves
    it at its last value, 1.
    """
    lines = []
    for line in text.splitlines():
        match = _ALIVE.match(line)
        if match is not None and not serving(match["model"]):
            line = f"{match.group(1)} 0"
        lines.append(line)
    return "\n".join(lines) + ("\n" if lines else "")
