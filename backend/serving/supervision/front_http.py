"""The front's HTTP and metrics ports: every path of tritonserver's, forwarded with headers and status.

What it decides itself: /v2/health/live (the launcher lives), readiness (503 while a model cannot serve
or the server drains), inference for a model that cannot serve (503 with the reason), the end of requests
whose model died (an error event on a generate_stream, a cut connection on a half-sent body), and
/metrics (metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import aiohttp
from aiohttp import web

from tritonllm.serving.supervision.metrics import rewrite_metrics

# HTTP/1.1 hop-by-hop headers (RFC 9110 7.6.1), never forwarded; lengths are set again by aiohttp.
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length"}
_MODEL_PATH = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?(?:/(?P<action>[^/]+))?$")
_REPOSITORY_PATH = re.compile(r"^/v2/repository/models/(?P<model>[^/]+)/(?P<action>load|unload)$")
_INFER_ACTIONS = {"infer", "generate", "generate_stream"}


class HttpFront:
    def __init__(self, front):
        self.front = front  # the Front: tritonserver's addresses, requests in flight, decisions

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/v2/health/live" and request.method == "GET":
            return web.Response(status=200)  # the launcher answers: it lives, and restarts tritonserver if that dies
        if self.front.upstream_http is None:
            return web.json_response({"error": "the server is starting; retry later"}, status=503)
        if path == "/v2/health/ready" and request.method == "GET":
            if self.front.draining:
                return web.json_response({"error": "the server is shutting down"}, status=503)
            if not self.front.policy.server_ready():
                return web.json_response({"error": self.front.policy.not_ready_reason()}, status=503)
        match = _MODEL_PATH.match(path)
        if match is not None:
            model, action = match["model"], match["action"]
            if action == "ready" and request.method == "GET" and (not self.front.policy.model_serving(model) or self.front.draining):
                return web.json_response({"error": self.front.refusal(model) or f"model '{model}' is not ready"}, status=503)
            if action in _INFER_ACTIONS and request.method == "POST":
                refusal = self.front.refuse(model)
                if refusal is not None:
                    return web.json_response({"error": refusal}, status=503)
                return await self._tracked(request, model)
        match = _REPOSITORY_PATH.match(path)
        if match is not None and request.method == "POST":
            self.front.policy.on_repository(match["model"], match["action"] == "load", None)
            response = await self.forward(request, self.front.upstream_http)
            self.front.policy.on_repository(match["model"], match["action"] == "load", response.status == 200)
            return response
        return await self.forward(request, self.front.upstream_http)

    async def _tracked(self, request: web.Request, model: str) -> web.StreamResponse:
        failed: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = self.front.inflight.add(model, lambda message: failed.done() or failed.set_result(message))
        try:
            return await self.forward(request, self.front.upstream_http, failed)
        finally:
            self.front.inflight.discard(entry)

    async def forward(self, request: web.Request, upstream: str,
                            failed: asyncio.Future | None = None) -> web.StreamResponse:
        body = await request.read() if request.body_exists else None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        response: web.StreamResponse | None = None
        sse = False

        async def relay() -> web.StreamResponse:
            nonlocal response, sse
            async with self.front.session.request(request.method, f"http://{upstream}{request.path_qs}", headers=headers,
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
    async def metrics(self, request: web.Request) -> web.StreamResponse:
        if request.path != "/metrics" or self.front.upstream_metrics is None:
            if self.front.upstream_metrics is None:
                return web.Response(status=404)
            return await self.forward(request, self.front.upstream_metrics)
        text = ""
        try:
            async with self.front.session.get(f"http://{self.front.upstream_metrics}/metrics",
                                         timeout=aiohttp.ClientTimeout(total=10)) as up:
                if up.status == 200:
                    text = (await up.read()).decode("utf-8", "replace")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass  # tritonserver down or restarting: our own families still tell why
        return web.Response(text=rewrite_metrics(text, self.front.policy.model_serving) + self.front.policy.extra_metrics(),
                            content_type="text/plain", charset="utf-8")
