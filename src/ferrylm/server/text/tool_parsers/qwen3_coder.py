"""Qwen3-Coder tool calls (``qwen3_coder``; also Qwen3-Next and Qwen3.5), as Qwen's chat template writes them: one
``<tool_call>`` block per call, the function and each parameter in an XML-like tag, values on their own lines::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are text typed by the tool's parameter schema (:func:`~ferrylm.server.text.tool_parsers.calls.coerce_value`:
a ``string`` property keeps the text, others are read as JSON as the template writes them with ``tojson``); one
newline after the opening tag and one before the closing tag are layout. A value ends at the first
``</parameter>``, so a string may hold ``<`` and other tags (code), ``</tool_call>`` included: the block ends at
the first ``</tool_call>`` outside values (at the end of the output, a value never closed gives way to the first
one). A block becomes calls only once it is closed and its body is one or more well-formed functions of the
request's tools, else it is text. A function the model wrote without the ``<tool_call>`` wrapper (models drop it
at times) is read too: ``<function=NAME>`` + parameters + ``</function>`` of a request tool, else text.

This module must not import torch.
"""

from __future__ import annotations

import re
from typing import Any

from ferrylm.server.text.tool_parsers.base import ToolCall
from ferrylm.server.text.tool_parsers.block import (BlockToolParser, leading, match_all, object_args, strip_newline,
                                                    value_text)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
#: the tags of the format (``ToolParser.MARKUP``)
MARKUP = (OPEN, CLOSE)

_FUNCTION = re.compile(r"\s*<function=([^<>\n]+)>")
_NAME_PART = re.compile(r"[^<>\n]*")
_PARAM = re.compile(r"\s*<parameter=([^<>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderToolParser(BlockToolParser):
    """``<tool_call>`` blocks of ``<function=NAME>`` + ``<parameter=KEY>`` calls (module docstring)."""

    OPEN = OPEN
    CLOSE = CLOSE
    LEAD = FUNCTION
    MARKUP = MARKUP
    TEMPLATE_MARK = re.escape(PARAMETER)   # <function= alone: Llama 3.1 prompt guides
    EXTRA_BLOCKS = ((FUNCTION, FUNCTION_END),)   # no wrapper

    def viable(self, body: str) -> bool:
        """A wrapped block starts with ``<function=``; a bare function's body with its name up to ``>``."""
        if self._open == FUNCTION:
            end = _NAME_PART.match(body).end()
            return end == len(body) or body[end] == ">"
        return super().viable(body)

    def close_at(self, buf: str) -> int:
        """The first closing tag (``</tool_call>``; ``</function>`` without the wrapper) outside parameter values
        (a string value may hold one: code), scanning left to right; -1 while a value is open or no closing tag
        came yet."""
        pos = 0
        while True:
            close, param = buf.find(self._close, pos), buf.find(PARAMETER, pos)
            if param < 0 or 0 <= close < param:
                return close
            end = buf.find(PARAMETER_END, param)
            if end < 0:
                return -1
            pos = end + len(PARAMETER_END)

    def parse_block(self, body: str) -> list[ToolCall] | None:
        if self._open == FUNCTION:   # one function without the wrapper
            body = FUNCTION + body + FUNCTION_END
        calls, pos = [], 0
        while (head := _FUNCTION.match(body, pos)) is not None:
            params = match_all(_PARAM, body, head.end(), end=FUNCTION_END)
            if params is None:
                return None
            name, pairs = head[1].strip(), [(p[1].strip(), strip_newline(p[2])) for p in params[0]]
            call = self.tools.call(name, self.tools.arguments(name, pairs))
            if call is None:
                return None
            calls.append(call)
            pos = params[1]
        if not calls or body[pos:].strip():
            return None
        return calls

    def cut_calls(self, body: str) -> list[ToolCall]:
        """The function the output ended in once its ``<function=NAME>`` is whole, with the whole parameters;
        whole when its ``</function>`` was written."""
        if self._open == FUNCTION:
            body = FUNCTION + body
        head = _FUNCTION.match(body)
        if head is None:
            return []
        params, pos = leading(_PARAM, body, head.end())
        pairs = [(p[1].strip(), strip_newline(p[2])) for p in params]
        whole = body[pos:].lstrip().startswith(FUNCTION_END)
        name = head[1].strip()
        call = (self.tools.call if whole else self.tools.cut_call)(name, self.tools.arguments(name, pairs))
        return [call] if call is not None else []

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        return "\n".join(render_call(name, list(args.items())) for name, args, _ in object_args(calls))


def render_call(name: str, pairs: list[tuple[str, object]]) -> str:
    """One earlier call as the template writes it."""
    params = "".join(f"{PARAMETER}{k}>\n{value_text(v)}\n{PARAMETER_END}\n" for k, v in pairs)
    return f"{OPEN}\n{FUNCTION}{name}>\n{params}{FUNCTION_END}\n{CLOSE}"
