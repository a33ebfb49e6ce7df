"""Hermes / Qwen ``<tool_call>`` calls (``hermes``; Qwen2.5 / Qwen3 / QwQ and the built-in models)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call is a block whose body is a JSON object naming one of the request's tools with object arguments (``arguments``
or ``parameters``, an object or JSON text of one). A body that starts with the name of a request tool and then an
object of arguments (``{"name": "f", "arguments": {``) is that call from there on: its arguments are streamed as
the model writes them, verbatim (:class:`~ferrylm.server.text.tool_parsers.json_prefix.StreamedCall`), and they are
its ``arguments``; other bodies are held to the closing tag, their arguments written again as JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping

from ferrylm.server.text.tool_parsers.base import ToolCall, decode_arguments, partial_suffix
from ferrylm.server.text.tool_parsers.block import BlockToolParser
from ferrylm.server.text.tool_parsers.json_prefix import StreamedCall


_NAME = r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*'
#: the head of a call body cut short: its whole name, then (once begun) the arguments' key
_CUT_HEAD = re.compile(_NAME + r'(?:,\s*"(arguments|parameters)"\s*:\s*)?', re.S)
#: the head of a call whose arguments are streamed: the name, then an object of arguments begins (its ``{`` is next)
_STREAM_HEAD = re.compile(_NAME + r',\s*"(?:arguments|parameters)"\s*:\s*(?=\{)', re.S)


_OUTSIDE = re.compile(r'[^"<]*')   # a run outside strings that holds neither a quote nor a tag
_INSIDE = re.compile(r'[^"\\]*')   # a run inside a string that neither ends it nor escapes


def _close_outside_json_string(buf: str, tag: str, i: int = 0, in_str: bool = False) -> tuple[int, int, bool]:
    """The index of the first ``tag`` in ``buf`` that is not inside a JSON string literal (-1: none yet), read from
    ``i`` (``in_str``: inside a string there), and where a read of a longer ``buf`` may go on from: ``(index, i,
    in_str)``."""
    n = len(buf)
    while i < n:
        j = (_INSIDE if in_str else _OUTSIDE).match(buf, i).end()
        if j >= n:
            return -1, n, in_str
        c = buf[j]
        if c == "\\":       # inside a string: the escaped character is skipped
            if j + 1 >= n:
                return -1, j, in_str
            i = j + 2
            continue
        if c == '"':
            in_str = not in_str
        elif buf.startswith(tag, j):
            return j, j, in_str
        elif tag.startswith(buf[j:]):   # the tag may be under way
            return -1, j, in_str
        i = j + 1
    return -1, i, in_str


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

    def __init__(self, tool_names: Iterable[str] | None = None, schemas: Mapping[str, dict] | None = None):
        super().__init__(tool_names, schemas)
        self._scan = (-1, 0, False)   # the block whose body close_at read, up to where, inside a string there

    def viable(self, body: str) -> bool:
        """A body starts with ``{`` (after blanks); anything else means the tag was just mentioned."""
        stripped = body.lstrip()
        return not stripped or stripped.startswith("{")

    def close_at(self, buf: str) -> int:
        # NOTE: the closing tag that ends the call is the first one outside a JSON string: a string argument may
        # hold "</tool_call>" itself (a forced call's grammar allows any string). The body only grows while its
        # block is open, so the read goes on where the last one stopped.
        block, i, in_str = self._scan if self._scan[0] == self.blocks else (self.blocks, 0, False)
        j, i, in_str = _close_outside_json_string(buf, self._close, i, in_str)
        self._scan = (block, i, in_str)
        return j

    def stream_head(self, body: str) -> StreamedCall | None:
        m = _STREAM_HEAD.match(body)
        if m is None:
            return None
        try:
            name = json.loads(m[1])
        except ValueError:
            return None
        return StreamedCall(name, m.end(), self._close) if self.tools.known(name) else None

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
