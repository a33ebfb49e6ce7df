"""Hermes / Qwen ``<tool_call>`` calls (``hermes``; Qwen2.5 / Qwen3 / QwQ and the built-in models)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call is a block whose body is a JSON object naming one of the request's tools with object arguments (``arguments``
or ``parameters``, an object or JSON text of one).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping

from ferrylm.server.text.tool_parsers.base import Piece, ToolCall, ToolParser, decode_arguments, partial_suffix


#: the head of a call body cut short: its whole name, then (once begun) the arguments' key
_CUT_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(?:,\s*"(arguments|parameters)"\s*:\s*)?', re.S)


def _close_outside_json_string(buf: str, tag: str) -> int:
    """Index of the first ``tag`` in ``buf`` that is not inside a JSON string literal (-1: none yet)."""
    in_str = esc = False
    i, n = 0, len(buf)
    while i < n:
        c = buf[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "<" and buf.startswith(tag, i):
            return i
        i += 1
    return -1


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (see the module docstring for the rules).

    Whitespace next to a call is not content: the blank run before a call, between calls and after the last one
    is dropped (so a reply made only of calls has no text).

    Args:
        tool_names: the request's tools; a block naming another function stays text. None: any name.
        schemas: not read (the arguments are JSON already).
    """

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    MARKUP = (OPEN, CLOSE)
    TEMPLATE_MARK = r'<tool_call>(?:\\n|\s)*\{\\?"name\\?"'

    def __init__(self, tool_names: Iterable[str] | None = None, schemas: Mapping[str, dict] | None = None):
        self.names = None if tool_names is None else frozenset(tool_names)
        self.calls = 0
        self._buf = ""
        self._in_block = False
        self._ws = ""            # trailing whitespace of released text, held until we know what follows it
        self._after_call = False  # drop the whitespace that follows a call
        self._raw_close = False   # finish(): a body whose strings never close ends at the first closing tag

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._in_block:
                # NOTE: the closing tag that ends the call is the first one outside a JSON string: a string
                # argument may hold "</tool_call>" itself (a forced call's grammar allows any string)
                j = self._buf.find(self.CLOSE) if self._raw_close else _close_outside_json_string(self._buf,
                                                                                                   self.CLOSE)
                body = self._buf if j < 0 else self._buf[:j]
                stripped = body.lstrip()
                if stripped and not stripped.startswith("{"):   # not a call: the tag was just mentioned
                    self._in_block = False
                    self._text(self.OPEN, out)
                    continue
                if j < 0:
                    return out
                self._buf = self._buf[j + len(self.CLOSE):]
                self._in_block = False
                call = self._parse(body)
                if call is None:
                    self._text(self.OPEN + body + self.CLOSE, out)
                else:
                    self._ws = ""
                    self._after_call = True
                    self.calls += 1
                    out.append(Piece(call=call))
                continue
            i = self._buf.find(self.OPEN)
            if i >= 0:
                self._text(self._buf[:i], out)
                self._buf = self._buf[i + len(self.OPEN):]
                self._in_block = True
                continue
            keep = partial_suffix(self._buf, self.OPEN)
            self._text(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[Piece]:
        out = self.feed("")
        if self._in_block and self.CLOSE in self._buf:   # a malformed body (an unclosed string): the first tag
            self._raw_close = True
            out += self.feed("")
        rest = (self.OPEN if self._in_block else "") + self._buf
        self._buf, self._in_block = "", False
        self._text(rest, out)
        if self._ws and not self.calls:
            out.append(Piece(self._ws))
        self._ws = ""
        return out

    def cut_block(self, body: str) -> list[ToolCall]:
        """A body that is a whole call already (the closing tag missing or cut short) is that call; else the
        unfinished call once its name is whole, its arguments the JSON text after ``"arguments":``."""
        whole = self._parse(body[:len(body) - partial_suffix(body, self.CLOSE)])
        if whole is not None:
            return [whole]
        m = _CUT_HEAD.match(body)
        if m is None:
            return []
        name = json.loads(m[1])
        if not isinstance(name, str) or (self.names is not None and name not in self.names):
            return []
        return [ToolCall(name, body[m.end():] if m[2] else "", complete=False)]

    def _text(self, text: str, out: list[Piece]) -> None:
        """Release ``text`` as content, holding its trailing whitespace (and dropping leading whitespace right
        after a call)."""
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            out.append(Piece(self._ws + body))
            self._ws = ""
        self._ws += text[len(body):]

    def _parse(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):   # a model may nest past the recursion limit
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = decode_arguments(obj.get("arguments", obj.get("parameters", {})))
        if args is None:
            return None
        if self.names is not None and obj["name"] not in self.names:
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        """One block per earlier call, a newline apart."""
        return "\n".join(f"{cls.OPEN}\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) +
                         f"\n{cls.CLOSE}" for name, args, _ in calls)
