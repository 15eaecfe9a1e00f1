"""The error a request gets for what it sent (Triton's INVALID_ARG); the server and other requests go on."""

import json


class InvalidRequestError(ValueError):
    """The caller sent something unusable; the message says what. Other requests are unaffected."""


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
