"""A guided `regex` (and `whitespace_pattern`) is written in Python's `re` syntax, the syntax this
server documents; llguidance reads the Rust `regex` crate's. The two agree on most patterns, and
where they differ the same text means different things: `\\Z` is the end in Python and an error in
Rust, `\\<` is a literal in Python and a word start in Rust, `[[a]` holds `[` in Python and nests a
class in Rust, `a*+` is possessive in Python and `(a*)+` in Rust, `(?x)` skips whitespace inside
`[...]` in Rust but not in Python. So a pattern is read here the way `re` reads it and written out
again in Rust's syntax: every literal escaped by Rust's rules, `{,n}` as `{0,n}`, verbose mode's
whitespace and comments dropped, octal and `\\N{...}` escapes as the characters they name.

What llguidance cannot follow (it matches with an automaton, which reads each character once and
remembers no group) is refused here by name: backreferences, lookarounds, conditional
groups, atomic groups, possessive quantifiers and word boundaries; of the flags, only `(?a)` and
`(?L)`, which change what `\\w`, `\\d` and `\\s` mean, are refused. Matching is whole-output
(`re.fullmatch`): `^` and `\\A` at the start and `$` and `\\Z` at the end mean nothing more, and
llguidance refuses them anywhere else; `(?m)` changes only them, so it is dropped.
"""

from __future__ import annotations

import re
import unicodedata
import warnings

from tritonllm.core.errors import InvalidRequestError

# Characters the Rust regex syntax gives a meaning to, outside or inside [...]; escaped when literal.
_RUST_META = set("\\.+*?()|[]{}^$#&-~")
_PYTHON_WHITESPACE = " \t\n\r\v\f"  # what verbose mode skips
_CLASS_ESCAPES = set("dDwWsS")
_CONTROL_ESCAPES = set("afnrtv")
_OCTAL = set("01234567")
_HEX = set("0123456789abcdefABCDEF")
_FLAGS = set("aiLmsux")
_QUANTIFIER = re.compile(r"\{([0-9]*)(?:(,)([0-9]*))?\}")
_GLOBAL_FLAGS = re.compile(r"\(\?([a-zA-Z]*)\)")
# `re` warns of syntax a later Python may read otherwise ("Possible nested set" in `[[a]`), attributed to the
# line that compiled the pattern: a client's pattern, read as this Python reads it, is not the server log's
# business. (A filter set once here, rather than around each compile: warnings.catch_warnings is not thread-safe.)
warnings.filterwarnings("ignore", category=FutureWarning, module=re.escape(__name__) + "$")

_SCOPED_FLAGS = re.compile(r"\(\?([a-zA-Z]*)(?:-([a-zA-Z]*))?([:)])")
_NAMED_CHARACTER = re.compile(r"\\N\{([^}]*)\}")


class _Malformed(Exception):
    """Not a pattern `re` reads; `re.compile` says why."""


def python_regex_to_rust(pattern: str, what: str = "guided regex") -> str:
    """`pattern` (Python `re` syntax) in the Rust regex syntax llguidance reads, matching the same
    strings; InvalidRequestError naming what llguidance cannot follow or what is wrong with it."""
    try:
        translated = _Translator(pattern, what).translate()
    except _Malformed:
        translated = None
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise InvalidRequestError(f"{what} {pattern!r} is not a valid regular expression: {exc}") from None
    if translated is None:  # `re` reads it, this reader does not: say so rather than guess
        raise InvalidRequestError(f"{what} {pattern!r} uses syntax this server cannot read")
    return translated


def _literal(ch: str) -> str:
    if ch in _RUST_META:
        return "\\" + ch
    return ch if ch.isprintable() or ch == " " else f"\\x{{{ord(ch):X}}}"


def _refuse(what: str, construct: str) -> InvalidRequestError:
    return InvalidRequestError(f"{what}: {construct} are not supported (guided decoding matches with an "
                               f"automaton, which reads each character once and remembers no group)")


class _Translator:
    def __init__(self, pattern: str, what: str):
        self.p = pattern
        self.what = what
        self.i = 0
        self.out: list[str] = []

    def _peek(self, k: int = 0) -> str:
        return self.p[self.i + k] if self.i + k < len(self.p) else ""

    def translate(self) -> str:
        verbose = self._global_flags()
        stack: list[bool] = []  # the enclosing groups' verbose flags, restored at their ")"
        while self.i < len(self.p):
            ch = self.p[self.i]
            if verbose and ch in _PYTHON_WHITESPACE:
                self.i += 1
            elif verbose and ch == "#":
                end = self.p.find("\n", self.i)
                self.i = len(self.p) if end < 0 else end + 1
            elif ch == "(":
                verbose = self._group(stack, verbose)
            elif ch == ")":
                if not stack:
                    raise _Malformed
                verbose = stack.pop()
                self.out.append(")")
                self.i += 1
            elif ch == "[":
                self.i += 1
                self.out.append(self._class())
            elif ch == "\\":
                self.out.append(self._escape())
            elif ch in "*+?":
                self.i += 1
                self.out.append(ch)
                self._after_quantifier()
            elif ch == "{" and (m := _QUANTIFIER.match(self.p, self.i)):
                low, comma, high = m.groups()
                self.out.append("{" + (low or "0") + ("," + high if comma else "") + "}")
                self.i = m.end()
                self._after_quantifier()
            elif ch in ".|^$":
                self.out.append(ch)
                self.i += 1
            else:
                self.out.append(_literal(ch))
                self.i += 1
        if stack:
            raise _Malformed
        return "".join(self.out)

    def _global_flags(self) -> bool:
        """The leading (?flags) groups (Python takes global flags only at the start): (?i) and (?s)
        kept, (?x) applied here; whether verbose mode is on."""
        verbose = False
        while m := _GLOBAL_FLAGS.match(self.p, self.i):
            flags = m.group(1)
            if set(flags) - _FLAGS:
                raise _Malformed
            verbose = verbose or "x" in flags
            self._check_flags(flags)
            kept = "".join(f for f in flags if f in "is")
            if kept:
                self.out.append(f"(?{kept})")
            self.i = m.end()
        return verbose

    def _check_flags(self, flags: str) -> None:
        if set(flags) & set("aL"):
            raise InvalidRequestError(f"{self.what}: only the flags (?i), (?m), (?s), (?x) and (?u) are supported, "
                                      f"not (?a) or (?L)")

    def _after_quantifier(self) -> None:
        if self._peek() == "+":
            raise _refuse(self.what, "possessive quantifiers")
        if self._peek() == "?":  # lazy: the same strings match a whole output
            self.out.append("?")
            self.i += 1

    def _group(self, stack: list[bool], verbose: bool) -> bool:
        """At "(": the group's opening written (or a comment skipped); the verbose flag inside it."""
        p, i = self.p, self.i
        if p.startswith("(?#", i):
            end = p.find(")", i)
            if end < 0:
                raise _Malformed
            self.i = end + 1
            return verbose
        if not p.startswith("(?", i):
            stack.append(verbose)
            self.out.append("(")
            self.i += 1
            return verbose
        if p.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            raise _refuse(self.what, "lookarounds")
        if p.startswith("(?P=", i):
            raise _refuse(self.what, "backreferences")
        if p.startswith("(?(", i):
            raise _refuse(self.what, "conditional groups")
        if p.startswith("(?>", i):
            raise _refuse(self.what, "atomic groups")
        if p.startswith(("(?P<", "(?<"), i):  # a named group: names do not change what matches
            end = p.find(">", i)
            if end < 0:
                raise _Malformed
            stack.append(verbose)
            self.out.append("(")
            self.i = end + 1
            return verbose
        if p.startswith("(?:", i):
            stack.append(verbose)
            self.out.append("(?:")
            self.i += 3
            return verbose
        m = _SCOPED_FLAGS.match(p, i)
        if m is None or set(m.group(1) + (m.group(2) or "")) - _FLAGS:
            raise _Malformed
        on, off, end = m.group(1), m.group(2) or "", m.group(3)
        if end == ")":  # global flags past the start: an error since Python 3.11
            raise InvalidRequestError(f"{self.what}: global flags such as (?{on}) must come at the start of the pattern")
        self._check_flags(on + off)
        stack.append(verbose)
        on_kept, off_kept = "".join(f for f in on if f in "is"), "".join(f for f in off if f in "is")
        self.out.append(f"(?{on_kept}-{off_kept}:" if off_kept else f"(?{on_kept}:")
        self.i = m.end()
        return (verbose or "x" in on) and "x" not in off

    def _class(self) -> str:
        """After "[": the class, to its "]", in Rust's syntax."""
        negate = self._peek() == "^"
        if negate:
            self.i += 1
        items, first = [], True
        while True:
            if self.i >= len(self.p):
                raise _Malformed
            if self.p[self.i] == "]" and not first:
                self.i += 1
                break
            first = False
            low = self._class_atom()
            if self._peek() == "-" and self._peek(1) not in ("", "]"):
                self.i += 1
                high = self._class_atom()
                if len(low) != 1 or len(high) != 1:  # \d-x and the like: `re` refuses them
                    raise _Malformed
                items.append(_literal(low) + "-" + _literal(high))
            else:
                items.append(low if len(low) > 1 else _literal(low))
        return "[" + ("^" if negate else "") + "".join(items) + "]"

    def _class_atom(self) -> str:
        """One character of a class (returned as the character itself), or a class escape such as \\d."""
        ch = self.p[self.i]
        if ch != "\\":
            self.i += 1
            return ch
        nxt = self._peek(1)
        if nxt in _CLASS_ESCAPES:
            self.i += 2
            return "\\" + nxt
        if nxt == "b":  # a backspace inside [...]
            self.i += 2
            return "\b"
        if nxt in _OCTAL:  # inside [...], one to three octal digits
            return self._octal(3)
        return self._character_escape()

    def _escape(self) -> str:
        """At a backslash outside [...]: the escape in Rust's syntax."""
        nxt = self._peek(1)
        if nxt in _CLASS_ESCAPES or nxt == "A":
            self.i += 2
            return "\\" + nxt
        if nxt == "Z":
            self.i += 2
            return "\\z"
        if nxt in ("b", "B"):
            raise _refuse(self.what, "word boundaries (\\b, \\B)")
        if nxt == "0":
            return _literal(self._octal(3))
        if nxt.isdigit():  # three octal digits are a character, anything else refers to a group
            digits = self.p[self.i + 1:self.i + 4]
            if len(digits) == 3 and set(digits) <= _OCTAL:
                return _literal(self._octal(3))
            raise _refuse(self.what, "backreferences")
        return _literal(self._character_escape())

    def _octal(self, most: int) -> str:
        j = self.i + 1
        while j < len(self.p) and j < self.i + 1 + most and self.p[j] in _OCTAL:
            j += 1
        value = int(self.p[self.i + 1:j], 8)
        if value > 0o377:
            raise _Malformed
        self.i = j
        return chr(value)

    def _character_escape(self) -> str:
        """At a backslash that stands for one character (not octal): that character."""
        nxt = self._peek(1)
        if nxt in _CONTROL_ESCAPES:
            self.i += 2
            return {"a": "\a", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}[nxt]
        if nxt in ("x", "u", "U"):
            size = {"x": 2, "u": 4, "U": 8}[nxt]
            digits = self.p[self.i + 2:self.i + 2 + size]
            if len(digits) != size or not set(digits) <= _HEX or int(digits, 16) > 0x10FFFF:
                raise _Malformed
            self.i += 2 + size
            return chr(int(digits, 16))
        if nxt == "N":
            m = _NAMED_CHARACTER.match(self.p, self.i)
            if m is None:
                raise _Malformed
            try:
                char = unicodedata.lookup(m.group(1))
            except KeyError:
                raise _Malformed from None
            self.i = m.end()
            return char
        if nxt == "" or (nxt.isascii() and nxt.isalnum()):
            raise _Malformed  # a trailing backslash, or an unknown escape such as \\q: `re` refuses it
        self.i += 2
        return nxt
