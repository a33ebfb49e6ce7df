"""DeepSeek-V4 tool calls (``deepseek_v4``; the DSML markup of the checkpoint's ``encoding/encoding_dsv4.py``, the
format vLLM's ``deepseek_v4`` parser reads). One block holds a turn's calls::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"``: the value is the text itself; ``string="false"``: JSON (text that is not JSON is typed by the
tool's parameter schema, :func:`~ferrylm.server.text.tool_parsers.calls.coerce_value`). The prompt side is the
built-in template ``server/text/templates/deepseek_v4.jinja``. This module must not import torch.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ferrylm.server.text.tool_parsers.block import InvokeListParser, object_args
from ferrylm.server.text.tool_parsers.calls import coerce_value

DSML = "\uff5cDSML\uff5c"


def block_tags(name: str) -> tuple[str, str]:
    """The opening and closing tags of a DSML block named ``name``."""
    return f"<{DSML}{name}>", f"</{DSML}{name}>"


CALLS_BEGIN, CALLS_END = block_tags("tool_calls")
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


class DeepSeekV4ToolParser(InvokeListParser):
    """``<｜DSML｜tool_calls>`` blocks of ``invoke`` calls with typed ``parameter`` values (module docstring).
    A DSML format of another block name (DeepSeek-V3.2's) sets ``OPEN`` / ``CLOSE`` from :func:`block_tags`."""

    OPEN = CALLS_BEGIN
    CLOSE = CALLS_END
    LEAD = INVOKE
    # the vocabulary may hold the marker alone or with its angle bracket as a special token: either keeps the
    # turn's special tokens in its text
    MARKUP = (CALLS_BEGIN, CALLS_END, DSML, f"<{DSML}", f"</{DSML}")
    TEMPLATE_MARK = re.escape(DSML)
    ONE_SECTION = True
    CALL, CUT, PARAM = _INVOKE, _HEAD, _PARAM

    def param_key(self, p: re.Match) -> str:
        return p[1]

    def param_value(self, p: re.Match, schema: Any) -> Any:
        """``string="true"``: the text itself; ``"false"``: its JSON, else the text typed by ``schema``."""
        if p[2] == "true":
            return p[3]
        try:
            return json.loads(p[3])
        except (ValueError, RecursionError):
            return coerce_value(p[3], schema)

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        invokes = [f'{INVOKE} name="{name}">\n' + "\n".join(parameter_text(k, v) for k, v in args.items())
                   + f"\n{INVOKE_END}" for name, args, _ in object_args(calls)]
        return f"{cls.OPEN}\n" + "\n".join(invokes) + f"\n{cls.CLOSE}"
