"""guided_decoding {"regex": ...}: the guide accepts exactly what Python's re.fullmatch accepts (the
pattern is read in Python's syntax), allows exactly the tokens that keep a match possible, byte-level
pieces of a character included, refuses by name what it cannot follow, and the engine's constrained
greedy output equals transformers' generate constrained by a brute-force check."""

from __future__ import annotations

import random
import re

import llguidance
import pytest
import regex  # transformers' tokenizer dependency: its partial matching is the independent oracle here

from grpc_stream import StreamClient, make_inputs
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams
from tritonllm.guided.decoding import Guides, parse_guided_decoding

pytestmark = pytest.mark.unit

PATTERNS = [r"a[^\"x-z\d]*|(b{2,3})\.?", r"\d{3}-\d{4}", r"(ab|a)*c?", r"[a-c]+?b", r"x.y", r"(?s)x.y",
            r"\w+\s\W", r"^(yes|no)$", r"[^a]{0,3}", r"(a|b|)+c{1,2}", r"\Aab\Z"]
# Patterns whose text Python's re and the Rust syntax llguidance reads take differently.
SYNTAX_PATTERNS = [r"(?i)aB[c-e]", r"a(?i:b)c", r"(?i)a(?-i:b)", "(?x) a b # a comment\n [ ]c", r"[[a]", r"\<a\>",
                   r"a{,2}b", r"a{x}", r"[a-c-]+", r"[]a]", r"[^]a]+", r"\x41\101\0", r"[&&~]{2}", r"a|b{1}}",
                   r"(?P<n>x)y", r"(?#note)z", r"\N{LATIN SMALL LETTER E WITH ACUTE}+", r"[\b\d.]+", r"(?m)^a$"]
ALPHABET = "abcxyzABC0123.-\n _\"é😀<>[]&~{}\x00\x08"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def _random_strings(count: int, seed: int):
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7))) for _ in range(count)]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (the packaged model's tokenizer's): the character standing for each byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    unprintable = [b for b in range(256) if b not in bs]  # stand-ins from U+0100 on, in byte order
    return dict(zip(bs + unprintable, map(chr, cs + [256 + n for n in range(len(unprintable))])))


@pytest.fixture(scope="module")
def guides(tokenizer):
    return Guides(tokenizer, {tokenizer.eos_token_id})


@pytest.fixture(scope="module")
def token_bytes(tokenizer) -> list[bytes | None]:
    """Each token's bytes, from the tokenizer's own byte-level pieces (None for special tokens)."""
    decoder = {ch: b for b, ch in _bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [None if i in special else bytes(decoder[ch] for ch in piece) for i, piece in enumerate(pieces)]


@pytest.fixture(scope="module")
def whole_texts(token_bytes) -> list[str | None]:
    """Each token's text where it is whole characters (None for special tokens and byte-level pieces)."""
    def text(b):
        try:
            return b.decode() if b is not None else None
        except UnicodeDecodeError:
            return None
    return [text(b) for b in token_bytes]


def _matcher_for(guides, pattern: str):
    """A fresh llguidance matcher of the guide the engine builds for `pattern`."""
    guide = guides.for_request(SamplingParams(guided_decoding={"regex": pattern}).guided_decoding)
    return llguidance.LLMatcher(guide.vocabulary.tokenizer, guide.grammar, log_level=0)


def _byte_ids(token_bytes) -> dict[int, int]:
    """The token of each single byte, so that any string can be fed one byte at a time."""
    return {b[0]: i for i, b in enumerate(token_bytes) if b is not None and len(b) == 1}


@pytest.mark.parametrize("pattern", PATTERNS + SYNTAX_PATTERNS)
def test_the_guide_accepts_exactly_what_re_fullmatch_accepts(guides, token_bytes, pattern):
    fresh, by_byte = _matcher_for(guides, pattern), _byte_ids(token_bytes)
    extra = ["ab", "bbb.", "123-4567", "yes", "xyz", "aBd", "AbC", "a b c", "[", "<a>", "A\x41\x00", "éé", "b}", "aab"]
    for text in _random_strings(1000, seed=len(pattern)) + extra:
        matcher = fresh.deep_copy()
        accepted = matcher.consume_tokens([by_byte[b] for b in text.encode()]) and matcher.is_accepting()
        assert accepted == bool(re.fullmatch(pattern, text)), (pattern, text)


@pytest.mark.parametrize("pattern", [p for p in PATTERNS if "+?" not in p])
def test_a_prefix_is_live_exactly_when_some_continuation_can_match(guides, token_bytes, pattern):
    # regex's partial matching says whether `text` could still grow into a match (greedy patterns only:
    # its partial answers for lazy quantifiers are looser than the language).
    fresh, by_byte = _matcher_for(guides, pattern), _byte_ids(token_bytes)
    for text in _random_strings(1000, seed=7 + len(pattern)):
        matcher = fresh.deep_copy()
        live = matcher.consume_tokens([by_byte[b] for b in text.encode()]) and not matcher.is_error()
        assert live == bool(regex.fullmatch(pattern, text, partial=True)), (pattern, text)


@pytest.mark.parametrize("pattern, message", [
    (r"(a)\1", "backreferences"),
    (r"(?P<x>a)(?P=x)", "backreferences"),
    (r"a(?=b)", "lookarounds"),
    (r"(?<!a)b", "lookarounds"),
    (r"(a)?(?(1)b|c)", "conditional groups"),
    (r"(?>a|ab)c", "atomic groups"),
    (r"a*+b", "possessive quantifiers"),
    (r"(?a)\w+", "only the flags"),
    (r"a\bb", "word boundaries"),
    (r"a(?i)b", "must come at the start"),
    (r"a^b", "lookarounds not supported yet"),  # an anchor inside the pattern (llguidance's own check)
    (r"a[", "not a valid regular expression"),
    (r"\q", "not a valid regular expression"),
])
def test_what_the_guide_cannot_follow_is_refused(pattern, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        parse_guided_decoding({"regex": pattern})


def test_case_insensitive_scoped_flags_and_long_repeats_are_followed(guides, token_bytes, whole_texts):
    for pattern, good, bad in [(r"(?i)abc", ["ABC", "aBc"], ["abd"]), (r"a(?i:b)c", ["aBc"], ["ABc", "aBC"])]:
        fresh, by_byte = _matcher_for(guides, pattern), _byte_ids(token_bytes)
        for text in good + bad:
            matcher = fresh.deep_copy()
            accepted = matcher.consume_tokens([by_byte[b] for b in text.encode()]) and matcher.is_accepting()
            assert accepted == (text in good), (pattern, text)
    # A million characters: no automaton is built up front, so the size of a repeat does not matter.
    cursor = guides.for_request(SamplingParams(guided_decoding={"regex": r"([ab]{1000}){1000}"}).guided_decoding).start()
    a_or_b = [i for i, t in enumerate(whole_texts) if t and set(t) <= {"a", "b"}]
    assert cursor.allowed_tokens([]).tolist() == a_or_b


def _brute_force_live(texts, pattern: str, text: str) -> list[int]:
    compiled = regex.compile(pattern)
    return [i for i, t in enumerate(texts) if t and compiled.fullmatch(text + t, partial=True)]


@pytest.mark.parametrize("pattern, text, forced", [
    (PHONE, "", None), (PHONE, "(55", None), (PHONE, "(555) 12", None), (PHONE, "(555) 123-456", None),
    (r'\{"name": "[^"]*", "age": [0-9]+\}', '{"name": "Jo', None),
    (r'\{"name": "[^"]*", "age": [0-9]+\}', '{"name": "Jo", "age": 4', None),
    (r"(Paris|London|Rome) is (big|small)\.", "", None),
    (r"(Paris|London|Rome) is (big|small)\.", "Rome is small.", None),
    (r"[0-9]+", "12", None),
    (r'\{"a": "(?:[^"\\]|\\.){0,8}", "b": \[(?:[0-9]+(?:, [0-9]+){0,2})?\]\}', '{"a": "x\\', None),
    # Only one text can follow: the tokens the tokenizer writes it with, not every token spelling a piece of it.
    (r"(Paris|London|Rome) is (big|small)\.", "Lon", "don is "),
    (r"(yes|no)!?", "y", "es"),
])
def test_allowed_tokens_are_exactly_those_that_keep_a_match_possible(guides, tokenizer, whole_texts, pattern, text,
                                                                     forced):
    eos = tokenizer.eos_token_id
    cursor = guides.for_request(SamplingParams(guided_decoding={"regex": pattern}).guided_decoding).start()
    allowed = cursor.allowed_tokens(tokenizer.encode(text, add_special_tokens=False)).tolist()
    whole = [t for t in allowed if whole_texts[t] is not None or t == eos]  # byte-level pieces: the next test
    live = _brute_force_live(whole_texts, pattern, text)
    expected = sorted(live + ([eos] if re.fullmatch(pattern, text) else []))
    if forced is None:
        assert whole == expected
    else:
        assert whole == tokenizer.encode(forced, add_special_tokens=False)[:1] and set(whole) < set(live)


EMOJI = "😀🎉🚀"


def _byte_level_live(token_bytes, pattern: str, prefix: bytes, eos: int) -> list[int]:
    """The tokens whose bytes, after `prefix`, keep a match possible, by bytes: a cut-off last
    character counts where one of EMOJI + "é" completes it into a match's prefix."""
    compiled = regex.compile(pattern)
    live = []
    for i, b in enumerate(token_bytes):
        if not b:
            continue
        data = prefix + b
        for cut in range(len(data), max(len(data) - 4, -1), -1):  # the longest prefix of whole characters
            try:
                text, rest = data[:cut].decode(), data[cut:]
                break
            except UnicodeDecodeError:
                continue
        else:
            continue
        if not rest and compiled.fullmatch(text, partial=True):
            live.append(i)
        elif rest and any(c.encode().startswith(rest) and compiled.fullmatch(text + c, partial=True) for c in EMOJI + "é"):
            live.append(i)
    if prefix.decode(errors="ignore").encode() == prefix and re.fullmatch(pattern, prefix.decode()):
        live.append(eos)
    return sorted(live)


@pytest.mark.parametrize("pattern, text, cut", [
    (f"[{EMOJI}]+", "😀", 2), (f"[{EMOJI}]+", "😀🎉", 2),
    (f"(😀|é)+ ?[{EMOJI}]", "", 0), (f"(😀|é)+ ?[{EMOJI}]", "😀", 0), (f"(😀|é)+ ?[{EMOJI}]", "😀", 2),
    (f"(😀|é)+ ?[{EMOJI}]", "😀é", 0),
])
def test_byte_level_pieces_are_allowed_where_their_character_can_follow(guides, tokenizer, token_bytes, pattern, text,
                                                                         cut):
    # The packaged model's tokenizer has no whole token for these emoji: each is three byte-level
    # pieces, the first ("\xf0\x9f") shared by all three, so a guide that matched whole characters
    # only could never write one. The output so far is `text` less its last `cut` tokens, a place
    # where more than one byte can follow.
    eos = tokenizer.eos_token_id
    cursor = guides.for_request(SamplingParams(guided_decoding={"regex": pattern}).guided_decoding).start()
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids[:len(ids) - cut]
    prefix = b"".join(token_bytes[i] for i in ids)
    allowed = cursor.allowed_tokens(ids).tolist()
    assert allowed == _byte_level_live(token_bytes, pattern, prefix, eos)
    assert any((prefix + token_bytes[t]).decode(errors="replace").endswith("\ufffd") for t in allowed if t != eos)


def test_a_forced_piece_is_the_one_the_tokenizer_writes(guides, tokenizer, token_bytes):
    # Every emoji here starts with "\xf0\x9f": that byte pair is forced, and only its own piece is
    # allowed, not the single-byte token "\xf0" that also spells a part of it.
    cursor = guides.for_request(SamplingParams(guided_decoding={"regex": f"[{EMOJI}]+"}).guided_decoding).start()
    live = _byte_level_live(token_bytes, f"[{EMOJI}]+", b"", tokenizer.eos_token_id)
    allowed = cursor.allowed_tokens([]).tolist()
    assert allowed == tokenizer.encode("😀", add_special_tokens=False)[:1] and set(allowed) < set(live)


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_greedy_output_of_characters_written_only_in_byte_level_pieces(engine, tokenizer):
    pattern = f"[{EMOJI}]{{3}} (yes|no)"
    [out] = engine.generate(prompt_token_ids=[_chat_ids(tokenizer, "React with three emoji, then say yes or no.")],
                            params=SamplingParams(max_tokens=24, guided_decoding={"regex": pattern}))
    assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out.text
    assert any("\ufffd" in tokenizer.decode([t]) for t in out.token_ids)  # a piece of a character


def _reference_allowed(guides, whole_texts, pattern: str, eos: int, prompt_len: int):
    """transformers' prefix_allowed_tokens_fn for the same constraint: a guide of its own (not the
    engine's), each step's tokens checked against regex's partial matching: every token of whole
    characters it allows keeps a match possible, and where more than one text can follow it allows
    every such token."""
    cursor = guides.for_request(SamplingParams(guided_decoding={"regex": pattern}).guided_decoding).start()

    def allowed(_batch: int, input_ids) -> list[int]:
        output = input_ids[prompt_len:].tolist()
        text = "".join(whole_texts[t] for t in output)
        ids = cursor.allowed_tokens(output).tolist()
        live = _brute_force_live(whole_texts, pattern, text)
        whole = [t for t in ids if whole_texts[t] is not None and t != eos]
        assert set(whole) <= set(live) and (eos in ids) == bool(re.fullmatch(pattern, text)), text
        assert len(whole) == 1 or whole == live, text  # only a forced text is narrowed (to the tokenizer's token)
        return ids
    return allowed


@pytest.mark.parametrize("pattern, prompt", [
    (PHONE, "Write a US phone number."),
    (r"(Paris|London|Rome) is the capital of [A-Z][a-z]+\.", "What is the capital of France?"),
])
def test_greedy_regex_equals_transformers_with_the_same_constraint(engine, hf_model, tokenizer, guides, whole_texts,
                                                                  pattern, prompt):
    import torch

    ids = _chat_ids(tokenizer, prompt)
    [out] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=24,
                                                                          guided_decoding={"regex": pattern}))
    assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out.text
    eos = tokenizer.eos_token_id
    ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                            prefix_allowed_tokens_fn=_reference_allowed(guides, whole_texts, pattern, eos, len(ids)))
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
