"""config.pbtxt parameters (strings) to typed values, with errors that name the parameter."""

from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
    """A configuration value is unknown or malformed; the message names the parameter."""


_ARTICLES = {"int": "an integer", "float": "a number", "bool": "a boolean (true/false)"}


def parse_value(name: str, kind, raw):
    """`raw` as the type `kind` ("int", "float", "bool", "str" or the type itself). Strings are parsed
    as config.pbtxt writes them; other values (from Python callers) pass through."""
    kind = kind if isinstance(kind, str) else kind.__name__
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    try:
        if kind == "bool":
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ConfigError(f"parameter {name!r} must be {_ARTICLES[kind]}, got {raw!r}") from None
    return text


def parse_parameters(cls, params: dict[str, object]) -> dict:
    """Typed values for the flat dataclass `cls`, whose field names are the parameter names."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    values: dict = {}
    for name, raw in params.items():
        if name not in known:
            raise ConfigError(f"unknown parameter {name!r}; known: {', '.join(sorted(known))}")
        values[name] = parse_value(name, known[name].type, raw)
    return values
