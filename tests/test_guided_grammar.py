"""guided_decoding {"grammar": ...}: the tokens a grammar allows are exactly those a hand-written
recogniser of its language allows (and, for regular grammars, those the regex guide allows for the
same language), and the engine's constrained greedy output equals transformers' generate constrained
by that recogniser. A recursive JSON schema nests as deep as a grammar does."""

from __future__ import annotations

import json
import re

import pytest

from grpc_stream import StreamClient, make_inputs
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams
from tritonllm.guided.decoding import Guides, parse_guided_decoding
from tritonllm.guided.grammar import GrammarVocabulary, GuidedGrammar, compile_grammar

pytestmark = pytest.mark.unit

# Lists of numbers nested to any depth: not a regular language, so no regular expression guide can follow it.
NESTED_GBNF = """
root  ::= list
list  ::= "[" ( value ( ", " value )* )? "]"
value ::= [0-9]+ | list
"""
NESTED_LARK = """
start: list
list: "[" (value (", " value)*)? "]"
value: /[0-9]+/ | list
"""
PROMPT = "What is [[1, 2], [3, 4]] transposed?"


def nested_list_state(text: str) -> str | None:
    """The recogniser: None if no continuation of `text` is a nested list, "done" if `text` is one
    (nothing can follow it), else the name of the place it stops at."""
    state, depth = "start", 0
    for ch in text:
        if state == "done":
            return None
        if ch == "[" and state in ("start", "open", "comma_space"):
            state, depth = "open", depth + 1
        elif ch.isdigit() and ch.isascii() and state in ("open", "number", "comma_space"):
            state = "number"
        elif ch == "]" and state in ("open", "number", "close"):
            depth -= 1
            state = "done" if depth == 0 else "close"
        elif ch == "," and state in ("number", "close"):
            state = "comma"
        elif ch == " " and state == "comma":
            state = "comma_space"
        else:
            return None
    return state


@pytest.fixture(scope="module")
def texts(tokenizer) -> list[str | None]:
    """Each token's text where it is whole characters (None for special tokens and byte-level pieces)."""
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    texts = [None if i in special else tokenizer.convert_tokens_to_string([p]) for i, p in enumerate(pieces)]
    return [None if t is None or "\ufffd" in t else t for t in texts]


def _recogniser_allowed(texts, text: str, eos: int) -> list[int]:
    if nested_list_state(text) == "done":
        return [eos]
    return [i for i, t in enumerate(texts) if t and nested_list_state(text + t) is not None]


@pytest.mark.parametrize("grammar", [NESTED_GBNF, NESTED_LARK], ids=["gbnf", "lark"])
def test_allowed_tokens_are_exactly_those_that_keep_a_sentence_possible(tokenizer, texts, grammar):
    guide = GuidedGrammar(compile_grammar(grammar), GrammarVocabulary(tokenizer, {0}))
    written = "[[1, 23], [], [[4]], 5]"
    output = tokenizer.encode(written, add_special_tokens=False)
    cursor = guide.start()
    for length in range(len(output) + 1):
        text = tokenizer.decode(output[:length])
        assert cursor.allowed_tokens(output[:length]).tolist() == _recogniser_allowed(texts, text, 0), text
        assert cursor.is_complete(output[:length]) == (text == written)
    other = guide.start()  # a second parse of the same guide starts from the beginning
    assert other.allowed_tokens([]).tolist() == _recogniser_allowed(texts, "", 0)


@pytest.mark.parametrize("grammar, pattern, texts_after", [
    ('root ::= [0-9]+ ("." [0-9]+)?', r"[0-9]+(\.[0-9]+)?", ["", "1", "12.", "12.5"]),
    ('start: ("yes" | "no") "!"?', r"(yes|no)!?", ["", "no", "no!"]),
    ('root ::= "(" [a-c]* ")" | "x" [^()]{0,3}', r"\([a-c]*\)|x[^()]{0,3}", ["", "(ab", "x", "xé"]),
])
def test_a_regular_grammar_allows_what_the_regex_guide_allows(tokenizer, grammar, pattern, texts_after):
    # One language written two ways, as a grammar and as a regular expression: the same tokens,
    # byte-level pieces of a character (after "x", of any but "(" and ")") and every end of sequence id included.
    eos = {0, 2}
    guides = Guides(tokenizer, eos)
    regex_guide = guides.for_request(SamplingParams(guided_decoding={"regex": pattern}).guided_decoding)
    grammar_guide = guides.for_request(SamplingParams(guided_decoding={"grammar": grammar}).guided_decoding)
    for text in texts_after:
        ids = tokenizer.encode(text, add_special_tokens=False)
        from_grammar = grammar_guide.start().allowed_tokens(ids).tolist()
        assert from_grammar == regex_guide.start().allowed_tokens(ids).tolist(), text
        assert (eos <= set(from_grammar)) == bool(re.fullmatch(pattern, text)), text


def test_text_the_grammar_forces_is_written_as_the_tokenizer_writes_it(tokenizer, texts):
    # After "y" only "es" can follow: llguidance then allows the tokens the tokenizer would write
    # "es" with, not every token that spells part of it ("e" does too).
    guide = GuidedGrammar(compile_grammar('start: ("yes" | "no") "!"?'), GrammarVocabulary(tokenizer, {0}))
    after_y = guide.start().allowed_tokens(tokenizer.encode("y", add_special_tokens=False)).tolist()
    assert after_y == tokenizer.encode("es", add_special_tokens=False)
    spelling = [i for i, t in enumerate(texts) if t and "es".startswith(t)]
    assert set(after_y) < set(spelling) and tokenizer.encode("e", add_special_tokens=False)[0] in spelling


@pytest.mark.parametrize("grammar, message", [
    ("root ::= missing", "Rule 'missing' not found"),
    ("root ::= 'a'", "Expected name"),  # GBNF literals take double quotes
    ('start: "a" (', "Expected token"),
    ('start: "a" | other', "unknown name"),
    ("   ", "non-empty string"),
    (["root ::= \"a\""], "non-empty string"),
])
def test_a_grammar_that_cannot_be_followed_is_a_clear_error(grammar, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_guided_decoding({"grammar": grammar})


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_greedy_grammar_equals_transformers_with_the_same_constraint(engine, hf_model, tokenizer, texts):
    import torch

    ids = _chat_ids(tokenizer, PROMPT)
    outs = engine.generate(prompt_token_ids=[ids, ids], params=[
        SamplingParams(max_tokens=48, guided_decoding={"grammar": NESTED_GBNF}),
        SamplingParams(max_tokens=48, guided_decoding={"grammar": NESTED_LARK})])
    assert outs[0].token_ids == outs[1].token_ids  # one language, two notations
    out = outs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), list), out.text
    assert nested_list_state(out.text) == "done"
    eos = tokenizer.eos_token_id

    def allowed(_batch: int, input_ids) -> list[int]:
        return _recogniser_allowed(texts, tokenizer.decode(input_ids[len(ids):]), eos)

    ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=eos,
                            pad_token_id=eos, prefix_allowed_tokens_fn=allowed)
    ref_ids = ref[0, len(ids):].tolist()
    assert out.token_ids == [t for t in ref_ids if t != eos]


def test_sampled_completions_are_all_sentences_or_prefixes_of_one(engine):
    params = SamplingParams(n=4, max_tokens=32, temperature=1.0, seed=3, guided_decoding={"grammar": NESTED_GBNF})
    outs = engine.generate([PROMPT], params, apply_chat_template=True)
    for o in outs:
        state = nested_list_state(o.text)
        assert state == "done" if o.finish_reason == "stop" else state is not None, (o.text, o.finish_reason)
    assert len({o.text for o in outs}) > 1


TREE = {"$defs": {"node": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
    "required": ["name", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"}


def _is_tree(value) -> bool:
    return (isinstance(value, dict) and list(value) == ["name", "children"] and isinstance(value["name"], str)
            and len(value["name"]) <= 12 and isinstance(value["children"], list) and len(value["children"]) <= 3
            and all(_is_tree(child) for child in value["children"]))


def test_a_recursive_json_schema_is_followed(engine):
    # A tree nests without bound: llguidance's parser keeps its brackets however deep it goes.
    copy = '{"name": "root", "children": [{"name": "left", "children": []}, {"name": "right", "children": [{"name": "leaf", "children": []}]}]}'
    prompts = [f"Repeat this JSON exactly: {copy}", "A tree with one root and no children, as JSON."]
    outs = engine.generate(prompts, SamplingParams(max_tokens=96, guided_decoding={"json": TREE}),
                           apply_chat_template=True)
    assert outs[0].text == copy
    for out in outs:
        assert out.finish_reason == "stop" and _is_tree(json.loads(out.text)), out.text
    broken = json.loads(json.dumps(TREE))
    broken["$defs"]["node"]["properties"]["name"]["pattern"] = "[a-"
    with pytest.raises(InvalidRequestError, match="unclosed character class"):  # llguidance's check, on arrival
        engine.generate(["x"], SamplingParams(max_tokens=1, guided_decoding={"json": broken}))


@pytest.mark.server
def test_guided_grammar_through_tritonserver(triton_server, engine):
    sampling = {"max_tokens": 48, "guided_decoding": {"grammar": NESTED_LARK}}
    client = StreamClient(triton_server.grpc_url)
    try:
        client.send("g", make_inputs(PROMPT, chat=True, exclude_input=True, sampling=sampling))
        got = client.wait(["g"])
        client.send("bad", make_inputs(PROMPT, sampling={"guided_decoding": {"grammar": "root ::= missing"}}))
        got.update(client.wait(["bad"]))
    finally:
        client.close()
    [offline] = engine.generate([PROMPT], SamplingParams(**sampling), apply_chat_template=True)
    assert got["g"].error is None and got["g"].text == offline.text and nested_list_state(offline.text) == "done"
    assert got["bad"].error is not None and "Rule 'missing' not found" in got["bad"].error
