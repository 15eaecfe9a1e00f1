"""A regular expression as a character automaton, stepped one character at a time (for guided decoding).

Guided decoding asks, at every step, which tokens keep the output a prefix of some match. Python's
`re` answers only "does this whole string match", so the pattern is parsed with the standard
library's own parser (`re._parser`, the syntax `re` accepts) into a Thompson NFA over character
classes, whose DFA states (sets of NFA states) are built lazily as outputs reach them: one
(state, character) move at a time (`step`), or a state's whole row over an alphabet (`transitions`).
A state is *live* while some continuation can still match; the guide prunes on the dead state (-1)
and may end the output in an *accepting* state.

Matching is whole-string (`re.fullmatch`): `^`, `$`, `\\A` and `\\Z` are accepted and mean nothing
more. What this automaton does not follow (backreferences, lookarounds, conditionals, atomic groups,
possessive quantifiers, word boundaries), scoped flags and the flags other than `(?s)` (`.` takes
newlines), `(?x)` and `(?m)` are refused with InvalidRequestError.
"""

from __future__ import annotations

import re
import re._constants as C
import re._parser as sre_parser
import threading

import numpy as np

from tritonllm.engine.errors import InvalidRequestError

DEAD = -1

# \d, \s, \w and their negations, as `re` reads them in a str pattern (Unicode).
_CATEGORIES = {
    C.CATEGORY_DIGIT: lambda ch: ch.isdecimal(),
    C.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(),
    C.CATEGORY_SPACE: lambda ch: ch.isspace(),
    C.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
    C.CATEGORY_WORD: lambda ch: ch.isalnum() or ch == "_",
    C.CATEGORY_NOT_WORD: lambda ch: not (ch.isalnum() or ch == "_"),
}
_REFUSED = {
    C.GROUPREF: "backreferences", C.GROUPREF_EXISTS: "conditional groups",
    C.ASSERT: "lookarounds", C.ASSERT_NOT: "lookarounds",
    # These forbid backtracking, which changes what matches ((?>a|ab)c does not match "abc").
    C.ATOMIC_GROUP: "atomic groups", C.POSSESSIVE_REPEAT: "possessive quantifiers",
}
_MAX_NFA_STATES = 200_000  # a bounded repeat is unrolled: {1,100000} would be this many states


class CharClass:
    """What one NFA edge accepts: a set of characters given by literals, ranges and categories."""

    __slots__ = ("negated", "codes", "ranges", "categories")

    def __init__(self, negated: bool, codes=(), ranges=(), categories=()):
        self.negated = negated
        self.codes = frozenset(codes)
        self.ranges = tuple(ranges)
        self.categories = tuple(categories)

    def __contains__(self, ch: str) -> bool:
        o = ord(ch)
        hit = (o in self.codes or any(lo <= o <= hi for lo, hi in self.ranges)
               or any(test(ch) for test in self.categories))
        return hit != self.negated


class RegexAutomaton:
    """The pattern's lazily built DFA: `step(state, ch)`, `is_accepting(state)`, `start`."""

    def __init__(self, pattern: str):
        try:
            parsed = sre_parser.parse(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            raise InvalidRequestError(f"guided regex {pattern!r} is not a valid regular expression: {exc}") from None
        flags = parsed.state.flags
        if flags & re.IGNORECASE:
            raise InvalidRequestError("guided regex: the (?i) flag is not supported; spell the cases out")
        if flags & ~(re.DOTALL | re.VERBOSE | re.MULTILINE | re.UNICODE):
            raise InvalidRequestError("guided regex: only the flags (?s), (?x) and (?m) are supported")
        self._dotall = bool(flags & re.DOTALL)
        self._eps: list[list[int]] = []  # NFA: epsilon edges per state
        self._edges: list[list[tuple[CharClass, int]]] = []  # NFA: (class, target) edges per state
        start = self._new()
        self._accept = self._build(parsed, start)
        self._intern_lock = threading.Lock()
        self._sets: list[frozenset[int]] = []  # DFA state id -> its NFA states
        self._ids: dict[frozenset[int], int] = {}
        self._accepting: list[bool] = []
        self.moves: dict[tuple[int, str], int] = {}
        self._masks: dict[tuple[int, str], np.ndarray] = {}  # (class, alphabet) -> which characters it takes
        self.start = self._intern(self._closure({start}))

    # --- the NFA, built from the parse tree -------------------------------------------------
    def _new(self) -> int:
        if len(self._eps) >= _MAX_NFA_STATES:
            raise InvalidRequestError("guided regex is too large (bounded repeats are unrolled); "
                                      "use smaller counts")
        self._eps.append([])
        self._edges.append([])
        return len(self._eps) - 1

    def _edge(self, src: int, cls: CharClass) -> int:
        dst = self._new()
        self._edges[src].append((cls, dst))
        return dst

    def _build(self, items, src: int) -> int:
        """Adds `items` (a parsed sequence) after state `src`; returns the state where they end."""
        for op, av in items:
            src = self._build_one(op, av, src)
        return src

    def _build_one(self, op, av, src: int) -> int:
        if op is C.LITERAL:
            return self._edge(src, CharClass(False, codes=(av,)))
        if op is C.NOT_LITERAL:
            return self._edge(src, CharClass(True, codes=(av,)))
        if op is C.ANY:
            return self._edge(src, CharClass(True, codes=() if self._dotall else (10,)))
        if op is C.IN:
            return self._edge(src, self._char_class(av))
        if op is C.BRANCH:
            end = self._new()
            for alternative in av[1]:
                head = self._new()
                self._eps[src].append(head)
                self._eps[self._build(alternative, head)].append(end)
            return end
        if op is C.SUBPATTERN:
            _group, add_flags, del_flags, body = av
            if add_flags or del_flags:
                raise InvalidRequestError("guided regex: scoped flags such as (?i:...) are not supported")
            return self._build(body, src)
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):
            low, high, body = av
            for _ in range(low):
                src = self._build(body, src)
            if high == C.MAXREPEAT:  # then any number more: a loop through an epsilon edge
                loop = self._new()
                self._eps[src].append(loop)
                self._eps[self._build(body, loop)].append(loop)
                return loop
            end = self._new()
            for _ in range(high - low):  # each further copy may be skipped to the end
                self._eps[src].append(end)
                src = self._build(body, src)
            self._eps[src].append(end)
            return end
        if op is C.AT:
            if av in (C.AT_BOUNDARY, C.AT_NON_BOUNDARY):
                raise InvalidRequestError("guided regex: word boundaries (\\b, \\B) are not supported")
            return src  # ^ $ \A \Z: the match is whole-string anyway
        if op in _REFUSED:
            raise InvalidRequestError(f"guided regex: {_REFUSED[op]} are not supported (not a finite automaton's "
                                      f"language, or not the same language without backtracking)")
        raise InvalidRequestError(f"guided regex: {str(op).lower()} is not supported")

    @staticmethod
    def _char_class(items) -> CharClass:
        negated, codes, ranges, categories = False, [], [], []
        for op, av in items:
            if op is C.NEGATE:
                negated = True
            elif op is C.LITERAL:
                codes.append(av)
            elif op is C.RANGE:
                ranges.append(av)
            elif op is C.CATEGORY:
                categories.append(_CATEGORIES[av])
            else:
                raise InvalidRequestError(f"guided regex: {str(op).lower()} inside [...] is not supported")
        return CharClass(negated, codes, ranges, categories)

    # --- the DFA, built as it is stepped ------------------------------------------------------
    def _closure(self, states) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for nxt in self._eps[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def _intern(self, nfa_states: frozenset[int]) -> int:
        if not nfa_states:
            return DEAD
        found = self._ids.get(nfa_states)
        if found is None:
            with self._intern_lock:  # one automaton serves every engine of the process that uses its pattern
                found = self._ids.get(nfa_states)
                if found is None:
                    self._sets.append(nfa_states)
                    self._accepting.append(self._accept in nfa_states)
                    found = self._ids[nfa_states] = len(self._sets) - 1
        return found

    def step(self, state: int, ch: str) -> int:
        """The DFA state after reading `ch` in `state` (DEAD: no match can follow)."""
        key = (state, ch)
        nxt = self.moves.get(key)
        if nxt is None:
            if state == DEAD:
                return DEAD
            targets = {dst for s in self._sets[state] for cls, dst in self._edges[s] if ch in cls}
            nxt = self.moves[key] = self._intern(self._closure(targets))
        return nxt

    def transitions(self, state: int, alphabet: str) -> np.ndarray:
        """The state after each character of `alphabet` (int64, DEAD where none), as `step` gives them.

        The characters that take the same edges share one closure, so a row costs a few set
        operations rather than one per character.
        """
        edges = [] if state == DEAD else [edge for s in self._sets[state] for edge in self._edges[s]]
        if not edges:
            return np.full(len(alphabet), DEAD, dtype=np.int64)
        taken = np.stack([self._class_mask(cls, alphabet) for cls, _ in edges])  # [edges, alphabet]
        patterns, which = np.unique(taken, axis=1, return_inverse=True)
        targets = np.asarray([self._intern(self._closure({edges[e][1] for e in np.flatnonzero(column)}))
                              for column in patterns.T], dtype=np.int64)
        return targets[which.reshape(-1)]

    def _class_mask(self, cls: CharClass, alphabet: str) -> np.ndarray:
        key = (id(cls), alphabet)  # the classes live as long as the automaton; str hashes are cached
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = np.fromiter((ch in cls for ch in alphabet), dtype=bool, count=len(alphabet))
        return mask

    def walk(self, text: str, state: int | None = None) -> int:
        state = self.start if state is None else state
        for ch in text:
            state = self.step(state, ch)
            if state == DEAD:
                break
        return state

    def is_accepting(self, state: int) -> bool:
        return state != DEAD and self._accepting[state]

    def fullmatch(self, text: str) -> bool:
        return self.is_accepting(self.walk(text))
