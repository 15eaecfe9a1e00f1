"""One client's ModelStreamInfer call through the front: its requests in flight, matched to tritonserver's
responses.

A stream request is tracked from the moment it is forwarded until its final response (every response
of a decoupled model carries `triton_final_response`; one without it is a non-decoupled model's only
response) or its error. Give each request on a stream an id when several share one: responses are
matched to requests by (model, id).

A client that sets `triton_grpc_error: true` takes a request's error as the stream's gRPC status. The
front answers it so itself and never forwards the header, whose handling crashes tritonserver 2.51
(core/error_kinds.py): it asks the model for the error's kind in the message instead (requests that
carry a `sampling_parameters` tensor: front_grpc.py), and ends the stream with that kind's status. An
error without a kind (tritonserver's own, such as an unknown model, or another backend's) stays a
message inside the stream.
"""

from __future__ import annotations

import asyncio

import grpc
from tritonclient.grpc import service_pb2

from tritonllm.core.error_kinds import split_kind, with_kind
from tritonllm.serving.supervision.inflight import Entry, Inflight

STATUS_HEADER = ("triton_grpc_error", "true")
_STATUS_OF_KIND = {"invalid_argument": grpc.StatusCode.INVALID_ARGUMENT, "unavailable": grpc.StatusCode.UNAVAILABLE,
                   "internal": grpc.StatusCode.INTERNAL}


def stream_error(model: str, request_id: str, message: str) -> bytes:
    """A stream response that ends one request with an error, as tritonserver writes them."""
    response = service_pb2.ModelStreamInferResponse(error_message=message)
    response.infer_response.model_name = model
    response.infer_response.id = request_id
    response.infer_response.parameters["triton_final_response"].bool_param = True
    return response.SerializeToString()


class TrackedStream:
    """One client's ModelStreamInfer call: its requests in flight, by (model, id)."""

    def __init__(self, inflight: Inflight, out: asyncio.Queue, status_errors: bool = False):
        self.inflight = inflight
        self.out = out
        # The client takes errors as the stream's gRPC status (triton_grpc_error): an ended request ends
        # the whole stream with `abort` (code, message), as tritonserver does for such a client.
        self.status_errors = status_errors
        self.abort: tuple | None = None
        self.live: dict[tuple[str, str], list[Entry]] = {}
        self.untracked = 0  # requests the front could not read (tritonserver answers them)
        # The front ended a request that tritonserver still holds: the upstream stream cannot end by itself.
        self.abandoned = False

    def track(self, model: str, request_id: str, tagged: bool = False) -> None:
        """`tagged`: the request asked for errors' kinds in their messages (error_kinds.py)."""
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
                self.out.put_nowait(stream_error(model, request_id, with_kind("unavailable", message) if tagged else message))

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
                if response.error_message or is_final(infer):
                    self.untracked -= 1
                return True
            return False  # its request was ended by the front already
        if response.error_message or is_final(infer):
            entry = entries.pop(0)
            if not entries:
                self.live.pop(key, None)
            self.inflight.discard(entry)
        if self.status_errors and response.error_message:
            kind, message = split_kind(response.error_message)
            if kind is not None:  # our model's error: the stream's status, as tritonserver would for this client
                self.abort = self.abort or (_STATUS_OF_KIND[kind], message)
                return False
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


def is_final(infer) -> bool:
    params = infer.parameters
    return params["triton_final_response"].bool_param if "triton_final_response" in params else True
