"""DeepSeek-V4 tool calls (``deepseek_v4``; the DSML markup of the checkpoint's ``encoding/encoding_dsv4.py``, the
format vLLM's ``deepseek_v4`` parser reads). One block holds a turn's calls::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"``: the value is the text itself; ``string="false"``: JSON (text that is not JSON is typed by the
tool's parameter schema, :func:`~ferrylm.server.text.tool_parsers.block.coerce_value`). The prompt side is the
built-in template ``server/text/templates/deepseek_v4.jinja``. This module must not import torch.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ferrylm.server.text.tool_parsers.base import ToolCall, cut_arguments
from ferrylm.server.text.tool_parsers.block import BlockToolParser, coerce_value, leading, match_all, object_args

DSML = "\uff5cDSML\uff5c"
CALLS_BEGIN, CALLS_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAMETER, PARAMETER_END = f"<{DSML}parameter", f"</{DSML}parameter>"

_D = re.escape(DSML)
_INVOKE = re.compile(rf'\s*<{_D}invoke name="([^"<>]*)">(.*?)</{_D}invoke>', re.S)
_HEAD = re.compile(rf'\s*<{_D}invoke name="([^"<>]*)">')
_PARAM = re.compile(rf'\s*<{_D}parameter name="([^"<>]*)" string="(true|false)">(.*?)</{_D}parameter>', re.S)


def parameter_text(key: str, value: Any) -> str:
    """One argument as DSML writes it: strings as they are (``string="true"``), anything else as JSON."""
    if isinstance(value, str):
        return f'{PARAMETER} name="{key}" string="true">{value}{PARAMETER_END}'
    return f'{PARAMETER} name="{key}" string="false">{json.dumps(value, ensure_ascii=False)}{PARAMETER_END}'


class DeepSeekV4ToolParser(BlockToolParser):
    """``<｜DSML｜tool_calls>`` blocks of ``invoke`` calls with typed ``parameter`` values (module docstring)."""

    OPEN = CALLS_BEGIN
    CLOSE = CALLS_END
    LEAD = INVOKE
    # the vocabulary may hold the marker alone or with its angle bracket as a special token: either keeps the
    # turn's special tokens in its text
    MARKUP = (CALLS_BEGIN, CALLS_END, DSML, f"<{DSML}", f"</{DSML}")
    TEMPLATE_MARK = re.escape(DSML)
    ONE_SECTION = True

    def parse_block(self, body: str) -> list[ToolCall] | None:
        invokes = match_all(_INVOKE, body)
        if not invokes or not invokes[0]:
            return None
        calls = []
        for m in invokes[0]:
            params = match_all(_PARAM, m[2])
            args = self._arguments(m[1], params[0]) if params is not None else None
            if args is None:
                return None
            calls.append(ToolCall(m[1], json.dumps(args, ensure_ascii=False)))
        return calls

    def cut_calls(self, body: str) -> list[ToolCall]:
        """The whole invokes, then the unfinished one once its ``invoke name=...`` is whole, with its whole
        parameters."""
        invokes, pos = leading(_INVOKE, body)
        calls = (self.parse_block(body[:pos]) or []) if invokes else []
        head = _HEAD.match(body, pos)
        if head is not None:
            args = self._arguments(head[1], leading(_PARAM, body, head.end())[0])
            if args is not None:
                calls.append(ToolCall(head[1], cut_arguments(args), complete=False))
        return calls

    def _arguments(self, name: str, params: list[re.Match]) -> dict[str, Any] | None:
        """The arguments of a call of ``name`` from its parameter matches; None for an unknown tool or a key given
        twice."""
        if not self.known(name):
            return None
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for p in params:
            key, literal, text = p[1], p[2] == "true", p[3]
            if key in args:
                return None
            args[key] = text if literal else _json_value(text, props.get(key))
        return args

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        invokes = [f'{INVOKE} name="{name}">\n' + "\n".join(parameter_text(k, v) for k, v in args.items())
                   + f"\n{INVOKE_END}" for name, args, _ in object_args(calls)]
        return f"{CALLS_BEGIN}\n" + "\n".join(invokes) + f"\n{CALLS_END}"


def _json_value(text: str, schema: Any) -> Any:
    """A ``string="false"`` value: its JSON, else the text typed by the parameter's ``schema``."""
    try:
        return json.loads(text)
    except ValueError:
        return coerce_value(text, schema)
