"""A JSON schema as a regular expression over JSON text (for guided decoding by `json` / `json_object`).

Every string the expression matches is JSON that the schema accepts, written compactly with at most
`whitespace` (one optional space by default) after `:` and `,`, and objects' properties in the
schema's order. Properties the schema lists but does not require are written too: including them
is valid, and the expression stays a plain sequence instead of every subset of them.

Supported: `type` (one or a list), `properties`, `additionalProperties` (for an object without
`properties`), `items` / `prefixItems`, `minItems` / `maxItems`, `enum`, `const`, `anyOf` / `oneOf`
(as alternatives), `allOf` of one schema, `$ref` into the same document (`#/$defs/...`,
`#/definitions/...`), and for strings `minLength` / `maxLength`, `pattern` and the formats
`date`, `time`, `date-time` and `uuid`. A value of any type (`{}`, `true`, an object without
`properties`) nests at most `ANY_DEPTH` levels, since a regular expression cannot count brackets.
Not enforced (the value is then any value of its type): numeric bounds (`minimum`, ...),
`uniqueItems` and other string formats. Any other key that changes what is valid is refused with
InvalidRequestError rather than silently ignored.
"""

from __future__ import annotations

import json
import re

from tritonllm.engine.errors import InvalidRequestError

DEFAULT_WHITESPACE = r"[ ]?"
ANY_DEPTH = 2  # nesting levels of a value whose type the schema leaves open
_MAX_REF_DEPTH = 16  # $ref chains deeper than this are taken as recursion, which is not regular

STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = r"(?:true|false)"
NULL = r"null"
_FORMATS = {
    "date": r'"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"',
    "time": r'"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?"',
    "date-time": (r'"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]'
                  r'(?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?"'),
    "uuid": r'"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"',
}
# Keys that only describe (or that we knowingly leave unenforced) and never change the expression.
_IGNORED = {"title", "description", "$schema", "$id", "$defs", "definitions", "examples", "default", "$comment",
            "required", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
            "readOnly", "writeOnly", "deprecated", "format", "additionalProperties", "uniqueItems"}


class RecursiveSchemaError(InvalidRequestError):
    """The schema nests through a recursive $ref: no regular expression matches it (guided_decoding.py
    hands such a schema to the grammar guide instead)."""


def json_schema_regex(schema, whitespace: str = DEFAULT_WHITESPACE) -> str:
    """The regular expression for JSON that `schema` (a dict, True, or JSON text) accepts."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"guided json schema is not valid JSON: {exc}") from None
    return _SchemaWriter(schema, whitespace).value(schema, 0)


def any_object_regex(whitespace: str = DEFAULT_WHITESPACE) -> str:
    """Any JSON object (vLLM's `json_object`), nested at most ANY_DEPTH levels."""
    return _SchemaWriter({}, whitespace).any_object(ANY_DEPTH)


class _SchemaWriter:
    def __init__(self, root, whitespace: str):
        self.root = root
        self.ws = whitespace

    def value(self, schema, depth: int) -> str:
        if schema is True or schema == {}:
            return self.any_value(ANY_DEPTH)
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"guided json: a schema must be an object or true, got {schema!r}")
        if "$ref" in schema:
            return self.value(self._resolve(schema["$ref"], depth), depth + 1)
        if "const" in schema:
            return re.escape(json.dumps(schema["const"]))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise InvalidRequestError("guided json: enum must be a non-empty list")
            return _alternatives(re.escape(json.dumps(v)) for v in values)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise InvalidRequestError(f"guided json: {key} must be a non-empty list of schemas")
                return _alternatives(self.value(s, depth) for s in options)
        if "allOf" in schema:
            options = schema["allOf"]
            if not isinstance(options, list) or len(options) != 1:
                raise InvalidRequestError("guided json: allOf is supported with one schema only")
            return self.value(options[0], depth)
        kind = schema.get("type")
        if kind is None:  # typed by its keys, or anything
            kind = ("object" if "properties" in schema else "array" if "items" in schema or "prefixItems" in schema
                    else None)
        if isinstance(kind, list):
            return _alternatives(self.value({**schema, "type": k}, depth) for k in kind)
        unknown = sorted(set(schema) - _IGNORED - _KNOWN_BY_TYPE.get(kind, set()) - {"type"})
        if unknown:
            raise InvalidRequestError(f"guided json: schema keys {unknown} are not supported")
        if kind is None:
            return self.any_value(ANY_DEPTH)
        if kind == "object":
            return self.object(schema, depth)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "string":
            return self.string(schema)
        simple = {"integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}.get(kind)
        if simple is None:
            raise InvalidRequestError(f"guided json: unknown type {kind!r}")
        return simple

    def object(self, schema, depth: int) -> str:
        props = schema.get("properties")
        if not props:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return r"\{" + self.ws + r"\}"
            return self.any_object(ANY_DEPTH, None if extra is True else self.value(extra, depth + 1))
        if not isinstance(props, dict):
            raise InvalidRequestError("guided json: properties must be an object")
        members = [re.escape(json.dumps(name)) + ":" + self.ws + self.value(sub, depth + 1)
                   for name, sub in props.items()]
        return r"\{" + ("," + self.ws).join(members) + r"\}"

    def array(self, schema, depth: int) -> str:
        prefix = schema.get("prefixItems")
        if prefix is not None:  # a tuple: these items in this order
            if not isinstance(prefix, list):
                raise InvalidRequestError("guided json: prefixItems must be a list of schemas")
            if not prefix:
                return r"\[\]"
            return r"\[" + ("," + self.ws).join(self.value(s, depth + 1) for s in prefix) + r"\]"
        item = self.value(schema.get("items", True), depth + 1)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
            raise InvalidRequestError("guided json: minItems / maxItems must be integers with 0 <= min <= max")
        return _list(r"\[", item, "," + self.ws, r"\]", low, high)

    def string(self, schema) -> str:
        if "pattern" in schema:
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                raise InvalidRequestError("guided json: a string's pattern must be a string")
            return '"' + f"(?:{pattern.removeprefix('^').removesuffix('$')})" + '"'
        fmt = schema.get("format")
        if fmt in _FORMATS:
            return _FORMATS[fmt]
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
            raise InvalidRequestError("guided json: minLength / maxLength must be integers with 0 <= min <= max")
        if low == 0 and high is None:
            return STRING
        return '"' + STRING_CHAR + "{" + f"{low},{'' if high is None else high}" + '}"'

    def any_value(self, depth: int) -> str:
        options = [STRING, NUMBER, BOOLEAN, NULL]
        if depth > 0:
            options += [self.any_object(depth - 1), _list(r"\[", self.any_value(depth - 1), "," + self.ws, r"\]", 0, None)]
        return _alternatives(options)

    def any_object(self, depth: int, member_value: str | None = None) -> str:
        member = STRING + ":" + self.ws + (member_value or self.any_value(depth))
        return _list(r"\{", member, "," + self.ws, r"\}", 0, None)

    def _resolve(self, ref, depth: int):
        if depth >= _MAX_REF_DEPTH:
            raise RecursiveSchemaError("guided json: a recursive $ref cannot be a regular expression "
                                       "(it nests without bound)")
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise InvalidRequestError(f"guided json: only $ref into the same schema (#/...) is supported, got {ref!r}")
        node = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise InvalidRequestError(f"guided json: $ref {ref!r} points nowhere in the schema")
            node = node[part]
        return node


_KNOWN_BY_TYPE = {
    "object": {"properties", "additionalProperties"},
    "array": {"items", "prefixItems", "minItems", "maxItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
}


def _alternatives(options) -> str:
    return "(?:" + "|".join(options) + ")"


def _list(open_: str, item: str, sep: str, close: str, low: int, high: int | None) -> str:
    """`open item (sep item)* close` with between `low` and `high` (None: no limit) items."""
    if high == 0:
        return open_ + close
    more_low = max(low - 1, 0)
    more = "{" + f"{more_low},{'' if high is None else high - 1}" + "}"
    body = f"{item}(?:{sep}{item}){more}"
    return open_ + (body if low > 0 else f"(?:{body})?") + close
