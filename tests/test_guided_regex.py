"""guided_decoding {"regex": ...}: the automaton agrees with Python's regex engines, the vocabulary walk
allows exactly the tokens a brute-force check allows, and the engine's constrained greedy output equals
transformers' generate constrained by that brute-force check."""

from __future__ import annotations

import json
import random
import re

import pytest
import regex  # transformers' tokenizer dependency: its partial matching is the independent oracle here

from grpc_stream import StreamClient, make_inputs
from tritonllm.guided.regex import GuidedRegex, VocabularyTrie
from tritonllm.guided.regex_automaton import DEAD, RegexAutomaton
from tritonllm.engine.sampling_params import InvalidRequestError, SamplingParams

PATTERNS = [r"a[^\"x-z\d]*|(b{2,3})\.?", r"\d{3}-\d{4}", r"(ab|a)*c?", r"[a-c]+?b", r"x.y", r"(?s)x.y",
            r"\w+\s\W", r"^(yes|no)$", r"[^a]{0,3}", r"(a|b|)+c{1,2}", r"\Aab\Z"]
ALPHABET = "abcxyz0123.-\n _\"é"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def _random_strings(count: int, seed: int):
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7))) for _ in range(count)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_automaton_matches_what_re_fullmatch_matches(pattern):
    automaton = RegexAutomaton(pattern)
    for text in _random_strings(2000, seed=len(pattern)) + ["ab", "bbb.", "123-4567", "yes", "xyz"]:
        assert automaton.fullmatch(text) == bool(re.fullmatch(pattern, text)), (pattern, text)


@pytest.mark.parametrize("pattern", [p for p in PATTERNS if "+?" not in p])
def test_a_prefix_is_live_exactly_when_some_continuation_can_match(pattern):
    # regex's partial matching says whether `text` could still grow into a match (greedy patterns only:
    # its partial answers for lazy quantifiers are looser than the language).
    automaton = RegexAutomaton(pattern)
    for text in _random_strings(2000, seed=7 + len(pattern)):
        live = automaton.walk(text) != DEAD
        assert live == bool(regex.fullmatch(pattern, text, partial=True)), (pattern, text)


@pytest.mark.parametrize("pattern, message", [
    (r"(a)\1", "backreferences"),
    (r"a(?=b)", "lookarounds"),
    (r"(?<!a)b", "lookarounds"),
    (r"(?>a|ab)c", "atomic groups"),
    (r"a*+b", "possessive quantifiers"),
    (r"(?i)abc", "(?i)"),
    (r"(?a)\w+", "only the flags"),
    (r"a\bb", "word boundaries"),
    (r"a(?i:b)", "scoped flags"),
    (r"a[", "not a valid regular expression"),
    (r"(a{1000}){1000}", "too large"),
])
def test_what_an_automaton_cannot_follow_is_refused(pattern, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        SamplingParams(guided_decoding={"regex": pattern})


@pytest.fixture(scope="module")
def vocabulary(tokenizer):
    return VocabularyTrie.from_tokenizer(tokenizer)


def _brute_force_live(vocabulary, pattern: str, text: str) -> list[int]:
    compiled = regex.compile(pattern)
    return [i for i, t in enumerate(vocabulary.texts) if t and compiled.fullmatch(text + t, partial=True)]


@pytest.mark.parametrize("pattern, text", [
    (PHONE, ""), (PHONE, "(55"), (PHONE, "(555) 12"), (PHONE, "(555) 123-456"),
    (r'\{"name": "[^"]*", "age": [0-9]+\}', '{"name": "Jo'),
    (r'\{"name": "[^"]*", "age": [0-9]+\}', '{"name": "Jo", "age": 4'),
    (r"(Paris|London|Rome) is (big|small)\.", "Lon"),
    (r"(Paris|London|Rome) is (big|small)\.", "Rome is small."),
    (r"[0-9]+", "12"),
    (r'\{"a": "(?:[^"\\]|\\.){0,8}", "b": \[(?:[0-9]+(?:, [0-9]+){0,2})?\]\}', '{"a": "x\\'),
])
def test_allowed_tokens_are_exactly_those_that_keep_a_match_possible(vocabulary, pattern, text):
    guide = GuidedRegex(RegexAutomaton(pattern), vocabulary, eos_token_ids={0})
    expected = _brute_force_live(vocabulary, pattern, text) + ([0] if re.fullmatch(pattern, text) else [])
    assert guide.allowed_after(text).tolist() == sorted(expected)


def test_a_sequence_cursor_agrees_with_walking_its_whole_output(tokenizer, vocabulary):
    # The cursor walks only each step's new tokens; two cursors on one guide keep their own places.
    guide = GuidedRegex(RegexAutomaton(r'\["[a-z ]*"(, "[a-z ]*"){0,40}\]'), vocabulary, eos_token_ids={0})
    outputs = [tokenizer.encode(json.dumps(["the quick brown fox"] * 12), add_special_tokens=False),
               tokenizer.encode('["over", "lazy dogs", "and', add_special_tokens=False) + [1234, 99]]
    cursors = [guide.start(), guide.start()]
    for length in range(max(map(len, outputs)) + 1):
        for cursor, output in zip(cursors, outputs):
            prefix = output[:length]
            assert cursor.allowed_tokens(prefix).tolist() == guide.allowed_tokens(prefix).tolist()
            assert cursor.is_complete(prefix) == guide.is_complete(prefix)
    assert cursors[0].is_complete(outputs[0]) and guide.allowed_in(guide.automaton.walk("[1")).tolist() == [0]


def test_special_and_partial_character_tokens_never_match(tokenizer, vocabulary):
    assert all(vocabulary.texts[i] is None for i in tokenizer.all_special_ids)
    assert not any(t and "\ufffd" in t for t in vocabulary.texts)
    assert sum(t is not None for t in vocabulary.texts) > 0.95 * len(tokenizer)


def _reference_allowed(vocabulary, pattern: str, eos: int, prompt_len: int):
    """transformers' prefix_allowed_tokens_fn for the same constraint, from regex's partial matching."""
    compiled = regex.compile(pattern)

    def allowed(_batch: int, input_ids) -> list[int]:
        text = "".join(vocabulary.texts[t] for t in input_ids[prompt_len:].tolist())
        ids = _brute_force_live(vocabulary, pattern, text)
        if compiled.fullmatch(text) or not ids:
            ids.append(eos)
        return ids
    return allowed


@pytest.mark.parametrize("pattern, prompt", [
    (PHONE, "Write a US phone number."),
    (r"(Paris|London|Rome) is the capital of [A-Z][a-z]+\.", "What is the capital of France?"),
])
def test_greedy_regex_equals_transformers_with_the_same_constraint(engine, hf_model, tokenizer, vocabulary,
                                                                  pattern, prompt):
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    [out] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=24,
                                                                          guided_decoding={"regex": pattern}))
    assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out.text
    eos = tokenizer.eos_token_id
    ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                            pad_token_id=eos, prefix_allowed_tokens_fn=_reference_allowed(vocabulary, pattern, eos,
                                                                                         len(ids)))
    ref_ids = ref[0, len(ids):].tolist()
    assert out.token_ids == [t for t in ref_ids if t != eos] or out.token_ids == ref_ids


def test_sampled_outputs_all_match(engine):
    params = SamplingParams(n=6, max_tokens=24, temperature=1.2, seed=5, guided_decoding={"regex": PHONE})
    outs = engine.generate(["Write a phone number."], params, apply_chat_template=True)
    assert all(re.fullmatch(PHONE, o.text) and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert len({o.text for o in outs}) > 1


def test_a_match_that_can_go_on_stops_at_end_of_sequence_or_length(engine):
    [out] = engine.generate(["Count: "], SamplingParams(max_tokens=6, guided_decoding={"regex": r"[0-9 ,]+"}))
    assert re.fullmatch(r"[0-9 ,]+", out.text) and out.finish_reason in ("stop", "length")


@pytest.mark.server
def test_guided_regex_through_tritonserver(triton_server):
    client = StreamClient(triton_server.grpc_url)
    try:
        client.send("r", make_inputs("Write a US phone number.", chat=True, exclude_input=True,
                                     sampling={"max_tokens": 24, "guided_decoding": {"regex": PHONE}}))
        got = client.wait(["r"])
        client.send("bad", make_inputs("Hi", sampling={"guided_decoding": {"regex": r"(a)\1"}}))
        got.update(client.wait(["bad"]))
    finally:
        client.close()
    assert got["r"].error is None and re.fullmatch(PHONE, got["r"].text), got["r"].text
    assert got["bad"].error is not None and "backreferences" in got["bad"].error
