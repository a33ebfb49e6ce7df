"""Kimi-K2 tool calls (``kimi_k2``), as Moonshot's chat template writes them: one section, each call named by an id
``functions.NAME:IDX`` (IDX counts the calls of the conversation) and given JSON arguments (written here one tag a
line; the model writes them back to back)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    <|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{"q": "x"}<|tool_call_end|>
    <|tool_calls_section_end|>

Blanks between the tags are allowed, and the ``functions.`` prefix may be missing. The call keeps the model's id as
its ``id`` (the template writes ``tool_call.id`` back into the history, so the model sees its own ids again). The
arguments must be a JSON object (a JSON string holding one is accepted); a section becomes calls only once
``<|tool_calls_section_end|>`` is seen and every call in it is well formed and names a tool of the request, else
the whole section is text.

This module must not import torch.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ferrylm.server.text.tool_parsers.base import ToolCall
from ferrylm.server.text.tool_parsers.block import CallListParser, object_args, strip_tail

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
#: the tags of the format (``ToolParser.MARKUP``)
MARKUP = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)
#: the prefix of a call id
PREFIX = "functions."

_CALL = re.compile(rf"\s*{re.escape(CALL_BEGIN)}\s*((?:functions\.)?([A-Za-z0-9_.\-]+):(\d+))\s*"
                   rf"{re.escape(ARGS_BEGIN)}(.*?){re.escape(CALL_END)}", re.S)
_CUT_CALL = re.compile(rf"\s*{re.escape(CALL_BEGIN)}\s*((?:functions\.)?([A-Za-z0-9_.\-]+):(\d+))\s*"
                       rf"{re.escape(ARGS_BEGIN)}(.*)", re.S)
_ID = re.compile(r"functions\.([A-Za-z0-9_.\-]+):(\d+)")


def _kimi_id(written: str) -> str:
    """A call's id as the model wrote it, with the ``functions.`` prefix."""
    return written if written.startswith(PREFIX) else f"{PREFIX}{written}"


class KimiK2ToolParser(CallListParser):
    """``<|tool_calls_section_begin|>`` sections of ``functions.NAME:IDX`` calls (module docstring)."""

    OPEN = SECTION_BEGIN
    CLOSE = SECTION_END
    LEAD = CALL_BEGIN
    MARKUP = MARKUP
    TEMPLATE_MARK = re.escape(SECTION_BEGIN) + "|" + re.escape(CALL_BEGIN)
    ONE_SECTION = True
    CALL = _CALL
    CUT = _CUT_CALL

    def whole_call(self, m: re.Match) -> ToolCall | None:
        return self.tools.json_call(m[2], m[4], _kimi_id(m[1]))

    def open_call(self, m: re.Match) -> ToolCall | None:
        """The call once its arguments began."""
        return self.tools.json_cut(m[2], strip_tail(m[4], CALL_END), _kimi_id(m[1]))

    @classmethod
    def render_calls(cls, calls: list[tuple[Any, Any, Any]]) -> str:
        return render_calls(object_args(calls))


def call_id(name: str, given: object, index: int) -> str:
    """The id an earlier call is rendered with: the client's id when it is a Kimi id of that function (the one
    this parser gave it), else ``functions.NAME:INDEX``."""
    m = _ID.fullmatch(given) if isinstance(given, str) else None
    return given if m is not None and m[1] == name else f"{PREFIX}{name}:{index}"  # type: ignore[return-value]


def render_calls(calls: list[tuple[str, object, object]], start: int = 0) -> str:
    """Earlier calls ``(name, arguments, id)`` as one section; calls without a Kimi id are numbered from
    ``start``."""
    items = "".join(f"{CALL_BEGIN}{call_id(name, cid, start + i)}{ARGS_BEGIN}{json.dumps(args, ensure_ascii=False)}"
                    f"{CALL_END}" for i, (name, args, cid) in enumerate(calls))
    return f"{SECTION_BEGIN}{items}{SECTION_END}"
