"""Output constrained to match a regular expression (vLLM's `guided_decoding` `regex`, `json`, `json_object`).

At every step a sequence may take the tokens whose text keeps its output a prefix of some match,
and end of sequence once the output matches. The regular expression's automaton
(regex_automaton.py) is stepped over the vocabulary's texts arranged as a character trie
(`VocabularyTrie`): one walk per automaton state prunes every token that starts with a dead prefix
at once, and its result is kept, so a state costs one walk however many steps and requests reach
it. A request with a JSON schema is the same guide on the schema's expression
(json_schema_regex.py).

Tokens are matched by their own text. Tokens whose text is not whole characters (a byte-level
token holding part of a multi-byte character) and special tokens never match, so a character
the vocabulary has no whole token for cannot be written under a guide.
"""

from __future__ import annotations

import numpy as np

from .regex_automaton import DEAD, RegexAutomaton

_IDS = None  # the trie's key under which a node lists the tokens that end there


class VocabularyTrie:
    """The vocabulary's token texts as a character trie (nested dicts; `None` keys list token ids)."""

    def __init__(self, texts: list[str | None]):
        self.texts = texts
        self.root: dict = {}
        for token_id, text in enumerate(texts):
            if not text:
                continue
            node = self.root
            for ch in text:
                node = node.get(ch) or node.setdefault(ch, {})
            node.setdefault(_IDS, []).append(token_id)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "VocabularyTrie":
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids)
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        texts = [None if i in special or piece is None else tokenizer.convert_tokens_to_string([piece])
                 for i, piece in enumerate(pieces)]
        return cls([None if t is None or "\ufffd" in t else t for t in texts])

    def live_tokens(self, automaton: RegexAutomaton, state: int) -> np.ndarray:
        """Sorted ids of the tokens after which `state` is not dead."""
        found: list[int] = []
        moves, step = automaton.moves, automaton.step
        stack = [(self.root, state)]
        while stack:
            node, at = stack.pop()
            for ch, child in node.items():
                if ch is _IDS:
                    continue
                nxt = moves.get((at, ch))
                if nxt is None:
                    nxt = step(at, ch)
                if nxt != DEAD:
                    ids = child.get(_IDS)
                    if ids:
                        found.extend(ids)
                    if len(child) > (1 if ids else 0):
                        stack.append((child, nxt))
        return np.unique(np.asarray(found, dtype=np.int64))


class GuidedRegex:
    """The guide interface of guided_choice.GuidedChoice, for a regular expression."""

    def __init__(self, automaton: RegexAutomaton, vocabulary: VocabularyTrie, eos_token_ids: set[int]):
        self.automaton = automaton
        self.vocabulary = vocabulary
        self.eos = np.asarray(sorted(eos_token_ids), dtype=np.int64)
        self._live: dict[int, np.ndarray] = {}  # automaton state -> its live tokens

    def _state(self, output: list[int]) -> int:
        texts = self.vocabulary.texts
        return self.automaton.walk("".join(texts[t] for t in output if texts[t]))

    def _live_tokens(self, state: int) -> np.ndarray:
        live = self._live.get(state)
        if live is None:
            live = self._live[state] = self.vocabulary.live_tokens(self.automaton, state)
        return live

    def allowed_tokens(self, output: list[int]) -> np.ndarray:
        """The tokens the next step may take after `output`: end of sequence where it matches."""
        state = self._state(output)
        if state == DEAD:  # defensively (only allowed tokens were taken): end it
            return self.eos
        live = self._live_tokens(state)
        if self.automaton.is_accepting(state) or not len(live):
            return np.union1d(live, self.eos)
        return live

    def is_complete(self, output: list[int]) -> bool:
        """Whether `output` matches and no token can extend it: nothing more may follow."""
        state = self._state(output)
        return self.automaton.is_accepting(state) and not len(self._live_tokens(state))
