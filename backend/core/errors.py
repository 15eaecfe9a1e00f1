"""The errors a request can get: for what it sent (Triton's INVALID_ARG), and from an engine that cannot
take it now or no longer runs (UNAVAILABLE); the server and other requests go on. Here, below the engine,
so that the serving glue names them without importing the engine (and torch)."""

import json


class InvalidRequestError(ValueError):
    """The caller sent something unusable; the message says what. Other requests are unaffected."""


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_size; the caller should retry later (UNAVAILABLE)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (after an internal error or shutdown)."""


def json_object(value, what: str) -> dict:
    """`value` as a dict: itself, or the JSON text of one (as vLLM's clients send nested parameters);
    InvalidRequestError naming `what` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be a JSON object, got {value!r}")
    return value
