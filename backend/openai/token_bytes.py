"""Each token's own bytes, as OpenAI's chat log-probs give them (`bytes`).

A character that spans tokens (an emoji is often three) has part of its UTF-8 bytes in each token, and
`bytes` is there so that a client can put them back together. A token's text alone cannot say: its
piece of a character decodes to nothing, or to U+FFFD. The tokenizer's vocabulary can, for byte-level
BPE tokenizers (GPT-2's scheme, which SmolLM2, Llama 3 and Qwen use): each character of a token stands
for one byte.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.convert_slow_tokenizer import bytes_to_unicode


def token_bytes_of(tokenizer) -> Callable[[int], bytes | None] | None:
    """token id -> its bytes (None for a token outside the byte alphabet), or None where the tokenizer is
    not byte-level (its tokens' texts are then taken as they are)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return None
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def token_bytes(token_id: int) -> bytes | None:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or any(char not in byte_of for char in piece):
            return None  # an added token written in other characters: its text is its bytes
        return bytes(byte_of[char] for char in piece)

    return token_bytes
