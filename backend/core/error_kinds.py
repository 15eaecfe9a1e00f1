"""The kind of a request's error, carried inside the error message of a gRPC stream when a client asks.

A Triton gRPC stream carries a request's error as a message inside the stream, without its status code.
tritonserver can instead end the stream with the error's status code (the `triton_grpc_error: true`
header), but tritonserver 2.51's stream handler crashes the server when several such streams end with
errors at once, which clients sending invalid requests can bring about (docs/OPERATIONS.md, "Known").
So our OpenAI server and the supervising front never use that header upstream; a client that needs the
kind sends the request parameter KIND_PARAMETER = true, and our models then begin the message with
"[kind] ".
"""

from __future__ import annotations

import json

KIND_PARAMETER = "error_kind_in_message"
KINDS = ("invalid_argument", "unavailable", "internal")

# The engine's exceptions (and RequestOutput.error_kind) by kind; anything else is internal.
KIND_OF_ERROR = {"InvalidRequestError": "invalid_argument", "QueueFullError": "unavailable",
                 "EngineDeadError": "unavailable"}


def asks_for_kind(parameters_json: str | None) -> bool:
    """Whether a request's parameters (Triton's JSON of them) set KIND_PARAMETER to true."""
    if not parameters_json or KIND_PARAMETER not in parameters_json:
        return False
    try:
        return json.loads(parameters_json).get(KIND_PARAMETER) is True
    except (json.JSONDecodeError, AttributeError):
        return False


def with_kind(kind: str, message: str) -> str:
    return f"[{kind}] {message}"


def split_kind(message: str) -> tuple[str | None, str]:
    """(kind, the message without it) of a message that `with_kind` wrote, else (None, message)."""
    if message.startswith("["):
        kind, sep, rest = message[1:].partition("] ")
        if sep and kind in KINDS:
            return kind, rest
    return None, message
