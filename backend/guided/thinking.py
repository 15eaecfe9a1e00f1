"""A guide that waits for a reasoning model's thinking: the `thinking` modifier of guided_decoding.

A reasoning model (DeepSeek-R1, Qwen3, QwQ) thinks between `<think>` and `</think>`, then answers. A guide
that holds from the first token would make it write the answer inside its thinking (where the prompt
opened the block: no answer at all) or skip thinking. With `thinking` the guide holds from the end of
the block on, as vLLM's structured outputs do under a reasoning parser:
- `"open"`: the output starts inside the block (the prompt opened it); any text up to the first
  `</think>`, then the guide;
- `"allowed"`: the output may start with `<think>`, then as `"open"`; or it is the guide's from its
  first token (a model that answers without thinking).
An output that ends while thinking is a whole one (the model may stop there, as it may without a guide).

The block's text is a lazy lexeme: it ends at the first `</think>`, so the guide's answer can never be
read as more thinking. Where the tokenizer has `<think>`/`</think>` as special tokens they are matched
as those tokens (text cannot spell them).
"""

from __future__ import annotations

import json

START, END = "<think>", "</think>"

# As text: the lazy `block` ends at the first `</think>`; `OPEN_BLOCK` (an output that stopped while
# thinking) is text without one.
_TEXT_RULES = r"""
block[lazy]: /(.|\n)*<\/think>/
OPEN_BLOCK: /(.|\n)*/ & ~/(.|\n)*<\/think>(.|\n)*/
"""
# As special tokens: text cannot contain them, so the block's text is any text.
_SPECIAL_RULES = r"""
block: THINKING </think>
OPEN_BLOCK: /(.|\n)*/
THINKING: /(.|\n)*/
"""


def _top_level(grammar: str) -> dict:
    """llguidance takes a grammar as a top-level grammar's JSON or as Lark text: the former, either way."""
    if grammar.lstrip().startswith("{"):
        top = json.loads(grammar)
        if isinstance(top, dict) and "grammars" in top:
            return top
    return {"grammars": [{"name": "answer", "lark_grammar": grammar}]}


def after_thinking(grammar: str, mode: str, special_tokens: frozenset[str] = frozenset()) -> str:
    """llguidance's `grammar` (a top-level grammar's JSON) held back until the thinking block ends.
    `mode`: "open" or "allowed" (checked with the request's form). `special_tokens`: the special tokens'
    texts of the tokenizer the guide is for."""
    top = _top_level(grammar)
    answer = dict(top["grammars"][0])
    # The answer is referred to by name; the rest keep theirs (they refer to each other by name).
    answer["name"] = answer.get("name") or "answer"
    ref = "@" + answer["name"]
    special = END in special_tokens
    open_text = f"(OPEN_BLOCK | block {ref})"
    if mode == "open":
        start = f"start: {open_text}"
    else:
        opening = START if START in special_tokens else json.dumps(START)  # <think> unquoted: the token
        start = f"start: {ref} | {opening} {open_text}"
    lark = "%llguidance {}\n" + start + "\n" + (_SPECIAL_RULES if special else _TEXT_RULES)
    wrapper = {"name": "thinking", "lark_grammar": lark}
    return json.dumps({**top, "grammars": [wrapper, answer, *top["grammars"][1:]]})
