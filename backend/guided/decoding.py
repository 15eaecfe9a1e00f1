"""vLLM's `guided_decoding` parameter (also sent as `structured_outputs`): the guide a request asks for,
checked when the request arrives, and an engine's guides built from it.

Exactly one of:
- `{"choice": [strings]}`: the output is one of the strings, each written as the tokenizer writes it alone;
- `{"regex": pattern}`: the output matches the pattern (Python `re` syntax) as a whole;
- `{"json": schema}` (an object, `true`, or JSON text): the output is JSON that the schema accepts, an
  object with `properties` having only those unless the schema allows others;
- `{"json_object": true}`: the output is a JSON object;
- `{"grammar": text}`: the output is a sentence of a context-free grammar, GBNF or Lark;
- `{"structural_tag": {"structures": [...], "triggers": [...]}}` (or its JSON text): free text in which
  each trigger opens a segment of JSON for a schema (structural_tag.py).

With `thinking` (`"open"` or `"allowed"`, ours) any of them holds only after a reasoning model's
`<think>...</think>` block (thinking.py); the OpenAI API sets it under `--reasoning-parser`.

Every kind is followed by llguidance (grammar.py says what each compiles to). `whitespace_pattern`
(a regular expression) replaces the JSON guides' whitespace: without it JSON is written compactly,
with one space after `:` and `,`. `backend` and vLLM's other switches are accepted and change nothing
here. A pattern, schema, grammar or tag this server cannot follow is refused with a clear error when
the request arrives: its form when its SamplingParams are made (core/guided_request.py), the rest by
`check_guided_decoding` here, which the engine runs on each request before it is queued.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from tritonllm.core.errors import InvalidRequestError
from tritonllm.core.guided_request import GUIDE_KINDS, parse_guided_request
from tritonllm.guided.grammar import (GrammarVocabulary, GuidedGrammar, choice_grammar, closed_objects, compile_grammar,
                                      compile_json_schema_grammar, compile_regex, json_compile_options)
from tritonllm.guided.structural_tag import structural_tag_grammar, structural_tag_text
from tritonllm.guided.thinking import after_thinking, think_tokens


def parse_guided_decoding(guided) -> dict | None:
    """`guided` (a dict or its JSON text) checked: the dict to keep, or InvalidRequestError saying what is
    wrong. Its form is checked by `parse_guided_request` (core/guided_request.py, when SamplingParams are
    made); what cannot be followed is refused here, when the request arrives, rather than mid-batch."""
    given = parse_guided_request(guided)
    if given is not None:
        check_guided_decoding(given)
    return given


def check_guided_decoding(given: dict) -> None:
    """InvalidRequestError if the guided_decoding `given` (its form already checked) cannot be followed
    (a choice always can)."""
    if "whitespace_pattern" in given:
        json_compile_options(given["whitespace_pattern"])
    if "choice" not in given:
        guide_grammar(given)


def guide_grammar(guided: dict, special_tokens: frozenset[str] = frozenset(),
                  think: tuple[int | None, int | None] = (None, None)) -> str:
    """llguidance's grammar for a checked guided_decoding other than a choice (which needs the
    tokenizer: `Guides`). `special_tokens`: the special tokens' texts of the tokenizer the guide is
    for (a structural tag's trigger among them is matched as that token); `think`: its `<think>` and
    `</think>` tokens (thinking.py). InvalidRequestError if the guide cannot be followed."""
    return _after_thinking_if_asked(guided, _answer_grammar(guided, special_tokens), think)


def _after_thinking_if_asked(guided: dict, grammar: str, think: tuple[int | None, int | None]) -> str:
    return after_thinking(grammar, guided["thinking"], think) if "thinking" in guided else grammar


def _answer_grammar(guided: dict, special_tokens: frozenset[str]) -> str:
    whitespace = guided.get("whitespace_pattern")
    if "regex" in guided:
        return compile_regex(guided["regex"])
    if "json" in guided:
        schema = {} if guided["json"] is True else closed_objects(guided["json"])  # `true`: any value, as {}
        return compile_json_schema_grammar(json.dumps(schema), whitespace)
    if "json_object" in guided:
        return compile_json_schema_grammar(json.dumps({"type": "object"}), whitespace)
    if "grammar" in guided:
        return compile_grammar(guided["grammar"])
    if "structural_tag" in guided:
        tag = guided["structural_tag"]
        special = frozenset(t for t in tag["triggers"] if t in special_tokens)
        return structural_tag_grammar(structural_tag_text(tag), whitespace, special)
    raise InvalidRequestError(f"guided_decoding needs exactly one of {', '.join(GUIDE_KINDS)}")


class Guides:
    """An engine's guides: its tokenizer as llguidance's (built at the first guided request) and one
    guide per grammar, the `capacity` most recently used kept."""

    def __init__(self, tokenizer, eos_token_ids: set[int], capacity: int = 64):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.capacity = capacity
        self._vocabulary: GrammarVocabulary | None = None
        self._by_grammar: OrderedDict[str, GuidedGrammar] = OrderedDict()
        self._lock = threading.Lock()  # requests arrive on Triton's threads
        self.special_tokens = frozenset(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                                        if t.special)
        self.think_tokens = think_tokens(tokenizer)  # a reasoning model's `<think>` and `</think>`

    def grammar_for(self, guided: dict) -> str:
        """llguidance's grammar for a checked guided_decoding, on this engine's tokenizer."""
        if "choice" not in guided:
            return guide_grammar(guided, self.special_tokens, self.think_tokens)
        grammar = choice_grammar(tuple(tuple(self.tokenizer.encode(c, add_special_tokens=False))
                                       for c in guided["choice"]))
        return _after_thinking_if_asked(guided, grammar, self.think_tokens)

    def for_request(self, guided: dict | None) -> GuidedGrammar | None:
        if not guided:
            return None
        grammar = self.grammar_for(guided)
        with self._lock:
            guide = self._by_grammar.get(grammar)
            if guide is None:
                if self._vocabulary is None:
                    self._vocabulary = GrammarVocabulary(self.tokenizer, self.eos_token_ids)
                guide = self._by_grammar[grammar] = GuidedGrammar(grammar, self._vocabulary)
                while len(self._by_grammar) > self.capacity:
                    self._by_grammar.popitem(last=False)
            self._by_grammar.move_to_end(grammar)
        return guide
