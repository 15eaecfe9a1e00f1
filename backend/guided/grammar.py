"""Guided decoding through llguidance: every kind of guided_decoding becomes one llguidance grammar,
compiled once per text (when the request is checked) and shared by every request and completion
that sends it; each sequence keeps its own matcher (`GrammarCursor`), which consumes only the tokens
added since the last step.

What each kind compiles to:
- `regex`: a grammar of that one regular expression, read in Python's `re` syntax and written out
  in the Rust syntax llguidance reads (regex_syntax.py);
- `json`: llguidance's JSON schema compiler, and `json_object` the same for `{"type": "object"}`;
  written with one space after `:` and `,` and no other whitespace, or with `whitespace_pattern`
  between tokens when the request gives one (`json_compile_options`); an object that lists its
  `properties` has only those unless its schema says otherwise (`closed_objects`);
- `choice`: alternatives of the choices' token sequences as the tokenizer writes each choice alone
  (llguidance's `<[id]>` token literals), so the model reads each choice as it was trained to;
- `grammar`: GBNF (llama.cpp's `root ::= ...`, what vLLM's default xgrammar backend takes) or Lark
  (`start: ...`, what its guidance backend takes);
- `structural_tag`: llguidance's tagged segments (structural_tag.py).

llguidance matches bytes, not characters: a token holding part of a multi-byte character (the
byte-level pieces of an emoji, say) is allowed where the character can follow. Its Earley parser
keeps the parse, so a grammar or JSON value nests without limit, and its token trie lists the
tokens that keep the output a prefix of some sentence, end of sequence where the output is one.
Where the grammar leaves only one way on (the rest of a literal, say), llguidance allows just the
tokens the tokenizer itself would write that text with, not every token that spells a piece of it.
"""

from __future__ import annotations

import json
import sys
import threading
from functools import lru_cache

import numpy as np

from tritonllm.core.errors import InvalidRequestError
from tritonllm.guided.regex_syntax import python_regex_to_rust

# JSON schema keywords llguidance does not enforce that are accepted anyway, the value then being any
# value of its type: uniqueItems is common in generated schemas (a set field), and refusing every such
# schema would serve no one. Every other keyword llguidance does not implement is refused.
_UNENFORCED_KEYWORDS = frozenset({"uniqueItems"})


def llguidance_module():
    try:
        import llguidance
    except ImportError:  # a dependency of the package; say so rather than fail obscurely mid-request
        raise InvalidRequestError("guided_decoding needs the llguidance package, which this server "
                                  "lacks (pip install llguidance)") from None
    return llguidance


def one_paragraph(message) -> str:
    return " ".join(str(message).split())


def _checked(grammar: str, what: str) -> str:
    error = llguidance_module().LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"{what}: {one_paragraph(error)}")
    return grammar


@lru_cache(maxsize=64)
def compile_grammar(text: str) -> str:
    """llguidance's grammar for `text` (GBNF or Lark), or InvalidRequestError saying what is wrong with it."""
    llguidance = llguidance_module()
    try:
        grammar = llguidance.grammar_from("grammar", text)
    except (ValueError, RuntimeError) as exc:  # GBNF that does not convert
        raise InvalidRequestError(f"guided_decoding grammar: {one_paragraph(exc)}") from None
    return _checked(grammar, "guided_decoding grammar")


@lru_cache(maxsize=64)
def compile_regex(pattern: str) -> str:
    """llguidance's grammar for output matching `pattern` (Python `re` syntax) as a whole."""
    return _checked(llguidance_module().LLMatcher.grammar_from_regex(python_regex_to_rust(pattern)), "guided regex")


@lru_cache(maxsize=64)
def compile_json_schema_grammar(schema_text: str, whitespace_pattern: str | None = None) -> str:
    """llguidance's grammar for JSON that a schema (JSON text) accepts, written as `json_compile_options` says."""
    llguidance = llguidance_module()
    options = json_compile_options(whitespace_pattern)

    def compile_with(extra: dict) -> str:
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema_text, overrides={**options, **extra})
        except ValueError as exc:
            raise InvalidRequestError(f"guided json: {one_paragraph(exc)}") from None

    grammar = compile_with({})
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not failed:
        return grammar
    # Strictly, llguidance refuses a keyword it does not implement and an unknown string format. An
    # unknown format is an annotation in JSON Schema, and some keywords are knowingly left
    # unenforced (_UNENFORCED_KEYWORDS): accept the schema leniently when those are all its warnings.
    lenient = compile_with({"lenient": True})
    lenient_failed, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(lenient)
    if not lenient_failed and warnings and all(_tolerated(w) for w in warnings):
        return lenient
    raise InvalidRequestError(f"guided json: {one_paragraph(messages[0] if messages else 'invalid schema')}")


def _tolerated(warning: str) -> bool:
    if warning.startswith("Unknown format:"):
        return True
    prefix = "Unimplemented keys: "
    if warning.startswith(prefix):
        try:
            keys = json.loads(warning[len(prefix):])
        except json.JSONDecodeError:
            return False
        return isinstance(keys, list) and set(keys) <= _UNENFORCED_KEYWORDS
    return False


# Where a schema holds schemas: one, a list of them, or an object of them by name.
_ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
               "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema, in_all_of: bool = False):
    """`schema` with `"additionalProperties": false` in every object schema that lists `properties`
    (or `patternProperties`) and says nothing of other properties. JSON Schema allows any other property by default, and a
    model left free to add them tends to add one after another (and the same one twice) until it
    runs out of tokens; vLLM's default backend closes such objects too. A branch of an `allOf` is
    left open, as closing it would refuse the properties of its sibling branches."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _ONE_SCHEMA:
        if isinstance(closed.get(key), dict):
            closed[key] = closed_objects(closed[key])
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(s, in_all_of=key == "allOf") for s in closed[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(s) for name, s in closed[key].items()}
    if ({"properties", "patternProperties"} & set(closed) and not in_all_of and "allOf" not in closed
            and not {"additionalProperties", "unevaluatedProperties"} & set(closed)):
        closed["additionalProperties"] = False
    return closed


def json_compile_options(whitespace_pattern: str | None) -> dict:
    """llguidance's JSON options for how our JSON guides write JSON: compact, with one space after
    `:` and `,` (as Python's json.dumps writes it), or `whitespace_pattern` (Python `re` syntax)
    between tokens when the request gives one."""
    if whitespace_pattern is None:
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    pattern = python_regex_to_rust(whitespace_pattern, "guided_decoding whitespace_pattern")
    return {"whitespace_pattern": pattern, "item_separator": ",", "key_separator": ":"}


@lru_cache(maxsize=64)
def choice_grammar(choices: tuple[tuple[int, ...], ...]) -> str:
    """llguidance's grammar for output that is one of `choices`, each the token ids the tokenizer
    writes that choice with."""
    lark = "start: " + " | ".join("".join(f"<[{t}]>" for t in tokens) for tokens in sorted(set(choices)))
    return _checked(llguidance_module().LLMatcher.grammar_from_lark(lark), "guided_decoding choice")


class GrammarVocabulary:
    """The engine's tokenizer as llguidance sees it (built once per engine)."""

    def __init__(self, tokenizer, eos_token_ids: set[int]):
        llguidance = llguidance_module()
        import llguidance.hf

        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=sorted(eos_token_ids))
        except ValueError as exc:  # a slow (Python) tokenizer
            raise InvalidRequestError(f"guided_decoding: {exc}") from None
        self.size = self.tokenizer.vocab_size
        self.eos_mask = np.zeros(self.size, dtype=bool)
        self.eos_mask[sorted(eos_token_ids)] = True
        self.eos_mask.flags.writeable = False  # shared by every stopped sequence


class GuidedGrammar:
    """A request's guide (one per grammar text and engine): `start()` gives each sequence its parse."""

    def __init__(self, grammar: str, vocabulary: GrammarVocabulary):
        self.grammar = grammar
        self.vocabulary = vocabulary
        self._fresh = None  # a matcher that has consumed nothing, copied for each sequence
        self._lock = threading.Lock()

    def start(self) -> "GrammarCursor":
        return GrammarCursor(self, self.fresh_matcher())

    def fresh_matcher(self):
        """A matcher that has consumed nothing."""
        # Building a matcher sets up the grammar's lexer; a copy of a fresh one shares it.
        with self._lock:
            if self._fresh is None:
                self._fresh = llguidance_module().LLMatcher(self.vocabulary.tokenizer, self.grammar, log_level=0)
            return self._fresh.deep_copy()


class GrammarCursor:
    """One sequence's parse: llguidance's matcher after the output tokens consumed so far."""

    def __init__(self, guide: GuidedGrammar, matcher):
        self.guide = guide
        self._matcher = matcher
        self._consumed = 0
        # llguidance writes the mask here (one bit per token in 32-bit words) rather than into a new bytes object.
        self._words = np.zeros((guide.vocabulary.size + 31) // 32, dtype=np.uint32)

    def start(self) -> "GrammarCursor":
        """A fresh parse of the same grammar (another completion of the same request)."""
        return self.guide.start()

    def _catch_up(self, output: list[int]) -> None:
        if len(output) < self._consumed:  # defensively: an output never shrinks, but then parse it again
            # (from a fresh matcher: llguidance's reset() after a grammar's end can leave it ended)
            self._matcher = self.guide.fresh_matcher()
            self._consumed = 0
        if len(output) > self._consumed:
            # Only allowed tokens are taken, so this cannot fail; if it did, the matcher's error
            # state ends the sequence below (end of sequence is then its only token).
            self._matcher.consume_tokens(output[self._consumed:])
            self._consumed = len(output)

    def allowed_mask(self, output: list[int]) -> np.ndarray:
        """The tokens the next step may take after `output`, as a bool per token of the vocabulary:
        end of sequence where it is a sentence."""
        self._catch_up(output)
        vocabulary = self.guide.vocabulary
        if self._matcher.is_error() or self._matcher.is_stopped():
            return vocabulary.eos_mask
        # One bit per token, end of sequence ids included where the output is a sentence.
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        words = self._words if sys.byteorder == "little" else self._words.byteswap()
        return np.unpackbits(words.view(np.uint8), count=vocabulary.size, bitorder="little").view(bool)

    def allowed_tokens(self, output: list[int]) -> np.ndarray:
        """`allowed_mask` as sorted ids."""
        return np.flatnonzero(self.allowed_mask(output))

    def is_complete(self, output: list[int]) -> bool:
        """Whether `output` is a sentence that no token can extend: nothing more may follow."""
        self._catch_up(output)
        return self._matcher.is_stopped() and not self._matcher.is_error()
