"""Output constrained to match a regular expression (vLLM's `guided_decoding` `regex`, `json`, `json_object`).

At every step a sequence may take the tokens whose text keeps its output a prefix of some match,
and end of sequence once the output matches. The regular expression's automaton
(regex_automaton.py) is stepped over the vocabulary's texts arranged as a character trie
(`VocabularyTrie`): one walk per automaton state, a level of the trie at a time, prunes every token
that starts with a dead prefix at once, and its result is kept, so a state costs one walk however
many steps and requests reach it. A request with a JSON schema is the same guide on the schema's
expression (json_schema_regex.py).

Tokens are matched by their own text. Tokens whose text is not whole characters (a byte-level
token holding part of a multi-byte character) and special tokens never match, so a character
the vocabulary has no whole token for cannot be written under a guide.
"""

from __future__ import annotations

import numpy as np

from tritonllm.guided.regex_automaton import DEAD, RegexAutomaton


class VocabularyTrie:
    """The vocabulary's token texts as a character trie, stored level by level as arrays so that one
    walk is a few numpy operations per character position rather than a Python loop per node.

    Level d holds the distinct d-character prefixes of the token texts: each node's parent (an index
    into level d - 1; level 0 is the root) and its last character (an index into `alphabet`), and
    the tokens whose whole text ends at which node.
    """

    def __init__(self, texts: list[str | None]):
        self.texts = texts
        self.alphabet = "".join(sorted({ch for t in texts if t for ch in t}))  # every character of a text
        index = {ch: i for i, ch in enumerate(self.alphabet)}
        self.levels: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        above: dict[str, int] = {"": 0}
        tokens = [(i, t) for i, t in enumerate(texts) if t]
        depth = 1
        while tokens:
            level: dict[str, int] = {}
            parents, chars, end_nodes, end_tokens, longer = [], [], [], [], []
            for token_id, text in tokens:
                prefix = text[:depth]
                node = level.get(prefix)
                if node is None:
                    node = level[prefix] = len(parents)
                    parents.append(above[prefix[:-1]])
                    chars.append(index[prefix[-1]])
                if len(text) == depth:
                    end_nodes.append(node)
                    end_tokens.append(token_id)
                else:
                    longer.append((token_id, text))
            self.levels.append((np.asarray(parents, dtype=np.int64), np.asarray(chars, dtype=np.int64),
                                np.asarray(end_nodes, dtype=np.int64), np.asarray(end_tokens, dtype=np.int64)))
            above, tokens, depth = level, longer, depth + 1

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "VocabularyTrie":
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids)
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        texts = [None if i in special or piece is None else tokenizer.convert_tokens_to_string([piece])
                 for i, piece in enumerate(pieces)]
        return cls([None if t is None or "\ufffd" in t else t for t in texts])

    def live_tokens(self, table_for, state: int) -> np.ndarray:
        """Sorted ids of the tokens whose text, read from `state`, does not reach the dead state.

        `table_for(states)` returns a transition table holding a row for each of `states`: row s is
        the state after each character of `alphabet` from state s.
        """
        states = np.asarray([state], dtype=np.int64)  # the root's
        found = []
        for parents, chars, end_nodes, end_tokens in self.levels:
            from_states = states[parents]
            alive = from_states != DEAD
            if not alive.any():
                break
            table = table_for(from_states[alive])
            states = np.where(alive, table[np.where(alive, from_states, 0), chars], DEAD)
            found.append(end_tokens[states[end_nodes] != DEAD])
        return np.sort(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


class GuidedRegex:
    """The guide interface of guided_choice.GuidedChoice, for a regular expression."""

    def __init__(self, automaton: RegexAutomaton, vocabulary: VocabularyTrie, eos_token_ids: set[int]):
        self.automaton = automaton
        self.vocabulary = vocabulary
        self.eos = np.asarray(sorted(eos_token_ids), dtype=np.int64)
        self._live: dict[int, np.ndarray] = {}  # automaton state -> its live tokens
        self._masks: dict[int, np.ndarray] = {}  # automaton state -> allowed_in(state) as packed bits
        # Row s: the automaton's state after each character of the vocabulary's alphabet from state s.
        self._table = np.zeros((0, len(vocabulary.alphabet)), dtype=np.int64)
        self._has_row = np.zeros(0, dtype=bool)

    def text_of(self, output: list[int]) -> str:
        """The text of output tokens as the automaton reads it (tokens without text add none)."""
        texts = self.vocabulary.texts
        return "".join(texts[t] for t in output if texts[t])

    def _table_for(self, states: np.ndarray) -> np.ndarray:
        top = int(states.max()) + 1
        if top > len(self._table):
            size = max(top, 2 * len(self._table))
            self._table = np.concatenate([self._table, np.zeros((size - len(self._table), self._table.shape[1]),
                                                                dtype=np.int64)])
            self._has_row = np.concatenate([self._has_row, np.zeros(size - len(self._has_row), dtype=bool)])
        missing = states[~self._has_row[states]]
        for state in np.unique(missing).tolist():
            self._table[state] = self.automaton.transitions(state, self.vocabulary.alphabet)
            self._has_row[state] = True
        return self._table

    def _live_tokens(self, state: int) -> np.ndarray:
        live = self._live.get(state)
        if live is None:
            live = self._live[state] = self.vocabulary.live_tokens(self._table_for, state)
        return live

    def start(self) -> "RegexCursor":
        """A sequence's own progress through this guide (the guide itself is shared by every request of its pattern)."""
        return RegexCursor(self)

    def allowed_tokens(self, output: list[int]) -> np.ndarray:
        """The tokens the next step may take after `output`: end of sequence where it matches."""
        return self.allowed_in(self.automaton.walk(self.text_of(output)))

    def allowed_after(self, text: str) -> np.ndarray:
        """The tokens that may follow an output whose text is `text` (sorted ids)."""
        return self.allowed_in(self.automaton.walk(text))

    def allowed_in(self, state: int) -> np.ndarray:
        """The tokens that may follow an output that left the automaton in `state` (sorted ids)."""
        if state == DEAD:  # defensively (only allowed tokens were taken): end it
            return self.eos
        live = self._live_tokens(state)
        if self.automaton.is_accepting(state) or not len(live):
            return np.union1d(live, self.eos)
        return live

    def allowed_mask_in(self, state: int) -> np.ndarray:
        """`allowed_in(state)` as a bool per token of the vocabulary. Inside a JSON string
        nearly every token is allowed: writing ~48k ids into a step's mask took ~120 us a row, these
        bits ~5 us."""
        packed = self._masks.get(state)
        if packed is None:
            mask = np.zeros(len(self.vocabulary.texts), dtype=bool)
            mask[self.allowed_in(state)] = True
            packed = self._masks[state] = np.packbits(mask, bitorder="little")
        return np.unpackbits(packed, count=len(self.vocabulary.texts), bitorder="little").view(bool)

    def is_complete(self, output: list[int]) -> bool:
        """Whether `output` matches and no token can extend it: nothing more may follow."""
        return self.complete_in(self.automaton.walk(self.text_of(output)))

    def complete_in(self, state: int) -> bool:
        return self.automaton.is_accepting(state) and not len(self._live_tokens(state))


class RegexCursor:
    """One sequence's place in a GuidedRegex: the automaton's state after the output tokens walked so far.

    Each step walks only the tokens added since the last call, so a step's cost does not grow with
    the output's length (walking the whole output again made it quadratic: ~1.3 ms a row at 1,024
    tokens). The guide interface of GuidedChoice, for the engine and the logit adjustments.
    """

    def __init__(self, guide: GuidedRegex):
        self.guide = guide
        self._walked = 0  # output tokens already walked
        self._state = guide.automaton.start

    def start(self) -> "RegexCursor":
        """A fresh cursor on the same guide (another completion of the same request)."""
        return self.guide.start()

    def _state_after(self, output: list[int]) -> int:
        if len(output) < self._walked:  # defensively: an output never shrinks, but then walk it again
            self._walked, self._state = 0, self.guide.automaton.start
        if len(output) > self._walked and self._state != DEAD:
            self._state = self.guide.automaton.walk(self.guide.text_of(output[self._walked:]), self._state)
        self._walked = len(output)
        return self._state

    def allowed_tokens(self, output: list[int]) -> np.ndarray:
        return self.guide.allowed_in(self._state_after(output))

    def allowed_mask(self, output: list[int]) -> np.ndarray:
        return self.guide.allowed_mask_in(self._state_after(output))

    def is_complete(self, output: list[int]) -> bool:
        return self.guide.complete_in(self._state_after(output))
