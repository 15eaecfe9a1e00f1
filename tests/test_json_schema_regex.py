"""guided_decoding {"json": schema} / {"json_object": true}: the schema's expression accepts the JSON the schema
accepts (as this server writes it) and nothing else; the engine's output parses and has the schema's shape."""

from __future__ import annotations

import json
import re

import pytest

from grpc_stream import StreamClient, make_inputs
from tritonllm.guided.json_schema_regex import any_object_regex, json_schema_regex
from tritonllm.engine.sampling_params import InvalidRequestError, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "height_m": {"type": "number"},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2},
        "employed": {"type": ["boolean", "null"]},
    },
    "required": ["name", "age"],
    "$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string"}}}},
}


def _writes(value) -> str:
    """JSON as the guide has the model write it: compact, one space after ':' and ','."""
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=False)


@pytest.mark.parametrize("schema, valid, invalid", [
    (PERSON,
     [{"name": "Ada", "age": 36, "height_m": 1.65, "pets": [], "employed": True},
      {"name": "Bo \"B\" \u00e9", "age": -3, "height_m": 2e3, "pets": [{"kind": "dog", "name": "Rex"}], "employed": None}],
     [{"name": "Ada", "age": 36.5, "height_m": 1, "pets": [], "employed": True},  # age not an integer
      {"name": "Ada", "age": 36, "height_m": 1, "pets": [{"kind": "cow", "name": "x"}], "employed": False},
      {"name": "x" * 21, "age": 1, "height_m": 1, "pets": [], "employed": False},  # name too long
      {"age": 36, "name": "Ada", "height_m": 1, "pets": [], "employed": True}]),  # properties out of order
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [[1, 2], [1, 2, 3]], [[], [1], [1, 2, 3, 4], ["1", 2]]),
    ({"const": {"a": [1, "x"]}}, [{"a": [1, "x"]}], [{"a": [1, "y"]}]),
    ({"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]}, ["2026-11-24", None], ["2026-13-01", 3]),
    ({"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}, ["AB12"], ["ab12", "ABC1"]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, [{}, {"a": 1, "b": -2}], [{"a": "1"}]),
    ({"prefixItems": [{"type": "string"}, {"type": "boolean"}]}, [["a", True]], [[True, "a"], ["a"]]),
    (True, [1, "a", None, [1, {"k": 2}], {"a": {"b": 1}}], [{"a": {"b": {"c": 1}}}]),
])
def test_the_expression_accepts_the_schemas_json_and_refuses_the_rest(schema, valid, invalid):
    pattern = json_schema_regex(schema)
    for value in valid:
        assert re.fullmatch(pattern, _writes(value)), _writes(value)
    for value in invalid:
        assert not re.fullmatch(pattern, _writes(value)), _writes(value)


def test_any_object_is_any_json_object_nested_two_levels():
    pattern = any_object_regex()
    for value in [{}, {"a": 1}, {"a": [1, "b", None, {"c": True}]}, {"a": {"b": {"c": 1}}}]:
        assert re.fullmatch(pattern, _writes(value)), _writes(value)
    for text in ['[1]', '"a"', '{"a": 1,}', '{a: 1}', '{"a": {"b": {"c": {"d": 1}}}}']:
        assert not re.fullmatch(pattern, text), text


def test_whitespace_pattern_replaces_the_default():
    pattern = json_schema_regex({"type": "object", "properties": {"a": {"type": "integer"}}}, whitespace=r"[ \n]*")
    assert re.fullmatch(pattern, '{"a":\n  1}') and not re.fullmatch(json_schema_regex({"properties": {"a": {}}}),
                                                                         '{"a":\n  1}')


@pytest.mark.parametrize("guided, message", [
    ({"json": {"type": "string", "contentEncoding": "base64"}}, "contentEncoding"),
    ({"json": {"$ref": "#/$defs/missing"}}, "points nowhere"),
    ({"json": {"$ref": "http://example.com/s.json"}}, "same schema"),
    ({"json": {"allOf": [{"type": "string"}, {"minLength": 1}]}}, "allOf"),
    ({"json": {"type": "tuple"}}, "unknown type"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"ebnf": "root ::= x"}, r"\['ebnf'\] is not supported"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"backend": "xgrammar"}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ("{not json", "not valid JSON"),
])
def test_what_a_schema_guide_cannot_follow_is_a_clear_error(guided, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(guided_decoding=guided)


def _has_the_persons_shape(value) -> bool:
    return (list(value) == list(PERSON["properties"]) and isinstance(value["name"], str) and len(value["name"]) <= 20
            and type(value["age"]) is int and isinstance(value["height_m"], (int, float))
            and all(p["kind"] in ("cat", "dog") and list(p) == ["kind", "name"] for p in value["pets"])
            and value["employed"] in (True, False, None))


def test_greedy_and_sampled_outputs_are_json_of_the_schemas_shape(engine):
    prompt = "Describe a person as JSON."
    [greedy] = engine.generate([prompt], SamplingParams(max_tokens=120, guided_decoding={"json": PERSON}),
                               apply_chat_template=True)
    sampled = engine.generate([prompt], SamplingParams(n=4, max_tokens=120, temperature=1.0, seed=11,
                                                       guided_decoding={"json": json.dumps(PERSON)}),
                              apply_chat_template=True)
    for out in [greedy, *sampled]:
        if out.finish_reason == "stop":  # a sampled string may run to max_tokens; a stopped one is whole
            assert _has_the_persons_shape(json.loads(out.text)), out.text
    assert greedy.finish_reason == "stop"


@pytest.mark.server
def test_json_guides_through_tritonserver(triton_server):
    client = StreamClient(triton_server.grpc_url)
    try:
        client.send("schema", make_inputs("Describe a person as JSON.", chat=True, exclude_input=True,
                                          sampling={"max_tokens": 120, "structured_outputs": {"json": PERSON}}))
        client.send("object", make_inputs("Return a JSON object with the keys city and temperature.", chat=True, exclude_input=True,
                                          sampling={"max_tokens": 120, "guided_decoding": {"json_object": True}}))
        got = client.wait(["schema", "object"])
        client.send("bad", make_inputs("Hi", sampling={"guided_decoding": {"json": {"type": "tuple"}}}))
        got.update(client.wait(["bad"]))
    finally:
        client.close()
    assert got["schema"].error is None and _has_the_persons_shape(json.loads(got["schema"].text))
    assert got["object"].error is None and isinstance(json.loads(got["object"].text), dict)
    assert got["bad"].error is not None and "unknown type" in got["bad"].error
