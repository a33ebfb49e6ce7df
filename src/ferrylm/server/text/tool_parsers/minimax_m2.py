"""MiniMax-M2 (``minimax_m2``; MiniMax's chat template and vLLM's ``minimax_m2`` parser), several calls per block::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Values are typed by the tool's parameter schema (:func:`~ferrylm.server.text.tool_parsers.calls.coerce_value`).
"""

from __future__ import annotations

import re
from typing import Any

from ferrylm.server.text.tool_parsers.block import InvokeListParser, object_args, strip_newline, value_text
from ferrylm.server.text.tool_parsers.calls import coerce_value

_MM_INVOKE = re.compile(r"\s*<invoke name=(\"[^\"<>]*\"|'[^'<>]*'|[^\s<>]+)>(.*?)</invoke>", re.S)
_MM_HEAD = re.compile(r"\s*<invoke name=(\"[^\"<>]*\"|'[^'<>]*'|[^\s<>]+)>")
_MM_PARAM = re.compile(r"\s*<parameter name=(\"[^\"<>]*\"|'[^'<>]*'|[^\s<>]+)>(.*?)</parameter>", re.S)


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'" else s


class MiniMaxM2ToolParser(InvokeListParser):
    """MiniMax-M2 ``<minimax:tool_call>`` blocks of ``<invoke name=...>`` calls with ``<parameter name=...>``
    values (module docstring)."""

    OPEN = "<minimax:tool_call>"
    CLOSE = "</minimax:tool_call>"
    LEAD = "<invoke"
    MARKUP = (OPEN, CLOSE)
    TEMPLATE_MARK = re.escape(OPEN)
    CALL, CUT, PARAM = _MM_INVOKE, _MM_HEAD, _MM_PARAM

    def invoke_name(self, written: str) -> str:
        return _unquote(written)

    def param_key(self, p: re.Match) -> str:
        return _unquote(p[1])

    def param_value(self, p: re.Match, schema: Any) -> Any:
        return coerce_value(strip_newline(p[2]), schema)

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        blocks = []
        for name, args, _ in object_args(calls):
            params = "".join(f'<parameter name="{k}">{value_text(v)}</parameter>\n' for k, v in args.items())
            blocks.append(f'{cls.OPEN}\n<invoke name="{name}">\n{params}</invoke>\n{cls.CLOSE}')
        return "\n".join(blocks)
