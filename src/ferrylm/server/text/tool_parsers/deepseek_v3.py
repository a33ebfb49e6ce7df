"""DeepSeek-V3 / V3.1 / R1 tool calls (``deepseek_v3``), as their published chat templates write them.

The tags are single tokens of DeepSeek's vocabulary, spelled with U+FF5C (fullwidth vertical line) and U+2581
(lower one-eighth block). A section holds one or more calls. V3 and R1 name the call's type, then the function,
and fence the JSON arguments (calls on their own lines)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>search
    ```json
    {"q": "x"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 writes the function name first and plain JSON arguments, calls back to back (one a line here)::

    <｜tool▁calls▁begin｜>
    <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁calls▁end｜>

Both are read (a fence around V3.1's arguments too). The arguments must be a JSON object (a JSON string holding
one is accepted); a section becomes calls only once ``<｜tool▁calls▁end｜>`` is seen and every call in it is
well formed and names a tool of the request, else the whole section is text.

This module must not import torch.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ferrylm.server.text.tool_parsers.base import ToolCall
from ferrylm.server.text.tool_parsers.block import CallListParser, object_args, strip_tail, unfence

_BAR, _SP = "\uff5c", "\u2581"


def _tag(words: str) -> str:
    return f"<{_BAR}{words.replace(' ', _SP)}{_BAR}>"


CALLS_BEGIN, CALLS_END = _tag("tool calls begin"), _tag("tool calls end")
CALL_BEGIN, CALL_END, SEP = _tag("tool call begin"), _tag("tool call end"), _tag("tool sep")
#: the tags of the format (``ToolParser.MARKUP``)
MARKUP = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
#: the call type V3 / R1 write before the separator
CALL_TYPE = "function"

_CALL = re.compile(rf"\s*{re.escape(CALL_BEGIN)}(.*?){re.escape(SEP)}(.*?){re.escape(CALL_END)}", re.S)
_CUT_CALL = re.compile(rf"\s*{re.escape(CALL_BEGIN)}(.*?){re.escape(SEP)}(.*)", re.S)
_V3_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)[ \t]*\n")
_FENCE_OPEN, _FENCE_CLOSE = "```json\n", "\n```"
_V3_REST = re.compile(r"\s*([A-Za-z0-9_.\-]+)[ \t]*(?:\n|(?=```))(.*)", re.S)


def split_call(head: str, rest: str) -> tuple[str, str]:
    """``(name, arguments text)`` of one call from the text before and after ``<｜tool▁sep｜>``: V3's ``function``
    type + name line + fenced JSON, else V3.1's name + JSON."""
    head = head.strip()
    if head == CALL_TYPE:
        m = _V3_REST.match(rest)
        if m is not None:
            return m[1], unfence(m[2])
    return head, unfence(rest)


def split_cut_call(head: str, rest: str) -> tuple[str, str] | None:
    """:func:`split_call` of the call the output ended in: ``(name, arguments text so far)`` once the name is whole
    (V3's name line ended), else None."""
    rest = strip_tail(rest, CALL_END)
    if head.strip() != CALL_TYPE:
        return head.strip(), rest
    m = _V3_NAME.match(rest)
    if m is None:
        return None
    args = rest[m.end():]
    if args.startswith(_FENCE_OPEN):
        return m[1], strip_tail(args[len(_FENCE_OPEN):], _FENCE_CLOSE)
    return m[1], "" if _FENCE_OPEN.startswith(args) else args


class DeepSeekV3ToolParser(CallListParser):
    """``<｜tool▁calls▁begin｜>`` sections of V3 / R1 or V3.1 calls (module docstring)."""

    OPEN = CALLS_BEGIN
    CLOSE = CALLS_END
    LEAD = CALL_BEGIN
    MARKUP = MARKUP
    TEMPLATE_MARK = "<\uff5ctool[\u2581 ]calls?[\u2581 ]begin\uff5c>"
    ONE_SECTION = True
    CALL = _CALL
    CUT = _CUT_CALL

    def whole_call(self, m: re.Match) -> ToolCall | None:
        return self.tools.json_call(*split_call(m[1], m[2]))

    def open_call(self, m: re.Match) -> ToolCall | None:
        """The call once its name is whole (:func:`split_cut_call`)."""
        parts = split_cut_call(m[1], m[2])
        return self.tools.json_cut(*parts) if parts is not None else None

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        return render_calls([(name, args) for name, args, _ in object_args(calls)])


def render_calls(calls: list[tuple[str, object]]) -> str:
    """Earlier calls ``(name, arguments)`` as one section in V3's form (the form of the template that leaves tools
    to the fallback; V3.1's template renders its calls itself)."""
    items = "\n".join(f"{CALL_BEGIN}{CALL_TYPE}{SEP}{name}\n```json\n{json.dumps(args, ensure_ascii=False)}\n```"
                      f"{CALL_END}" for name, args in calls)
    return f"{CALLS_BEGIN}{items}{CALLS_END}"
