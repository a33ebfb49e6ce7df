"""GLM-4.5 / 4.6 (``glm45``; the format of zai-org's chat template and of vLLM's ``glm45`` parser)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

Values are typed by the tool's parameter schema (:func:`~ferrylm.server.text.tool_parsers.calls.coerce_value`).
"""

from __future__ import annotations

import re
from typing import Any

from ferrylm.server.text.tool_parsers.base import ToolCall
from ferrylm.server.text.tool_parsers.block import BlockToolParser, leading, object_args, value_text

_GLM_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45ToolParser(BlockToolParser):
    """GLM-4.5 ``<tool_call>name`` + ``<arg_key>`` / ``<arg_value>`` pairs (module docstring); one call a block."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    MARKUP = (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    TEMPLATE_MARK = re.escape("<arg_key>")

    def viable(self, body: str) -> bool:
        """The body starts with a function name that ends at a newline or a tag."""
        end = _GLM_NAME.match(body).end()
        return end == len(body) or body[end] in "\n<"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        name_end = _GLM_NAME.match(body).end()
        name, rest = body[:name_end], body[name_end:]
        if not name:
            return None
        pairs, pos = [], 0
        while True:
            m = _GLM_PAIR.match(rest, pos)
            if m is None:
                break
            pairs.append((m[1].strip(), m[2]))
            pos = m.end()
        if rest[pos:].strip():
            return None
        call = self.tools.call(name, self.tools.arguments(name, pairs))
        return None if call is None else [call]

    def cut_calls(self, body: str) -> list[ToolCall]:
        """The unfinished call once its name line is whole, with the whole key/value pairs."""
        end = _GLM_NAME.match(body).end()
        if end == len(body):
            return []
        name, pairs = body[:end], [(m[1].strip(), m[2]) for m in leading(_GLM_PAIR, body, end)[0]]
        call = self.tools.cut_call(name, self.tools.arguments(name, pairs))
        return [call] if call is not None else []

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        return "\n".join(f"{cls.OPEN}{name}\n" + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{value_text(v)}</arg_value>\n" for k, v in args.items()) + cls.CLOSE
            for name, args, _ in object_args(calls))
