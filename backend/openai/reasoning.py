"""A reasoning model's thinking, apart from its answer (vLLM's `--reasoning-parser`).

DeepSeek-R1, QwQ and Qwen3 think between `<think>` and `</think>`, then answer. Their chat templates
differ in where the block opens: in the prompt (R1's, Qwen3.5's: the output starts inside it and only
`</think>` comes out) or in the output (Qwen3's first releases). So one reader serves every such model:
what the template writes after the conversation says whether the answer starts inside the block
(`answer_starts_thinking`), and a `<think>` at the very start of the output opens it too. Text up to
`</think>` is reasoning, the rest is the answer; an answer that never closes the block is all
reasoning (it was cut while thinking).
vLLM's parser names, `deepseek_r1` and `qwen3`, both select this reader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def prompt_opens_thinking(text: str) -> bool:
    """Whether this text (what a template writes after the conversation) leaves a thinking block open."""
    return text.rfind(START) > text.rfind(END)


def answer_starts_thinking(tokenizer, messages: list[dict], template_kwargs: dict) -> bool:
    """Whether the answer to these messages starts inside a thinking block: the text the chat template
    writes after the conversation (its generation prompt) opens one, or the assistant message being
    continued does. Only that text: a `<think>` a user wrote is no block the model is in."""
    if template_kwargs.get("continue_final_message"):
        return prompt_opens_thinking(str(messages[-1].get("content") or ""))
    if not template_kwargs.get("add_generation_prompt", True):
        return False
    kwargs = {**template_kwargs, "tokenize": False}
    with_prompt = tokenizer.apply_chat_template(messages, **kwargs)
    without = tokenizer.apply_chat_template(messages, **{**kwargs, "add_generation_prompt": False})
    # A template whose generation prompt is not simply appended gives no answer: the output's own
    # `<think>` still opens a block.
    return with_prompt.startswith(without) and prompt_opens_thinking(with_prompt[len(without):])


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (held back until known)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """One choice's text, fed piece by piece -> (reasoning, answer) of each piece, in order."""

    thinking: bool = False  # inside the block now
    closed: bool = False  # the block has ended
    reasoning: list[str] = field(default_factory=list)
    _buffer: str = ""
    _opening: bool = True  # nothing but whitespace has come yet

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning, answer = [], []
        while self._buffer:
            if self._opening:  # a `<think>` first opens the block (or is dropped, where the prompt opened it)
                head = self._buffer.lstrip()
                if head.startswith(START):
                    self.thinking, self._buffer = True, head[len(START):]
                elif START.startswith(head):  # whitespace, or the marker begun: wait for more
                    break
                self._opening = False
                continue
            if not self.thinking:
                answer.append(self._buffer)
                self._buffer = ""
                break
            end = self._buffer.find(END)
            if end >= 0:
                reasoning.append(self._buffer[:end])
                self.thinking, self.closed, self._buffer = False, True, self._buffer[end + len(END):]
                continue
            keep = _held(self._buffer, END)
            reasoning.append(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return self._take(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """The end of the text: what was held back is decided."""
        rest, self._buffer = self._buffer, ""
        if self.thinking:
            return self._take([rest]), ""
        return "", rest.lstrip() if self._opening else rest

    def _take(self, pieces: list[str]) -> str:
        text = "".join(pieces)
        if text:
            self.reasoning.append(text)
        return text


@dataclass
class ThinkingTokens:
    """One choice's thinking in tokens: those up to and including the one whose text completes `</think>`,
    or all of them while the block is open. Counted on the output's token ids, not on its text, since the
    text can lag the tokens (held back while a stop string may be forming) and a response can carry the
    block's end and the answer's start in one piece, or the end-of-sequence token after it."""

    decode: Callable[[list[int]], str]  # token ids -> their text, special tokens kept
    ids: list[int] = field(default_factory=list)
    end: int | None = None  # once found: the tokens up to and including the one that completes END
    _searched: int = 0  # ids[:_searched] hold no END

    def count(self, opened: bool) -> int:
        """The thinking tokens so far; `opened`: whether the output is in (or was in) a thinking block."""
        if not opened:
            return 0
        if self.end is None and self._searched < len(self.ids):
            self._search()
        return self.end if self.end is not None else len(self.ids)

    def _search(self) -> None:
        # An END not in ids[:_searched] starts at one of the last len(END) - 1 of them at the earliest (each
        # token spells at least one of its characters), so only the tail since then is decoded.
        first = max(0, self._searched - len(END) + 1)
        if END in self.decode(self.ids[first:]):
            low, high = self._searched + 1, len(self.ids)  # the shortest prefix holding END
            while low < high:
                middle = (low + high) // 2
                if END in self.decode(self.ids[first:middle]):
                    high = middle
                else:
                    low = middle + 1
            self.end = low
        self._searched = len(self.ids)
