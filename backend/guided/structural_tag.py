"""vLLM's `guided_decoding` `structural_tag`: free text, in which each trigger opens a tagged segment
whose body is JSON that a schema accepts (a tool call inside an answer, say).

The request gives `{"structures": [{"begin": ..., "schema": {...}, "end": ...}, ...], "triggers": [...]}`,
as a JSON object or its text (what vLLM's clients send). Until a trigger appears the output is the
model's own; once one does, the rest of the structure's `begin` is forced, then JSON for its schema,
then its `end`, and the text is free again until the next trigger. A structure belongs to the first
trigger its `begin` starts with, as in vLLM.

llguidance builds the grammar (`StructTag`: a trigger is a lazy lexeme, which ends the free text at
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

from tritonllm.engine.errors import InvalidRequestError, json_object
from tritonllm.guided.grammar import closed_objects, json_compile_options, llguidance_module, one_paragraph


def parse_structural_tag(value) -> dict:
    """The request's structural tag (a dict or its JSON text) checked: `{"structures": [...], "triggers":
    [...]}` with each structure's schema a dict, or InvalidRequestError saying what is wrong."""
    value = json_object(value, "guided_decoding structural_tag")
    if "format" in value:  # xgrammar's newer nested form
        raise InvalidRequestError('guided_decoding structural_tag takes the {"structures": [...], "triggers": [...]} '
                                  'form; the "format" form is not supported by this server')
    unknown = sorted(set(value) - {"type", "structures", "triggers"})
    if unknown:
        raise InvalidRequestError(f"guided_decoding structural_tag has unknown keys {unknown}")
    triggers, structures = value.get("triggers"), value.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidRequestError(f"guided_decoding structural_tag triggers must be a non-empty list of "
                                  f"non-empty strings, got {triggers!r}")
    if not isinstance(structures, list) or not structures:
        raise InvalidRequestError(f"guided_decoding structural_tag structures must be a non-empty list, got {structures!r}")
    checked = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"} or not {"begin", "schema", "end"} <= set(s):
            raise InvalidRequestError(f"guided_decoding structural_tag structures[{i}] must have exactly "
                                      f'"begin", "schema" and "end", got {s!r}')
        begin, schema, end = s["begin"], s["schema"], s["end"]
        if not isinstance(begin, str) or not isinstance(end, str):
            raise InvalidRequestError(f"guided_decoding structural_tag structures[{i}] begin and end must be strings")
        schema = json_object(schema, f"guided_decoding structural_tag structures[{i}] schema")
        if not any(begin.startswith(t) for t in triggers):
            raise InvalidRequestError(f"guided_decoding structural_tag structures[{i}] begin {begin!r} starts "
                                      f"with none of the triggers {triggers}")
        checked.append({"begin": begin, "schema": schema, "end": end})
    return {"structures": checked, "triggers": list(triggers)}


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
