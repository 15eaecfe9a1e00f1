"""A guide that waits for a reasoning model's thinking: the `thinking` modifier of guided_decoding.

A reasoning model (DeepSeek-R1, Qwen3, QwQ) thinks between `<think>` and `</think>`, then answers. A guide
that holds from the first token would make it write the answer inside its thinking (where the prompt
opened the block: no answer at all) or skip thinking. With `thinking` the guide holds from the end of
the block on, as vLLM's structured outputs do under a reasoning parser:
- `"open"`: the output starts inside the block (the prompt opened it); any text up to the first
  `</think>`, then the guide;
- `"allowed"`: the output may start with the model's own `<think>` token, then as `"open"`; or it is
  the guide's from its first token (a model that answers without thinking).
An output that ends while thinking is a whole one (the model may stop there, as it may without a guide).

Only the `<think>` token opens a block, never the text spelled in pieces: the guide rules out most
first tokens, and a model that does not think would be pushed into `<`, `think`, `>` by the mask and
then end inside the block, with no answer. Reasoning models have the token (Qwen3, QwQ, DeepSeek-R1);
where the tokenizer has none, `"allowed"` is the guide alone.

The block ends at the model's `</think>` token where it has one (llguidance reads a tokenizer's added
tokens as tokens, never as text), else at the first `</think>` in the text: a lazy lexeme, so the
guide's answer can never be read as more thinking.
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
# As a token: text cannot contain it, so the block's text is any text.
_TOKEN_RULES = r"""
block: THINKING <[{end}]>
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


def after_thinking(grammar: str, mode: str, tokens: tuple[int | None, int | None] = (None, None)) -> str:
    """llguidance's `grammar` held back until the thinking block ends. `mode`: "open" or "allowed"
    (checked with the request's form). `tokens`: the tokenizer's `<think>` and `</think>` tokens
    (`think_tokens`; None where it has none: then "allowed" opens no block, and the text ends one)."""
    start_token, end_token = tokens
    if mode == "allowed" and start_token is None:
        return grammar
    top = _top_level(grammar)
    answer = dict(top["grammars"][0])
    # The answer is referred to by name; the rest keep theirs (they refer to each other by name).
    answer["name"] = answer.get("name") or "answer"
    ref = "@" + answer["name"]
    open_text = f"(OPEN_BLOCK | block {ref})"
    start = f"start: {open_text}" if mode == "open" else f"start: {ref} | <[{start_token}]> {open_text}"
    rules = _TEXT_RULES if end_token is None else _TOKEN_RULES.replace("{end}", str(end_token))
    wrapper = {"name": "thinking", "lark_grammar": "%llguidance {}\n" + start + "\n" + rules}
    return json.dumps({**top, "grammars": [wrapper, answer, *top["grammars"][1:]]})


def think_tokens(tokenizer) -> tuple[int | None, int | None]:
    """The tokenizer's `<think>` and `</think>` tokens: the id it writes each with, where that is one
    token of its own added tokens (a reasoning model's); else None."""
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))

    def one(text: str) -> int | None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and ids[0] in added else None

    return one(START), one(END)
