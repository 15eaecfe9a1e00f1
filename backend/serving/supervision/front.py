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

The gRPC side is front_grpc.py (with stream_tracking.py), the HTTP and metrics side front_http.py;
this module holds what both share: the supervisor's policy, the requests in flight, the lifecycle.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import grpc
from aiohttp import web

from tritonllm.serving.supervision.front_grpc import UNLIMITED, GrpcFront
from tritonllm.serving.supervision.front_http import HttpFront
from tritonllm.serving.supervision.inflight import Inflight


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
        self.channel: grpc.aio.Channel | None = None
        self._grpc_server: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self.session: aiohttp.ClientSession | None = None

    # -- lifecycle
    async def start(self) -> None:
        # No connection limit: a long stream holds its upstream connection, and none may wait behind it.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        if self.upstream_grpc is not None:
            await self.reconnect()
        if self.grpc_port is not None:
            self._grpc_server = grpc.aio.server(options=UNLIMITED)
            self._grpc_server.add_generic_rpc_handlers((GrpcFront(self),))
            if not self._grpc_server.add_insecure_port(f"{self.host}:{self.grpc_port}"):
                raise OSError(f"cannot listen for gRPC on {self.host}:{self.grpc_port}")
            await self._grpc_server.start()
        http = HttpFront(self)
        for port, handler in ((self.http_port, http.handle), (self.metrics_port, http.metrics)):
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
        old, self.channel = self.channel, grpc.aio.insecure_channel(self.upstream_grpc, options=UNLIMITED)
        if old is not None:
            await old.close()

    async def stop(self) -> None:
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace=1.0)
        for runner in self._runners:
            await runner.cleanup()
        if self.channel is not None:
            await self.channel.close()
        if self.session is not None:
            await self.session.close()

    # -- decisions shared by both protocols
    def refusal(self, model: str) -> str | None:
        if self.draining:
            return "the server is shutting down and takes no new requests; retry on another replica"
        if self.channel is None:
            return "the server is starting; retry later"
        return self.policy.refusal(model)

    def refuse(self, model: str) -> str | None:
        """refusal(), counted: for an inference request about to be answered with it."""
        message = self.refusal(model)
        if message is not None:
            self.refused[model] += 1
        return message

    def fail_model(self, model: str, message: str, cause: str) -> int:
        return self.inflight.fail(message, cause, model)

    def fail_all(self, message: str, cause: str) -> int:
        return self.inflight.fail(message, cause)
