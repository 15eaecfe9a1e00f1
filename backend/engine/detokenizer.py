"""Incremental detokenization: each new token's text, never a broken multi-byte character.

Decoding a short window of recent tokens (starting a few tokens back, so word-boundary spaces
come out right) and diffing against the previous window keeps the cost per token constant.
A text ending in U+FFFD is an incomplete UTF-8 sequence: it is held back until completed.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            # Keep the window short: the ids before prefix_offset are never decoded again.
            if self.prefix_offset > 64:
                del self.ids[:self.prefix_offset]
                self.read_offset -= self.prefix_offset
                self.prefix_offset = 0
            return delta
        return ""
