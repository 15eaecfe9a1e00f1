"""guided_decoding {"structural_tag": ...}: the text before a trigger is the model's own (greedy, the
unguided output's tokens); each trigger is followed by the rest of its structure's begin, JSON that
its schema accepts, and its end; a trigger that is a special token is matched as that token."""

from __future__ import annotations

import json

import pytest

from grpc_stream import StreamClient, make_inputs
from tritonllm.guided.decoding import Guides, parse_guided_decoding
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.unit

PROMPT = "What's the weather like in Paris today? Answer in one sentence."
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}


def _fits_schema(value) -> bool:
    return (isinstance(value, dict) and list(value) == ["city", "days"] and isinstance(value["city"], str)
            and len(value["city"]) <= 10 and type(value["days"]) is int)


def _tag(trigger: str, begin: str, end: str) -> dict:
    return {"structures": [{"begin": begin, "schema": SCHEMA, "end": end}], "triggers": [trigger]}


def tagged_segments(text: str, trigger: str, begin: str, end: str, complete: bool) -> list[str] | None:
    """The checker: the JSON texts that follow each trigger in `text`, or None if some trigger is not
    followed by the rest of `begin`, JSON the schema accepts and `end` (where `text` was cut short,
    not `complete`, its last segment may stop anywhere on the way)."""
    segments, at = [], 0
    while (found := text.find(trigger, at)) >= 0:
        rest = text[found + len(trigger):]
        head = begin[len(trigger):]
        if not rest.startswith(head):
            return None if complete or not head.startswith(rest) else segments
        rest = rest[len(head):]
        try:
            value, size = json.JSONDecoder().raw_decode(rest)
        except json.JSONDecodeError:
            return None if complete else segments  # a cut-short JSON is not checked further
        if not _fits_schema(value) or not (rest[size:].startswith(end) or (not complete and end.startswith(rest[size:]))):
            return None
        segments.append(rest[:size])
        at = len(text) - len(rest) + size + len(end)
    return segments


def _word_trigger(tokenizer, ids: list[int]) -> int:
    """The index of the first output token, past the first three, that is a word of its own (a space then
    at least four letters) not written before it."""
    for k in range(3, len(ids)):
        piece = tokenizer.decode([ids[k]])
        if piece.startswith(" ") and len(piece) > 4 and piece[1:].isalpha() and piece not in tokenizer.decode(ids[:k]):
            return k
    raise AssertionError("no word to trigger on")


def test_text_before_the_trigger_is_the_models_and_json_for_the_schema_follows(engine, tokenizer):
    [free] = engine.generate([PROMPT], SamplingParams(max_tokens=40), apply_chat_template=True)
    k = _word_trigger(tokenizer, free.token_ids)
    trigger = tokenizer.decode([free.token_ids[k]])
    begin, end = trigger + " -> ", " <-"
    tag = _tag(trigger, begin, end)
    outs = engine.generate([PROMPT, PROMPT], [
        SamplingParams(max_tokens=60, guided_decoding={"structural_tag": json.dumps(tag)}),  # as vLLM's clients send it
        SamplingParams(max_tokens=60, guided_decoding={"structural_tag": tag, "whitespace_pattern": r"[ \n]*"})],
        apply_chat_template=True)
    for out in outs:
        assert out.token_ids[:k + 1] == free.token_ids[:k + 1]  # free text until the trigger, then the tag
        assert out.text.startswith(tokenizer.decode(free.token_ids[:k + 1]) + " -> "), out.text
        segments = tagged_segments(out.text, trigger, begin, end, complete=out.finish_reason == "stop")
        assert segments, out.text
    # Written as the other JSON guides write it: one space after ":" and ",".
    assert all(s == json.dumps(json.loads(s)) for s in tagged_segments(outs[0].text, trigger, begin, end, complete=True))


def test_every_trigger_in_sampled_text_opens_a_tagged_segment(engine):
    # " the" is in most sentences, and inside longer words (" there"): a token that would run past the
    # trigger into other text is not taken.
    trigger, begin, end = " the", " the city: ", "."
    params = SamplingParams(n=6, max_tokens=48, temperature=1.0, seed=5,
                            guided_decoding={"structural_tag": _tag(trigger, begin, end)})
    outs = engine.generate(["Tell me about the weather in the cities of France."], params, apply_chat_template=True)
    tagged = 0
    for o in outs:
        segments = tagged_segments(o.text, trigger, begin, end, complete=o.finish_reason == "stop")
        assert segments is not None, o.text
        tagged += len(segments)
    assert tagged >= 2 and len({o.text for o in outs}) > 1


def test_a_trigger_that_is_a_special_token_is_matched_as_that_token(engine, tokenizer):
    guides = Guides(tokenizer, {tokenizer.eos_token_id})
    special, text = "<|im_start|>", "<tool>"
    assert special in guides.special_tokens and text not in guides.special_tokens
    [im_start] = tokenizer.encode(special, add_special_tokens=False)
    cursor = guides.for_request(SamplingParams(guided_decoding={"structural_tag": _tag(special, special + "tool\n", "")})
                                .guided_decoding).start()
    assert im_start in cursor.allowed_tokens([]).tolist()
    assert cursor.allowed_tokens([im_start]).tolist() == tokenizer.encode("tool", add_special_tokens=False)
    # A trigger shaped like one that the tokenizer does not have is text: free until written, then the tag.
    cursor = guides.for_request(SamplingParams(guided_decoding={"structural_tag": _tag(text, text, "")})
                                .guided_decoding).start()
    assert len(cursor.allowed_tokens([])) > 0.99 * len(tokenizer)
    written = tokenizer.encode("Sure <tool>", add_special_tokens=False)
    after = [tokenizer.decode([t]) for t in cursor.allowed_tokens(written)]
    assert after and all(piece.startswith("{") for piece in after), after


@pytest.mark.parametrize("tag, message", [
    ("{not json", "not valid JSON"),
    ([], "must be a JSON object"),
    ({"structures": [{"begin": "<f>", "schema": {}, "end": ""}]}, "triggers must be a non-empty list"),
    ({"structures": [], "triggers": ["<f"]}, "structures must be a non-empty list"),
    ({"structures": [{"begin": "<g>", "schema": {}, "end": ""}], "triggers": ["<f"]}, "starts with none of the triggers"),
    ({"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<f"]}, "exactly \"begin\", \"schema\" and \"end\""),
    ({"structures": [{"begin": "<f>", "schema": [1], "end": ""}], "triggers": ["<f"]}, "schema must be a JSON object"),
    ({"structures": [{"begin": "<f>", "schema": {"type": "string", "pattern": "[a-"}, "end": ""}], "triggers": ["<f"]},
     "unclosed character class"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "\"format\" form is not supported"),
])
def test_a_structural_tag_that_cannot_be_followed_is_a_clear_error(tag, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_guided_decoding({"structural_tag": tag})


@pytest.mark.server
def test_structural_tag_through_tritonserver(triton_server, engine):
    tag = _tag(" beautiful", " beautiful weather: ", " done.")
    sampling = {"max_tokens": 48, "guided_decoding": {"structural_tag": json.dumps(tag)}}
    client = StreamClient(triton_server.grpc_url)
    try:
        client.send("t", make_inputs(PROMPT, chat=True, exclude_input=True, sampling=sampling))
        got = client.wait(["t"])
        client.send("bad", make_inputs(PROMPT, sampling={"guided_decoding": {"structural_tag": {"triggers": ["<f"]}}}))
        got.update(client.wait(["bad"]))
    finally:
        client.close()
    [offline] = engine.generate([PROMPT], SamplingParams(**sampling), apply_chat_template=True)
    assert got["t"].error is None and got["t"].text == offline.text
    assert tagged_segments(offline.text, " beautiful", " beautiful weather: ", " done.", complete=True)
    assert got["bad"].error is not None and "structures must be a non-empty list" in got["bad"].error
