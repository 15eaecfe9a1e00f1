"""vLLM's `guided_decoding` parameter (also sent as `structured_outputs`): the guide a request asks for,
checked when the request arrives, and an engine's guides built from it.

Exactly one of:
- `{"choice": [strings]}`: the output is one of the strings (guided_choice.py);
- `{"regex": pattern}`: the output matches the pattern as a whole (guided_regex.py);
- `{"json": schema}` (an object or JSON text): the output is JSON that the schema accepts, through
  the schema's regular expression (json_schema_regex.py), or, for a schema that nests through a
  recursive `$ref`, through llguidance's JSON grammar (guided_grammar.py);
- `{"json_object": true}`: the output is a JSON object;
- `{"grammar": text}`: the output is a sentence of a context-free grammar, GBNF or Lark (guided_grammar.py);
- `{"structural_tag": {"structures": [...], "triggers": [...]}}` (or its JSON text): free text in which
  each trigger opens a segment of JSON for a schema (guided_structural_tag.py).

`whitespace_pattern` replaces the JSON guides' whitespace after `:` and `,` (one optional space by
default); `backend` and vLLM's other switches are accepted and change nothing here. A pattern, schema,
grammar or tag this server cannot follow is refused with a clear error when the request arrives.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import lru_cache

from tritonllm.engine.errors import InvalidRequestError, json_object
from tritonllm.guided.choice import GuidedChoice
from tritonllm.guided.grammar import GrammarVocabulary, GuidedGrammar, compile_grammar, compile_json_schema_grammar
from tritonllm.guided.regex import GuidedRegex, VocabularyTrie
from tritonllm.guided.structural_tag import parse_structural_tag, structural_tag_grammar, structural_tag_text
from tritonllm.guided.json_schema_regex import DEFAULT_WHITESPACE, RecursiveSchemaError, any_object_regex, json_schema_regex
from tritonllm.guided.regex_automaton import RegexAutomaton

GUIDE_KINDS = ("choice", "regex", "json", "json_object", "grammar", "structural_tag")
# Accepted for vLLM clients; none changes what a guide allows here.
_SWITCHES = ("backend", "whitespace_pattern", "disable_fallback", "disable_any_whitespace",
             "disable_additional_properties")


def parse_guided_decoding(guided) -> dict | None:
    """`guided` (a dict or its JSON text) checked: the dict to keep, or InvalidRequestError saying what is wrong."""
    if guided is None:
        return None
    guided = json_object(guided, "guided_decoding")  # JSON text too, as the vLLM backend also takes it
    given = {k: v for k, v in guided.items() if v is not None and v is not False}
    unsupported = sorted(set(given) - set(GUIDE_KINDS) - set(_SWITCHES))
    if unsupported:
        raise InvalidRequestError(f"guided_decoding {unsupported} is not supported by this server; "
                                  f"supported: {', '.join(GUIDE_KINDS)}")
    kinds = [k for k in GUIDE_KINDS if k in given]
    if len(kinds) != 1:
        raise InvalidRequestError(f"guided_decoding needs exactly one of {', '.join(GUIDE_KINDS)}; got {kinds or 'none'}")
    [kind] = kinds
    if kind == "choice":
        choice = given["choice"]
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice):
            raise InvalidRequestError(f"guided_decoding choice must be a non-empty list of non-empty strings, "
                                      f"got {choice!r}")
    elif kind in ("regex", "grammar") and (not isinstance(given[kind], str) or not given[kind].strip()):
        raise InvalidRequestError(f"guided_decoding {kind} must be a non-empty string, got {given[kind]!r}")
    elif kind == "json" and isinstance(given["json"], str):
        try:
            given["json"] = json.loads(given["json"])
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"guided_decoding json schema is not valid JSON: {exc}") from None
    elif kind == "structural_tag":
        given["structural_tag"] = parse_structural_tag(given["structural_tag"])
    if not isinstance(given.get("whitespace_pattern", ""), str):
        raise InvalidRequestError("guided_decoding whitespace_pattern must be a string (a regular expression)")
    # Refuse what cannot be followed now, rather than mid-batch.
    if kind != "choice":
        language, text = guide_language(given)
        if language == "regex":
            compiled_automaton(text)
    return given


def guide_language(guided: dict, special_tokens: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """What a guided_decoding other than a choice asks the output to be: ("regex", the regular
    expression it must match) or ("grammar", llguidance's grammar it must be a sentence of).
    `special_tokens`: the special tokens' texts of the tokenizer the guide is for (a structural tag's
    trigger among them is matched as that token). InvalidRequestError if the guide cannot be followed."""
    whitespace = guided.get("whitespace_pattern")
    if "regex" in guided:
        return "regex", guided["regex"]
    if "json" in guided:
        try:
            return "regex", json_schema_regex(guided["json"], whitespace or DEFAULT_WHITESPACE)
        except RecursiveSchemaError:
            return "grammar", compile_json_schema_grammar(json.dumps(guided["json"]), whitespace)
    if "json_object" in guided:
        return "regex", any_object_regex(whitespace or DEFAULT_WHITESPACE)
    if "grammar" in guided:
        return "grammar", compile_grammar(guided["grammar"])
    if "structural_tag" in guided:
        tag = guided["structural_tag"]
        special = frozenset(t for t in tag["triggers"] if t in special_tokens)
        return "grammar", structural_tag_grammar(structural_tag_text(tag), guided.get("whitespace_pattern"), special)
    return None


@lru_cache(maxsize=64)
def compiled_automaton(pattern: str) -> RegexAutomaton:
    """One automaton per pattern, shared by every request (and engine) that asks for it: its states grow as used."""
    return RegexAutomaton(pattern)


class Guides:
    """An engine's guides: the vocabulary as a trie (built at the first pattern guide) and one guide per
    pattern, the `capacity` most recently used kept with the token sets their states allow; for
    grammars, the vocabulary as llguidance's (built at the first grammar) and one guide per grammar."""

    def __init__(self, tokenizer, eos_token_ids: set[int], capacity: int = 64):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.capacity = capacity
        self._vocabulary: VocabularyTrie | None = None
        self._grammar_vocabulary: GrammarVocabulary | None = None
        self._by_pattern: OrderedDict[str, GuidedRegex] = OrderedDict()
        self._by_grammar: OrderedDict[str, GuidedGrammar] = OrderedDict()
        self._lock = threading.Lock()  # requests arrive on Triton's threads
        self.special_tokens = frozenset(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                                        if t.special)

    def for_request(self, guided: dict | None) -> GuidedChoice | GuidedRegex | GuidedGrammar | None:
        if not guided:
            return None
        if "choice" in guided:
            return GuidedChoice([tuple(self.tokenizer.encode(c, add_special_tokens=False)) for c in guided["choice"]],
                                self.eos_token_ids)
        kind, pattern = guide_language(guided, self.special_tokens)
        if kind == "grammar":
            return self._grammar_guide(pattern)
        with self._lock:
            guide = self._by_pattern.get(pattern)
            if guide is None:
                if self._vocabulary is None:
                    self._vocabulary = VocabularyTrie.from_tokenizer(self.tokenizer)
                guide = self._by_pattern[pattern] = GuidedRegex(compiled_automaton(pattern), self._vocabulary,
                                                                self.eos_token_ids)
                while len(self._by_pattern) > self.capacity:
                    self._by_pattern.popitem(last=False)
            self._by_pattern.move_to_end(pattern)
        return guide

    def _grammar_guide(self, grammar: str) -> GuidedGrammar:
        with self._lock:
            guide = self._by_grammar.get(grammar)
            if guide is None:
                if self._grammar_vocabulary is None:
                    self._grammar_vocabulary = GrammarVocabulary(self.tokenizer, self.eos_token_ids)
                guide = self._by_grammar[grammar] = GuidedGrammar(grammar, self._grammar_vocabulary)
                while len(self._by_grammar) > self.capacity:
                    self._by_grammar.popitem(last=False)
            self._by_grammar.move_to_end(grammar)
        return guide
