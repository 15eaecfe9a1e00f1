"""The front's gRPC service: every method of tritonserver's, forwarded as raw bytes with its metadata.

What it decides itself: ServerLive (the launcher lives), ServerReady and ModelReady (false while a model
cannot serve or the server drains), inference for a model that cannot serve (UNAVAILABLE; on a stream,
an error response for that request), and the end of requests whose model died (stream_tracking.py).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from tritonclient.grpc import service_pb2

from tritonllm.core.error_kinds import KIND_PARAMETER, with_kind
from tritonllm.serving.supervision.stream_tracking import STATUS_HEADER, TrackedStream, stream_error

SERVICE = "/inference.GRPCInferenceService/"
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def _forwarded_metadata(context) -> tuple:
    # grpc-* and pseudo headers belong to the connection, not to the call.
    return tuple((k, v) for k, v in (context.invocation_metadata() or ())
                 if not k.startswith(("grpc-", ":")) and k not in ("user-agent", "content-type", "te"))


def _asks_for_kind(request: service_pb2.ModelInferRequest) -> bool:
    parameter = request.parameters.get(KIND_PARAMETER)
    return parameter is not None and parameter.WhichOneof("parameter_choice") == "bool_param" and parameter.bool_param


def _takes_kind_parameter(request: service_pb2.ModelInferRequest) -> bool:
    """Whether the front may add KIND_PARAMETER to a request: one whose sampling parameters come as the
    `sampling_parameters` tensor. Our models take it from any request; Triton's vLLM backend takes a
    request's parameters for sampling parameters where that tensor is missing, and would refuse it."""
    return any(tensor.name == "sampling_parameters" for tensor in request.inputs)


class GrpcFront(grpc.GenericRpcHandler):
    def __init__(self, front):
        self.front = front  # the Front: its channel to tritonserver, requests in flight, decisions

    def service(self, details):
        method = details.method
        if not method.startswith(SERVICE):
            return None
        name = method[len(SERVICE):]
        if name == "ModelStreamInfer":
            return grpc.stream_stream_rpc_method_handler(self.stream)

        async def unary(raw: bytes, context) -> bytes:  # a coroutine function: grpc.aio runs it on its loop
            return await self.unary(name, raw, context)

        return grpc.unary_unary_rpc_method_handler(unary)

    async def unary(self, name: str, raw: bytes, context):
        if name == "ServerLive":  # the launcher answers: it lives, and restarts tritonserver if that dies
            return service_pb2.ServerLiveResponse(live=True).SerializeToString()
        if self.front.channel is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is starting; retry later")
        if name == "ServerReady" and (self.front.draining or not self.front.policy.server_ready()):
            return service_pb2.ServerReadyResponse(ready=False).SerializeToString()
        if name == "ModelReady":
            model = service_pb2.ModelReadyRequest.FromString(raw).name
            if self.front.draining or not self.front.policy.model_serving(model):
                return service_pb2.ModelReadyResponse(ready=False).SerializeToString()
        if name == "ModelInfer":
            model = service_pb2.ModelInferRequest.FromString(raw).model_name
            refusal = self.front.refuse(model)
            if refusal is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
            return await self._tracked_unary(name, model, raw, context)
        if name in ("RepositoryModelLoad", "RepositoryModelUnload"):
            model = getattr(service_pb2, name + "Request").FromString(raw).model_name
            self.front.policy.on_repository(model, name == "RepositoryModelLoad", None)
            try:
                response = await self._forward(name, raw, context)
            except grpc.aio.AioRpcError as exc:
                self.front.policy.on_repository(model, name == "RepositoryModelLoad", False)
                await context.abort(exc.code(), exc.details() or "")
            self.front.policy.on_repository(model, name == "RepositoryModelLoad", True)
            return response
        try:
            return await self._forward(name, raw, context)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")

    async def _forward(self, name: str, raw: bytes, context) -> bytes:
        remaining = context.time_remaining()
        return await self.front.channel.unary_unary(SERVICE + name)(
            raw, metadata=_forwarded_metadata(context), timeout=remaining if remaining and remaining < 1e8 else None)

    async def _tracked_unary(self, name: str, model: str, raw: bytes, context) -> bytes:
        failed: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = self.front.inflight.add(model, lambda message: failed.done() or failed.set_result(message))
        call = asyncio.ensure_future(self._forward(name, raw, context))
        try:
            done, _ = await asyncio.wait({call, failed}, return_when=asyncio.FIRST_COMPLETED)
            if call in done:
                try:
                    return call.result()
                except grpc.aio.AioRpcError as exc:
                    await context.abort(exc.code(), exc.details() or "")
            await context.abort(grpc.StatusCode.UNAVAILABLE, failed.result())
        finally:
            self.front.inflight.discard(entry)
            if not call.done():
                call.cancel()

    async def stream(self, requests, context):
        """One client stream. Its requests go to tritonserver on a stream of the front's that lives only while
        requests are in flight, then is closed: tritonserver finishes unloading a model only once every
        stream that carried requests to it has ended, so a client's idle stream must not hold one open."""
        if self.front.channel is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is starting; retry later")
        out: asyncio.Queue = asyncio.Queue()
        metadata = _forwarded_metadata(context)
        # A client that sets triton_grpc_error takes errors as the stream's gRPC status, not as error messages
        # inside it: the front answers it so, and never passes the header on (stream_tracking.py).
        stream = TrackedStream(self.front.inflight, out, status_errors=STATUS_HEADER in metadata)
        metadata = tuple(pair for pair in metadata if pair[0] != STATUS_HEADER[0])
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
                call = self.front.channel.stream_stream(SERVICE + "ModelStreamInfer")(metadata=metadata)
                calls.add(call)
                asyncio.ensure_future(pump_responses(call))
                state["current"] = call
            return state["current"]

        retired: set = set()

        async def retire(call, abandoned: bool) -> None:
            if call in retired:
                return
            retired.add(call)
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
                    refusal = self.front.refuse(request.model_name)
                    if refusal is not None and stream.status_errors:
                        stream.abort = stream.abort or (grpc.StatusCode.UNAVAILABLE, refusal)
                        return
                    tagged = _asks_for_kind(request)
                    if refusal is not None:
                        out.put_nowait(stream_error(request.model_name, request.id,
                                                    with_kind("unavailable", refusal) if tagged else refusal))
                        continue
                    if stream.status_errors and not tagged and _takes_kind_parameter(request):
                        request.parameters[KIND_PARAMETER].bool_param = True  # the kind decides the stream's status
                        raw = request.SerializeToString()
                    call = upstream()
                    stream.track(request.model_name, request.id, tagged)  # before any await: busy, never retired first
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
            # Upstream streams whose requests have all ended are half-closed, never cancelled, even when this
            # client's stream has just ended: tritonserver 2.51 can lose a finished stream that is cancelled
            # and then never unload its model (docs/OPERATIONS.md, "Known"). Requests still in flight (a
            # client gone mid-request) are cancelled with their stream, which aborts them.
            in_flight = stream.busy or stream.abandoned
            stream.release()
            reader.cancel()
            for call in list(calls):
                if in_flight:
                    call.cancel()
                else:
                    asyncio.ensure_future(retire(call, False))
