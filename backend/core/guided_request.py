"""vLLM's `guided_decoding` parameter (also sent as `structured_outputs`) as a request carries it: plain
data, its form checked when the request arrives.

Which guides there are and what each allows: guided/decoding.py. This module checks only the form
(one kind, the right types, JSON text parsed), which needs no tokenizer and no llguidance. Whether a
pattern, schema, grammar or tag can be followed is checked by `guided.decoding.check_guided_decoding`
(the engine does it for every request it takes, before it is queued).
"""

from __future__ import annotations

import json

from tritonllm.core.errors import InvalidRequestError, json_object

GUIDE_KINDS = ("choice", "regex", "json", "json_object", "grammar", "structural_tag")
# Accepted for vLLM clients; none changes what a guide allows here.
SWITCHES = ("backend", "whitespace_pattern", "disable_fallback", "disable_any_whitespace",
            "disable_additional_properties")
# Ours: the guide holds after a reasoning model's thinking block (guided/thinking.py).
THINKING_MODES = ("open", "allowed")


def parse_guided_request(guided) -> dict | None:
    """`guided` (a dict or its JSON text) with its form checked: the dict to keep, or InvalidRequestError
    saying what is wrong. Whether the guide can be followed is not checked here."""
    if guided is None:
        return None
    guided = json_object(guided, "guided_decoding")  # JSON text too, as the vLLM backend also takes it
    given = {k: v for k, v in guided.items() if v is not None and v is not False}
    unsupported = sorted(set(given) - set(GUIDE_KINDS) - set(SWITCHES) - {"thinking"})
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
    elif kind == "json":
        if isinstance(given["json"], str):
            try:
                given["json"] = json.loads(given["json"])
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"guided_decoding json schema is not valid JSON: {exc}") from None
        if given["json"] is not True and not isinstance(given["json"], dict):
            raise InvalidRequestError(f"guided_decoding json schema must be a JSON object or true, got {given['json']!r}")
    elif kind == "structural_tag":
        given["structural_tag"] = parse_structural_tag(given["structural_tag"])
    if given.get("thinking", "open") not in THINKING_MODES:
        raise InvalidRequestError(f"guided_decoding thinking must be one of {', '.join(THINKING_MODES)}, "
                                  f"got {given['thinking']!r}")
    if not isinstance(given.get("whitespace_pattern", ""), str):
        raise InvalidRequestError("guided_decoding whitespace_pattern must be a string (a regular expression)")
    return given


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
