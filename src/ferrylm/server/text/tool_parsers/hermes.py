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
from typing import Any

from ferrylm.server.text.tool_parsers.base import ToolCall, decode_arguments, partial_suffix
from ferrylm.server.text.tool_parsers.block import BlockToolParser


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


class HermesToolParser(BlockToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (see the module docstring for the rules), one call a block.

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

    def viable(self, body: str) -> bool:
        """A body starts with ``{`` (after blanks); anything else means the tag was just mentioned."""
        stripped = body.lstrip()
        return not stripped or stripped.startswith("{")

    def close_at(self, buf: str) -> int:
        # NOTE: the closing tag that ends the call is the first one outside a JSON string: a string argument may
        # hold "</tool_call>" itself (a forced call's grammar allows any string)
        return _close_outside_json_string(buf, self._close)

    def parse_block(self, body: str) -> list[ToolCall] | None:
        call = self._parse(body)
        return None if call is None else [call]

    def cut_block(self, body: str) -> list[ToolCall]:
        """A body that is a whole call already (the closing tag missing or cut short) is that call; else the
        unfinished call once its name is whole, its arguments the JSON text after ``"arguments":``."""
        whole = self._parse(body[:len(body) - partial_suffix(body, self.CLOSE)])
        if whole is not None:
            return [whole]
        m = _CUT_HEAD.match(body)
        if m is None:
            return []
        call = self.tools.json_cut(json.loads(m[1]), body[m.end():] if m[2] else "")
        return [call] if call is not None else []

    def _parse(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):   # a model may nest past the recursion limit
            return None
        if not isinstance(obj, dict):
            return None
        return self.tools.call(obj.get("name"), decode_arguments(obj.get("arguments", obj.get("parameters", {}))))

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        """One block per earlier call, a newline apart."""
        return "\n".join(f"{cls.OPEN}\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) +
                         f"\n{cls.CLOSE}" for name, args, _ in calls)
