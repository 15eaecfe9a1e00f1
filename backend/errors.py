"""The error a request gets for what it sent (Triton's INVALID_ARG); the server and other requests go on."""


class InvalidRequestError(ValueError):
    """The caller sent something unusable; the message says what. Other requests are unaffected."""
