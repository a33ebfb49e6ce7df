"""MiniMax-M2 (``minimax_m2``; MiniMax's chat template and vLLM's ``minimax_m2`` parser), several calls per block::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Values are typed by the tool's parameter schema (:func:`~ferrylm.server.text.tool_parsers.block.coerce_value`).
"""

from __future__ import annotations

import re
from typing import Any

from ferrylm.server.text.tool_parsers.base import ToolCall
from ferrylm.server.text.tool_parsers.block import (BlockToolParser, leading, match_all, object_args, strip_newline,
                                                    value_text)

_MM_INVOKE = re.compile(r"\s*<invoke name=(\"[^\"<>]*\"|'[^'<>]*'|[^\s<>]+)>(.*?)</invoke>", re.S)
_MM_HEAD = re.compile(r"\s*<invoke name=(\"[^\"<>]*\"|'[^'<>]*'|[^\s<>]+)>")
_MM_PARAM = re.compile(r"\s*<parameter name=(\"[^\"<>]*\"|'[^'<>]*'|[^\s<>]+)>(.*?)</parameter>", re.S)


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'" else s


class MiniMaxM2ToolParser(BlockToolParser):
    """MiniMax-M2 ``<minimax:tool_call>`` blocks of ``<invoke name=...>`` calls with ``<parameter name=...>``
    values (module docstring)."""

    OPEN = "<minimax:tool_call>"
    CLOSE = "</minimax:tool_call>"
    LEAD = "<invoke"
    MARKUP = (OPEN, CLOSE)
    TEMPLATE_MARK = re.escape(OPEN)

    def parse_block(self, body: str) -> list[ToolCall] | None:
        invokes = match_all(_MM_INVOKE, body)
        if not invokes or not invokes[0]:
            return None
        calls = []
        for m in invokes[0]:
            params = match_all(_MM_PARAM, m[2])
            if params is None:
                return None
            call = self._call(_unquote(m[1]), [(_unquote(p[1]), strip_newline(p[2])) for p in params[0]])
            if call is None:
                return None
            calls.append(call)
        return calls

    def cut_calls(self, body: str) -> list[ToolCall]:
        """The whole invokes, then the unfinished one once its ``<invoke name=...>`` is whole."""
        invokes, pos = leading(_MM_INVOKE, body)
        calls = (self.parse_block(body[:pos]) or []) if invokes else []
        head = _MM_HEAD.match(body, pos)
        if head is not None:
            params = leading(_MM_PARAM, body, head.end())[0]
            call = self._cut_call(_unquote(head[1]), [(_unquote(p[1]), strip_newline(p[2])) for p in params])
            calls += [call] if call is not None else []
        return calls

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        blocks = []
        for name, args, _ in object_args(calls):
            params = "".join(f'<parameter name="{k}">{value_text(v)}</parameter>\n' for k, v in args.items())
            blocks.append(f'{cls.OPEN}\n<invoke name="{name}">\n{params}</invoke>\n{cls.CLOSE}')
        return "\n".join(blocks)
