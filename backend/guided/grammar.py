"""Output constrained by a context-free grammar (vLLM's `guided_decoding` `grammar`), through llguidance.

A grammar may be written as GBNF (llama.cpp's `root ::= ...`, what vLLM's default xgrammar backend
takes) or as Lark (`start: ...`, what its guidance backend takes); llguidance reads either. Unlike a
regular expression, a grammar can nest without limit (brackets, expressions, recursive data), which
is why it is not one more pattern for regex_automaton.py: llguidance's Earley parser keeps the
parse, and its token trie lists the tokens that keep the output a prefix of some sentence of the
grammar, byte-level tokens included. Where the grammar leaves only one way on (the rest of a
literal, say), llguidance allows just the tokens the tokenizer itself would write that text with,
not every token that spells a piece of it: the model reads the text as it was trained to.

A JSON schema that nests through a recursive `$ref` (a tree, say), which no regular expression can
follow, takes this guide too, through llguidance's JSON schema compiler.

A grammar is compiled once per text (when the request is checked) and shared by every request and
completion that sends it; each sequence keeps its own matcher (`GrammarCursor`), which consumes only
the tokens added since the last step.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from tritonllm.engine.errors import InvalidRequestError


def llguidance_module():
    try:
        import llguidance
    except ImportError:  # a dependency of the package; say so rather than fail obscurely mid-request
        raise InvalidRequestError("this guided_decoding needs the llguidance package, which this server "
                                  "lacks (pip install llguidance)") from None
    return llguidance


@lru_cache(maxsize=64)
def compile_grammar(text: str) -> str:
    """llguidance's grammar for `text` (GBNF or Lark), or InvalidRequestError saying what is wrong with it."""
    llguidance = llguidance_module()
    try:
        grammar = llguidance.grammar_from("grammar", text)
    except (ValueError, RuntimeError) as exc:  # GBNF that does not convert
        raise InvalidRequestError(f"guided_decoding grammar: {one_paragraph(exc)}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"guided_decoding grammar: {one_paragraph(error)}")
    return grammar


@lru_cache(maxsize=64)
def compile_json_schema_grammar(schema_text: str, whitespace_pattern: str | None = None) -> str:
    """llguidance's grammar for JSON that a schema (JSON text) accepts: for the schemas a regular
    expression cannot express (recursive ones), which it writes with one space after `:` and `,`, or
    with `whitespace_pattern` between its tokens when given."""
    llguidance = llguidance_module()
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, overrides=json_compile_options(whitespace_pattern))
    except ValueError as exc:
        raise InvalidRequestError(f"guided json: {one_paragraph(exc)}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"guided json: {one_paragraph(error)}")
    return grammar


def json_compile_options(whitespace_pattern: str | None) -> dict:
    """llguidance's JSON options for how our JSON guides write JSON: one space after `:` and `,`, or
    `whitespace_pattern` between tokens when the request gives one."""
    if whitespace_pattern is None:
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {"whitespace_pattern": whitespace_pattern, "item_separator": ",", "key_separator": ":"}


def one_paragraph(message) -> str:
    return " ".join(str(message).split())


class GrammarVocabulary:
    """The engine's tokenizer as llguidance sees it (built once, ~0.3 s for a 49k vocabulary)."""

    def __init__(self, tokenizer, eos_token_ids: set[int]):
        llguidance = llguidance_module()
        import llguidance.hf

        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=sorted(eos_token_ids))
        except ValueError as exc:  # a slow (Python) tokenizer
            raise InvalidRequestError(f"guided_decoding grammar: {exc}") from None
        self.size = self.tokenizer.vocab_size
        self.eos_mask = np.zeros(self.size, dtype=bool)
        self.eos_mask[sorted(eos_token_ids)] = True
        self.eos_mask.flags.writeable = False  # shared by every stopped sequence


class GuidedGrammar:
    """The guide interface of guided_choice.GuidedChoice, for a grammar (one per grammar text)."""

    def __init__(self, grammar: str, vocabulary: GrammarVocabulary):
        self.grammar = grammar
        self.vocabulary = vocabulary

    def start(self) -> "GrammarCursor":
        return GrammarCursor(self)


class GrammarCursor:
    """One sequence's parse: llguidance's matcher after the output tokens consumed so far."""

    def __init__(self, guide: GuidedGrammar):
        import llguidance

        self.guide = guide
        self._matcher = llguidance.LLMatcher(guide.vocabulary.tokenizer, guide.grammar, log_level=0)
        self._consumed = 0

    def start(self) -> "GrammarCursor":
        """A fresh parse of the same grammar (another completion of the same request)."""
        return self.guide.start()

    def _catch_up(self, output: list[int]) -> None:
        if len(output) < self._consumed:  # defensively: an output never shrinks, but then parse it again
            self._matcher.reset()
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
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, count=vocabulary.size, bitorder="little").view(bool)

    def allowed_tokens(self, output: list[int]) -> np.ndarray:
        """`allowed_mask` as sorted ids."""
        return np.flatnonzero(self.allowed_mask(output))

    def is_complete(self, output: list[int]) -> bool:
        """Whether `output` is a sentence that no token can extend: nothing more may follow."""
        self._catch_up(output)
        return self._matcher.is_stopped() and not self._matcher.is_error()
