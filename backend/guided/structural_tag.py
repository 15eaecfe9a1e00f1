"""vLLM's `guided_decoding` `structural_tag`: free text, in which each trigger opens a tagged segment
whose body is JSON that a schema accepts (a tool call inside an answer, say).

The request gives `{"structures": [{"begin": ..., "schema": {...}, "end": ...}, ...], "triggers": [...]}`,
as a JSON object or its text (what vLLM's clients send). Until a trigger appears the output is the
model's own; once one does, the rest of the structure's `begin` is forced, then JSON for its schema,
then its `end`, and the text is free again until the next trigger. A structure belongs to the first
trigger its `begin` starts with, as in vLLM.

The request's form is checked by `parse_structural_tag` (core/guided_request.py), which needs
neither llguidance nor a tokenizer. llguidance builds the grammar (`StructTag`: a trigger is a lazy lexeme, which ends the free text at
its first occurrence) and grammar.py follows it. A trigger written like `<|python_tag|>` that
is one of the model's special tokens must be matched as that token, not as text; the tokenizer says
which, so the request is checked on arrival with every trigger as text and compiled again for the
engine's tokenizer (`structural_tag_grammar(..., special_triggers)`).

The JSON is written as the `json` guide writes it: one space after `:` and `,`, or
`whitespace_pattern` between tokens when the request gives one.
"""

from __future__ import annotations

import json
from functools import lru_cache

from tritonllm.core.errors import InvalidRequestError
from tritonllm.guided.grammar import closed_objects, json_compile_options, llguidance_module, one_paragraph


def structural_tag_text(tag: dict) -> str:
    """One text per structural tag (the cache key of its grammar)."""
    return json.dumps(tag, sort_keys=True)


@lru_cache(maxsize=64)
def structural_tag_grammar(tag_text: str, whitespace_pattern: str | None = None,
                           special_triggers: frozenset[str] = frozenset()) -> str:
    """llguidance's grammar for a checked structural tag (`structural_tag_text`). `special_triggers`:
    the triggers that are special tokens of the tokenizer the grammar will run with (matched as those
    tokens; every other trigger is text). InvalidRequestError if it cannot be followed."""
    llguidance = llguidance_module()
    tag = json.loads(tag_text)
    looks_special = {t for t in tag["triggers"] if t.startswith("<") and t.endswith(">")}
    if special_triggers and looks_special - special_triggers:
        # llguidance reads every <...> trigger one way or the other, not some of each.
        raise InvalidRequestError(f"guided_decoding structural_tag triggers {sorted(special_triggers)} are special "
                                  f"tokens of this model and {sorted(looks_special - special_triggers)} are not; "
                                  f"a request's <...> triggers must all be one or the other")
    tags = []
    for s in tag["structures"]:
        trigger = next(t for t in tag["triggers"] if s["begin"].startswith(t))
        schema = closed_objects(s["schema"])
        schema.setdefault("x-guidance", json_compile_options(whitespace_pattern))
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    grammar = llguidance.grammar_from("lark", llguidance.StructTag.to_grammar(tags, assume_special=bool(special_triggers)))
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"guided_decoding structural_tag: {one_paragraph(error)}")
    return grammar
