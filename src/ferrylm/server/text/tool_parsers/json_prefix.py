"""An incremental check that text is a prefix of one JSON object, for arguments streamed as the model writes them:
every prefix it accepts is one a partial JSON reader (the ``openai`` / ``anthropic`` SDKs' accumulators) reads
without error, and it stops before the first character that could not continue an object (in a call's markup, the
start of a closing tag).

This module must not import torch.
"""

from __future__ import annotations

import re

from ferrylm.server.text.json_limits import MAX_JSON_DEPTH
from ferrylm.server.text.tool_parsers.base import ToolCall, partial_suffix

_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')   # a run of string characters that need no look
_WS = " \t\n\r"
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
#: number states → (character class → next state); a number may end in the states of ``_NUMBER_ENDS``
_NUMBER = {"start": {"-": "minus", "0": "zero", "d": "int"}, "minus": {"0": "zero", "d": "int"},
           "zero": {".": "dot", "e": "e"}, "int": {"0": "int", "d": "int", ".": "dot", "e": "e"},
           "dot": {"0": "frac", "d": "frac"}, "frac": {"0": "frac", "d": "frac", "e": "e"},
           "e": {"+": "sign", "-": "sign", "0": "exp", "d": "exp"}, "sign": {"0": "exp", "d": "exp"},
           "exp": {"0": "exp", "d": "exp"}}
_NUMBER_ENDS = frozenset(("zero", "int", "frac", "exp"))


def _number_class(c: str) -> str:
    if c == "0":
        return "0"
    if "1" <= c <= "9":
        return "d"
    return "e" if c in "eE" else c


class JsonPrefix:
    """Reads one JSON object's text piece by piece (RFC 8259: no raw control characters in strings, no NaN; at most
    :data:`MAX_JSON_DEPTH` nested containers). ``taken``: characters accepted so far; ``done``: the object closed
    (nothing after its ``}`` is taken); ``broken``: a character could not continue it (neither it nor anything after
    is taken); ``string_at``: where the string the text ends in began (after its quote), None outside strings."""

    def __init__(self) -> None:
        self.taken = 0
        self.string_at: int | None = None
        self.done = False
        self.broken = False
        self._stack: list[str] = []
        self._state = "top"    # top | value | arr_first | obj_first | key | colon | after | string | number | literal
        self._key = False      # the string being read is an object key
        self._esc = 0          # in a string: -1 after a backslash, n > 0 hex digits of a \\u escape still due
        self._num = ""
        self._lit = ""

    def feed(self, text: str) -> int:
        """Reads ``text`` on from where the last call stopped; returns how many of its characters were taken."""
        i, n = 0, len(text)
        while i < n and not (self.done or self.broken):
            if self._state == "string" and self._esc == 0:
                m = _PLAIN.match(text, i)
                if m is not None:
                    i = m.end()
                    continue
            was = self._state
            if self._step(text[i]):
                i += 1
                if self._state == "string" and was != "string":
                    self.string_at = self.taken + i
            if self._state != "string":
                self.string_at = None
        self.taken += i
        return i

    def _step(self, c: str) -> bool:
        """One character; False when it was not taken (it ends a number and is read again, or it broke the text)."""
        s = self._state
        if s == "string":
            return self._string(c)
        if s == "number":
            nxt = _NUMBER[self._num].get(_number_class(c))
            if nxt is not None:
                self._num = nxt
                return True
            if self._num in _NUMBER_ENDS:
                self._state = "after"
                return False
            return self._break()
        if s == "literal":
            if c != self._lit[0]:
                return self._break()
            self._lit = self._lit[1:]
            if not self._lit:
                self._state = "after"
            return True
        if c in _WS and s != "top":
            return True
        return self._token(s, c)

    def _string(self, c: str) -> bool:
        if self._esc == -1:
            if c == "u":
                self._esc = 4
            elif c in _ESCAPES:
                self._esc = 0
            else:
                return self._break()
        elif self._esc > 0:
            if c not in _HEX:
                return self._break()
            self._esc -= 1
        elif c == '"':
            self._state = "colon" if self._key else "after"
        elif c == "\\":
            self._esc = -1
        else:   # a raw control character
            return self._break()
        return True

    def _token(self, s: str, c: str) -> bool:
        """A structural character in state ``s`` (blanks between tokens are taken before)."""
        if s == "top":
            return self._open(c) if c == "{" else self._break()
        if s in ("obj_first", "key"):
            if c == '"':
                self._state, self._key = "string", True
                return True
            return self._close(c) if c == "}" and s == "obj_first" else self._break()
        if s == "colon":
            if c != ":":
                return self._break()
            self._state = "value"
            return True
        if s == "after":
            if c == ",":
                self._state = "key" if self._stack[-1] == "{" else "value"
                return True
            return self._close(c)
        if s == "arr_first" and c == "]":
            return self._close(c)
        return self._value(c)

    def _value(self, c: str) -> bool:
        if c in "{[":
            return self._open(c)
        if c == '"':
            self._state, self._key = "string", False
        elif c in _LITERALS:
            self._state, self._lit = "literal", _LITERALS[c]
        elif c == "-" or "0" <= c <= "9":
            self._state, self._num = "number", _NUMBER["start"][_number_class(c)]
        else:
            return self._break()
        return True

    def _open(self, c: str) -> bool:
        if len(self._stack) >= MAX_JSON_DEPTH:
            return self._break()
        self._stack.append(c)
        self._state = "obj_first" if c == "{" else "arr_first"
        return True

    def _close(self, c: str) -> bool:
        if not self._stack or c != ("}" if self._stack[-1] == "{" else "]"):
            return self._break()
        self._stack.pop()
        self._state = "after"
        self.done = not self._stack
        return True

    def _break(self) -> bool:
        self.broken = True
        return False


class StreamedCall:
    """A call whose arguments, one JSON object the model writes verbatim, are released as they are written: ``head``
    (a fresh id and the name), then :meth:`more` fragments, then :meth:`call`, whose arguments are the fragments
    joined: whole once the object closed, else unfinished (the output ended first, or the model wrote something no
    object continues with: its closing tag, a raw control character in a string ...; nothing of that is taken).
    Text that may be the closing tag is never released: outside strings no object holds a ``<``; inside a string
    the tag (or the start of it the text ends in) is held until the string closes, since a string the model never
    closes ends at it.

    Args:
        name: the function (one of the request's tools).
        start: where the arguments' ``{`` is in the block's body.
        close: the block's closing tag.
    """

    def __init__(self, name: str, start: int, close: str):
        self.head = ToolCall(name, "", complete=False)
        self.start = start
        self.close = close
        self.sent = 0      # characters of arguments released
        self.json = JsonPrefix()

    def more(self, body: str) -> str:
        """The arguments text released from ``body`` (the block's body so far, a longer one each time) since the
        last call."""
        if not (self.json.done or self.json.broken):
            at = self.start + self.json.taken
            self.json.feed(body[at:])
        end = self.start + self.json.taken
        if self.json.string_at is not None:   # no tag begins before what was released (it would have been held)
            lo = self.start + max(self.json.string_at, self.sent)
            tag = body.find(self.close, lo, end)
            end = tag if tag >= 0 else end - partial_suffix(body[max(lo, end - len(self.close)):end], self.close)
        new = body[self.start + self.sent:end]
        self.sent = end - self.start
        return new

    def call(self, body: str) -> ToolCall:
        """The call as released from ``body`` (the last one given to :meth:`more`)."""
        return ToolCall(self.head.name, body[self.start:self.start + self.sent], self.head.id,
                        complete=self.json.done)
