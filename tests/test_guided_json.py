"""guided_decoding {"json": schema} / {"json_object": true}: the guide accepts the JSON that the schema
accepts, written compactly (one space after ':' and ',', properties in the schema's order), and nothing
else (an object that lists its properties has only those unless the schema allows others); values
of any type and recursive schemas nest to any depth, numeric bounds hold; the engine's outputs parse
and fit the schema."""

from __future__ import annotations

import json
import re

import llguidance
import pytest

from grpc_stream import StreamClient, make_inputs
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams
from tritonllm.guided.decoding import Guides, parse_guided_decoding

pytestmark = pytest.mark.unit

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
    "$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string", "maxLength": 12}}}},
}
LINKED_LIST = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
    "required": ["value", "next"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
BOUNDED = {"type": "object", "properties": {
    "age": {"type": "integer", "minimum": 18, "maximum": 65},
    "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "floor": {"type": "integer", "minimum": -3, "exclusiveMaximum": 4}},
    "required": ["age", "score", "floor"], "additionalProperties": False}


def _writes(value) -> str:
    """JSON as the guide has the model write it: compact, one space after ':' and ','."""
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=False)


def _nested(depth: int):
    value = [1, {"leaf": None}]
    for level in reversed(range(depth)):
        value = {f"k{level}": value}
    return value


def _linked(length: int):
    node = None
    for value in reversed(range(length)):
        node = {"value": value, "next": node}
    return node


@pytest.fixture(scope="module")
def guides(tokenizer):
    return Guides(tokenizer, {tokenizer.eos_token_id})


def _accepts(guides, tokenizer, guided: dict, text: str) -> bool:
    """Whether the guide the engine builds for `guided` takes `text` whole (and may end there)."""
    guide = guides.for_request(SamplingParams(guided_decoding=guided).guided_decoding)
    matcher = llguidance.LLMatcher(guide.vocabulary.tokenizer, guide.grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("schema, valid, invalid", [
    (PERSON,
     [{"name": "Ada", "age": 36, "height_m": 1.65, "pets": [], "employed": True},
      {"name": "Bo \"B\" \u00e9", "age": -3, "height_m": 2e3, "pets": [{"kind": "dog", "name": "Rex"}], "employed": None},
      {"name": "Ada", "age": 36}],  # what is not required may be left out
     [{"name": "Ada", "age": 36.5, "height_m": 1, "pets": [], "employed": True},  # age not an integer
      {"name": "Ada", "age": 36, "height_m": 1, "pets": [{"kind": "cow", "name": "x"}], "employed": False},
      {"name": "x" * 21, "age": 1, "height_m": 1, "pets": [], "employed": False},  # name too long
      {"age": 36, "name": "Ada", "height_m": 1, "pets": [], "employed": True},  # properties out of order
      {"name": "Ada"},  # age is required
      {"name": "Ada", "age": 36, "nickname": "A"}]),  # a property the schema does not list
    # Other properties where the schema allows them, and an allOf's branches each open to the other's.
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     [{"a": 1, "b": [2]}], [{"a": "1"}]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^x": {"type": "string"}}},
     [{"a": 1, "xy": "z"}], [{"a": 1, "y": "z"}]),
    ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]},
     [{"a": 1, "b": 2}], [{"a": 1, "b": "2"}]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [[1, 2], [1, 2, 3]], [[], [1], [1, 2, 3, 4], ["1", 2]]),
    ({"const": {"a": [1, "x"]}}, [{"a": [1, "x"]}], [{"a": [1, "y"]}]),
    ({"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]}, ["2026-11-24", None], ["2026-13-01", 3]),
    ({"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}, ["AB12"], ["ab12", "ABC1"]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, [{}, {"a": 1, "b": -2}], [{"a": "1"}]),
    ({"prefixItems": [{"type": "string"}, {"type": "boolean"}]}, [["a", True]], [[True, "a"]]),
    ({"allOf": [{"type": "string"}, {"minLength": 2}]}, ["ab"], ["a", 12]),
    (True, [1, "a", None, [1, {"k": 2}], {"a": {"b": 1}}, _nested(6)], []),
    # Numeric bounds.
    ({"type": "integer", "minimum": 18, "maximum": 65}, [18, 40, 65], [17, 66, -18, 18.5]),
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, [0.5, 1, 1.0, 0.001], [0, 0.0, -0.1, 1.01, 2]),
    ({"type": "integer", "minimum": -3, "exclusiveMaximum": 4}, [-3, 0, 3], [-4, 4, 10]),
])
def test_the_guide_accepts_the_schemas_json_and_refuses_the_rest(guides, tokenizer, schema, valid, invalid):
    for value in valid:
        assert _accepts(guides, tokenizer, {"json": schema}, _writes(value)), _writes(value)
    for value in invalid:
        assert not _accepts(guides, tokenizer, {"json": schema}, _writes(value)), _writes(value)


@pytest.mark.parametrize("guided", [{"json_object": True}, {"json": {"type": "object"}}, {"json": True}])
def test_values_of_any_type_nest_to_any_depth(guides, tokenizer, guided):
    for depth in (2, 4, 12):
        assert _accepts(guides, tokenizer, guided, _writes(_nested(depth))), depth
    for text in ['{"a": 1,}', '{a: 1}', '{"a": {"b": {"c": {"d": 1}}}']:
        assert not _accepts(guides, tokenizer, guided, text), text
    assert _accepts(guides, tokenizer, guided, "[1]") == ("json_object" not in guided and guided["json"] is True)


def test_a_recursive_schema_nests_to_any_depth(guides, tokenizer):
    for length in (1, 5, 20):
        assert _accepts(guides, tokenizer, {"json": LINKED_LIST}, _writes(_linked(length))), length
    broken = _linked(6)
    broken["next"]["next"]["next"]["value"] = "3"
    assert not _accepts(guides, tokenizer, {"json": LINKED_LIST}, _writes(broken))


def test_whitespace_pattern_replaces_the_default(guides, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    spaced = {"json": schema, "whitespace_pattern": r"[ \n]*"}
    for text in ['{"a":\n  1,\n  "b": 2}', '{"a":1,"b":2}', '{ "a" : 1 , "b" : 2 }']:
        assert _accepts(guides, tokenizer, spaced, text) and not _accepts(guides, tokenizer, {"json": schema}, text), text
    assert _accepts(guides, tokenizer, {"json": schema}, '{"a": 1, "b": 2}')


def test_keywords_left_unenforced_and_unknown_formats_are_accepted(guides, tokenizer):
    schema = {"type": "array", "items": {"type": "string", "format": "color"}, "uniqueItems": True}
    assert _accepts(guides, tokenizer, {"json": schema}, '["red", "blue"]')
    assert not _accepts(guides, tokenizer, {"json": schema}, '["red", 1]')


@pytest.mark.parametrize("guided, message", [
    ({"json": {"not": {"type": "string"}}}, 'Unimplemented keys: ["not"]'),
    ({"json": {"type": "array", "uniqueItems": True, "contains": {"type": "integer"}}}, "contains"),
    ({"json": {"$ref": "#/$defs/missing"}}, "does not exist"),
    ({"json": {"$ref": "http://example.com/s.json"}}, "retrieving it failed"),
    ({"json": {"type": "tuple"}}, "Invalid type: tuple"),
    ({"json": {"type": "string", "pattern": "(a)\\1"}}, "backreferences"),
    ({"json": [1]}, "must be a JSON object or true"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json_object": True, "whitespace_pattern": "(?= )"}, "lookarounds"),
    ({"ebnf": "root ::= x"}, "['ebnf'] is not supported"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"backend": "xgrammar"}, "exactly one"),
    ("{not json", "not valid JSON"),
])
def test_what_a_schema_guide_cannot_follow_is_a_clear_error(guided, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        parse_guided_decoding(guided)


def _fits_person(value) -> bool:
    known = list(PERSON["properties"])
    given = [k for k in value if k in known]
    return (given == [k for k in known if k in value] and {"name", "age"} <= set(value)
            and isinstance(value["name"], str) and len(value["name"]) <= 20 and type(value["age"]) is int
            and isinstance(value.get("height_m", 0), (int, float)) and not isinstance(value.get("height_m", 0), bool)
            and all(isinstance(p, dict) and p.get("kind", "cat") in ("cat", "dog") for p in value.get("pets", []))
            and len(value.get("pets", [])) <= 2 and value.get("employed") in (True, False, None))


def test_greedy_and_sampled_outputs_are_json_the_schema_accepts(engine):
    prompt = "Describe a person as JSON."
    [greedy] = engine.generate([prompt], SamplingParams(max_tokens=120, guided_decoding={"json": PERSON}),
                               apply_chat_template=True)
    sampled = engine.generate([prompt], SamplingParams(n=4, max_tokens=120, temperature=1.0, seed=11,
                                                       guided_decoding={"json": json.dumps(PERSON)}),
                              apply_chat_template=True)
    for out in [greedy, *sampled]:
        if out.finish_reason == "stop":  # a sampled string may run to max_tokens; a stopped one is whole
            value = json.loads(out.text)
            assert _fits_person(value) and out.text == _writes(value), out.text
    assert greedy.finish_reason == "stop"


def test_deeply_nested_json_is_written_whole(engine):
    # The old limit of untyped values was two levels; a copy of six goes through unchanged.
    copy = _writes({"config": {"server": {"http": {"routes": {"api": {"timeout": 30}}}}}})
    outs = engine.generate([f"Repeat this JSON exactly: {copy}"] * 2, [
        SamplingParams(max_tokens=64, guided_decoding={"json_object": True}),
        SamplingParams(max_tokens=64, guided_decoding={"json": {"type": "object"}})], apply_chat_template=True)
    assert [o.text for o in outs] == [copy, copy] and all(o.finish_reason == "stop" for o in outs)


def _in_bounds(value) -> bool:
    return (list(value) == ["age", "score", "floor"] and type(value["age"]) is int and 18 <= value["age"] <= 65
            and isinstance(value["score"], (int, float)) and 0 < value["score"] <= 1
            and type(value["floor"]) is int and -3 <= value["floor"] < 4)


def test_numeric_bounds_hold_in_outputs(engine):
    # The prompt asks for values outside every bound.
    prompt = "Write JSON for a person of age 7 with score 5.5 who lives on floor -10."
    [greedy] = engine.generate([prompt], SamplingParams(max_tokens=48, guided_decoding={"json": BOUNDED}),
                               apply_chat_template=True)
    sampled = engine.generate([prompt], SamplingParams(n=6, max_tokens=48, temperature=1.0, seed=3,
                                                       guided_decoding={"json": BOUNDED}), apply_chat_template=True)
    assert greedy.finish_reason == "stop" and _in_bounds(json.loads(greedy.text)), greedy.text
    stopped = [o for o in sampled if o.finish_reason == "stop"]
    assert stopped and all(_in_bounds(json.loads(o.text)) for o in stopped), [o.text for o in sampled]


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
    assert got["schema"].error is None and _fits_person(json.loads(got["schema"].text))
    assert got["object"].error is None and isinstance(json.loads(got["object"].text), dict)
    assert got["bad"].error is not None and "Invalid type: tuple" in got["bad"].error
