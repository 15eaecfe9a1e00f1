"""Incremental detokenization: each new token's text, never a broken multi-byte character.

Decoding a short window of recent tokens (starting a few tokens back, so word-boundary spaces
come out right) and diffing against the previous window keeps the cost per token constant.
A text ending in U+FFFD is an incomplete UTF-8 sequence: it is held back until completed.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5
# The transformers modules whose `decode` (base) and `_decode` (fast tokenizers: 5.x, 4.x) add nothing to
# the Rust tokenizer's own decode when asked for no clean-up.
_PLAIN_DECODE = {"transformers.tokenization_utils_base"}
_PLAIN_FAST_DECODE = {"transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"}


def _rust_decode(tokenizer):
    """The tokenizers library's decode behind a transformers fast tokenizer whose class keeps the library's
    decoding as is (called per token, transformers' wrapper costs more than the decode), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    mro = type(tokenizer).__mro__
    decode = next((c for c in mro if "decode" in c.__dict__), None)
    fast_decode = next((c for c in mro if "_decode" in c.__dict__), None)
    if decode is None or fast_decode is None:
        return None
    if decode.__module__ not in _PLAIN_DECODE or fast_decode.__module__ not in _PLAIN_FAST_DECODE:
        return None
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._rust_decode = _rust_decode(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._rust_decode is not None:  # a fast tokenizer ignores spaces_between_special_tokens
            return self._rust_decode(ids, skip_special_tokens=self.skip_special_tokens)
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
