"""guided_decoding `thinking`: a guide held back until a reasoning model's `<think>...</think>` block ends
("open": the output starts inside it; "allowed": it may start with one), the block's text free and
ended by the first `</think>`, with the tokenizer's special `<think>` tokens matched as tokens."""

from __future__ import annotations

import copy
import json

import pytest

from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams
from tritonllm.guided.decoding import Guides, guide_grammar, parse_guided_decoding

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def _cursor(guides: Guides, **guided):
    return guides.for_request(SamplingParams(guided_decoding=guided).guided_decoding).start()


def _ids(tokenizer, *pieces: str) -> list[int]:
    return [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]


def _accepts(cursor, ids: list[int], whole: bool) -> bool:
    """Whether the guide allows every token of `ids` in turn (and, `whole`, the end of sequence after)."""
    for k in range(len(ids)):
        if not cursor.allowed_mask(ids[:k])[ids[k]]:
            return False
    eos = cursor.guide.vocabulary.eos_mask
    return not whole or bool((cursor.allowed_mask(ids) & eos).any())


@pytest.fixture(scope="module")
def guides(tokenizer):
    return Guides(tokenizer, {tokenizer.eos_token_id})


@pytest.mark.parametrize("kind", [{"json": SCHEMA}, {"regex": r"\{\"a\": [0-9]+\}"}, {"choice": ['{"a": 1}', '{"a": 2}']},
                                  {"grammar": 'start: "{\\"a\\": " /[0-9]+/ "}"'}])
def test_open_thinking_is_free_until_think_ends_then_the_guide_holds(guides, tokenizer, kind):
    cursor = _cursor(guides, thinking="open", **kind)
    # Anything while thinking, even what the guide would refuse; then the answer, guided.
    assert _accepts(cursor, _ids(tokenizer, "Hmm, {{ not JSON </thin", "king>: no.</think>", '{"a": 1}'), whole=True)
    assert _accepts(cursor, _ids(tokenizer, "x</think>", '{"a": 2}'), whole=True)
    # After the first </think> only the guide's text: no more thinking, no free text.
    assert not _accepts(cursor, _ids(tokenizer, "so</think>", "hello"), whole=False)
    assert not _accepts(cursor, _ids(tokenizer, "so</think>", "</think>"), whole=False)
    thought = _ids(tokenizer, "so</think>")
    allowed = [tokenizer.decode([t]) for t in cursor.allowed_tokens(thought)]
    assert allowed and all('{"a": '.startswith(a) or a.startswith("{") for a in allowed), allowed[:20]
    # An output may end while thinking (the model stops, as it may unguided); not before its answer is whole.
    assert _accepts(cursor, _ids(tokenizer, "still thinking"), whole=True)
    assert not _accepts(cursor, _ids(tokenizer, "done</think>", '{"a"'), whole=True)
    assert cursor.is_complete(_ids(tokenizer, "done</think>", '{"a": 1}'))


def test_allowed_opens_a_block_only_with_the_think_token(tokenizer):
    """Qwen3's `<think>` is an added token that is not special: it opens a block, its text in pieces does not."""
    with_thinking = copy.deepcopy(tokenizer)
    with_thinking.add_tokens(["<think>", "</think>"])
    guides = Guides(with_thinking, {tokenizer.eos_token_id})
    start, end = with_thinking.convert_tokens_to_ids(["<think>", "</think>"])
    assert guides.think_tokens == (start, end) and "</think>" not in guides.special_tokens
    cursor = _cursor(guides, thinking="allowed", json=SCHEMA)
    assert _accepts(cursor, [start] + _ids(tokenizer, "let me see: {") + [end] + _ids(tokenizer, '{"a": 3}'), whole=True)
    # The text `</think>` is no end of the block where the model has the token: free text may follow it.
    assert _accepts(cursor, [start] + _ids(tokenizer, "x</think>hello"), whole=True)
    assert _accepts(cursor, _ids(tokenizer, '{"a": 4}'), whole=True)
    assert not _accepts(cursor, _ids(tokenizer, "Sure: ", '{"a": 4}'), whole=False)  # neither a block nor the answer
    assert not _accepts(cursor, [start] + _ids(tokenizer, "x") + [end, start], whole=False)
    firsts = {with_thinking.decode([t]) for t in cursor.allowed_tokens([])}
    assert "<think>" in firsts and all(f == "<think>" or f.startswith("{") for f in firsts), sorted(firsts)[:20]


def test_allowed_without_a_think_token_is_the_guide_alone(guides, tokenizer):
    """The default model has no `<think>` token: the guide holds from the first token, so the mask cannot
    push it into spelling `<think>` and ending inside a block with no answer."""
    assert guides.think_tokens == (None, None)
    cursor = _cursor(guides, thinking="allowed", json=SCHEMA)
    assert _accepts(cursor, _ids(tokenizer, '{"a": 4}'), whole=True)
    assert not _accepts(cursor, _ids(tokenizer, "<think>", "x</think>", '{"a": 4}'), whole=False)
    assert guides.grammar_for({"json": SCHEMA, "thinking": "allowed"}) == guides.grammar_for({"json": SCHEMA})


def test_special_think_tokens_are_matched_as_tokens(tokenizer):
    with_thinking = copy.deepcopy(tokenizer)
    with_thinking.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    guides = Guides(with_thinking, {tokenizer.eos_token_id})
    assert {"<think>", "</think>"} <= guides.special_tokens
    start, end = with_thinking.convert_tokens_to_ids(["<think>", "</think>"])
    cursor = _cursor(guides, thinking="allowed", json=SCHEMA)
    assert cursor.allowed_mask([])[start] and not cursor.allowed_mask([])[_ids(tokenizer, "<")[0]]
    assert _accepts(cursor, [start] + _ids(tokenizer, "so") + [end] + _ids(tokenizer, '{"a": 5}'), whole=True)
    assert not _accepts(cursor, [start] + _ids(tokenizer, "so") + [end] + _ids(tokenizer, "hello"), whole=False)
    # The text `</think>` is no end of the block: free text may follow it.
    assert _accepts(cursor, [start] + _ids(tokenizer, "x</think>hello"), whole=True)


def test_thinking_is_checked_with_the_request():
    assert parse_guided_decoding({"json": SCHEMA, "thinking": "allowed"})["thinking"] == "allowed"
    with pytest.raises(InvalidRequestError, match="thinking must be one of open, allowed"):
        parse_guided_decoding({"json": SCHEMA, "thinking": "yes"})
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        parse_guided_decoding({"thinking": "open"})
    wrapped = json.loads(guide_grammar({"regex": "a+", "thinking": "open"}))
    assert [g["name"] for g in wrapped["grammars"]] == ["thinking", "regex"]
