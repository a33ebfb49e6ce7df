"""Tool-call output formats besides Hermes behind the :class:`~ferrylm.server.text.tools.ToolParser` interface, the choice
of format for a served model (``--tool-call-parser``, vLLM's flag and names) and the rendering of earlier calls in
each format (:func:`format_calls_as`, :func:`fallback_footer`: the fallback tools section of ``tools.py``).

GLM-4.5 and MiniMax-M2 are here; DeepSeek-V3 (``deepseek_v3``), Kimi-K2 (``kimi_k2``) and Qwen3-Coder
(``qwen3_coder``) have a module each in :mod:`ferrylm.server.text.tool_parsers`, as does the loop they all share
(:class:`~ferrylm.server.text.tool_parsers.block.BlockToolParser`).

GLM-4.5 / 4.6 (``glm45``; the format of zai-org's chat template and of vLLM's ``glm45`` parser)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

MiniMax-M2 (``minimax_m2``; MiniMax's chat template and vLLM's ``minimax_m2`` parser), several calls per block::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Argument values are text; each becomes a JSON value by the tool's parameter schema (:func:`coerce_value`): a
``string`` property keeps the text, any other type is read as JSON (the templates write non-strings with
``tojson``), and text that is not JSON stays a string. A block becomes calls only once its closing tag is seen and
its whole body has the format's shape, naming tools of the request; anything else is released as ordinary text, so
text that only mentions a tag is never swallowed. Decisions depend on the text only, never on its chunking.

This module must not import torch.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from ferrylm.server.text.tool_parsers import deepseek_v3, kimi_k2, qwen3_coder
from ferrylm.server.text.tool_parsers.block import (BlockToolParser, coerce_value, match_all, strip_newline,
                                               value_text)
from ferrylm.server.text.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from ferrylm.server.text.tool_parsers.kimi_k2 import KimiK2ToolParser
from ferrylm.server.text.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from ferrylm.server.text.tools import HermesToolParser, ToolCall, ToolParser

__all__ = ["BlockToolParser", "DeepSeekV3ToolParser", "Glm45ToolParser", "KimiK2ToolParser", "MiniMaxM2ToolParser",
           "Qwen3CoderToolParser", "choose_tool_parser", "coerce_value", "fallback_footer", "format_call_as",
           "format_calls_as", "make_tool_parser"]

TOOL_PARSER_NAMES = ("hermes", "glm45", "minimax_m2", "deepseek_v3", "kimi_k2", "qwen3_coder")
#: vLLM's other names for the same formats (its V3.1 parser; its XML variant of Qwen3-Coder's): accepted by
#: ``--tool-call-parser``, served by the parser they name here
TOOL_PARSER_ALIASES = {"deepseek_v31": "deepseek_v3", "qwen3_xml": "qwen3_coder"}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSER_NAMES, *TOOL_PARSER_ALIASES)
_ARCH_PARSERS = {"Glm4MoeForCausalLM": "glm45", "MiniMaxM2ForCausalLM": "minimax_m2",
                 "DeepseekV3ForCausalLM": "deepseek_v3", "Qwen3NextForCausalLM": "qwen3_coder",
                 "Qwen3_5MoeForCausalLM": "qwen3_coder"}
#: ``config.json`` ``model_type`` values whose format differs from their architecture's (Kimi-K2 is a
#: ``DeepseekV3ForCausalLM``)
_MODEL_TYPE_PARSERS = {"kimi_k2": "kimi_k2"}


_GLM_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45ToolParser(BlockToolParser):
    """GLM-4.5 ``<tool_call>name`` + ``<arg_key>`` / ``<arg_value>`` pairs (module docstring); one call a block."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

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
        call = self._call(name, pairs)
        return None if call is None else [call]


_MM_INVOKE = re.compile(r"\s*<invoke name=(\"[^\"<>]*\"|'[^'<>]*'|[^\s<>]+)>(.*?)</invoke>", re.S)
_MM_PARAM = re.compile(r"\s*<parameter name=(\"[^\"<>]*\"|'[^'<>]*'|[^\s<>]+)>(.*?)</parameter>", re.S)


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'" else s


class MiniMaxM2ToolParser(BlockToolParser):
    """MiniMax-M2 ``<minimax:tool_call>`` blocks of ``<invoke name=...>`` calls with ``<parameter name=...>``
    values (module docstring)."""

    OPEN = "<minimax:tool_call>"
    CLOSE = "</minimax:tool_call>"
    LEAD = "<invoke"

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


#: the tags each format's calls are written with (when the vocabulary has them as *special* tokens, a chat turn
#: is detokenized with ``skip_special_tokens`` off, or they would vanish before the parser sees them)
FORMAT_MARKUP: dict[str, tuple[str, ...]] = {
    "hermes": (HermesToolParser.OPEN, HermesToolParser.CLOSE),
    "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "deepseek_v3": deepseek_v3.MARKUP,
    "kimi_k2": kimi_k2.MARKUP,
    "qwen3_coder": qwen3_coder.MARKUP,
}


def _fields(call: Any) -> tuple[Any, Any, Any]:
    """``(name, arguments, id)`` of an earlier call (OpenAI ``tool_calls`` entry); arguments that are not an object
    become ``{"arguments": value}``."""
    from ferrylm.server.text.tools import call_fields

    name, args = call_fields(call)
    return name, args if isinstance(args, dict) else {"arguments": args}, \
        call.get("id") if isinstance(call, dict) else None


def format_calls_as(fmt: str, calls: list[Any]) -> str:
    """Earlier calls (OpenAI ``tool_calls`` entries) of one assistant turn as the markup of format ``fmt`` (not
    ``hermes``: :func:`ferrylm.server.text.tools.format_call`), the text the format's parser reads back: one section
    for the formats that group calls (``deepseek_v3``, ``kimi_k2``), else one block per call, a newline apart."""
    fields = [_fields(c) for c in calls]
    if fmt == "deepseek_v3":
        return deepseek_v3.render_calls([(n, a) for n, a, _ in fields])
    if fmt == "kimi_k2":
        return kimi_k2.render_calls(fields)
    blocks = []
    for name, args, _ in fields:
        if fmt == "glm45":
            blocks.append(f"<tool_call>{name}\n" + "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{value_text(v)}</arg_value>\n" for k, v in args.items()) +
                "</tool_call>")
        elif fmt == "minimax_m2":
            params = "".join(f'<parameter name="{k}">{value_text(v)}</parameter>\n' for k, v in args.items())
            blocks.append(f'<minimax:tool_call>\n<invoke name="{name}">\n{params}</invoke>\n</minimax:tool_call>')
        elif fmt == "qwen3_coder":
            blocks.append(qwen3_coder.render_call(name, list(args.items())))
        else:
            raise ValueError(f"no call rendering for format {fmt!r}")
    return "\n".join(blocks)


def format_call_as(fmt: str, call: Any) -> str:
    """One earlier call (OpenAI ``tool_calls`` entry) as the markup of format ``fmt`` (:func:`format_calls_as`)."""
    return format_calls_as(fmt, [call])


def fallback_footer(fmt: str) -> str:
    """The call-format instructions of the fallback tools section (``tools.fallback_messages``) for ``fmt``."""
    example = format_call_as(fmt, {"name": "<function name>", "arguments": {"<parameter>": "<value>"}})
    if fmt in ("deepseek_v3", "kimi_k2"):
        return ("\n</tools>\n\nTo call functions, answer with one section holding one entry per call, of the "
                "form\n" + example + "\nwith the arguments as one JSON object.")
    return ("\n</tools>\n\nTo call a function, answer with one block per call, each of the form\n" + example +
            "\nwith one parameter entry per argument (strings as they are, other values as JSON).")


PARSER_CLASSES: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "glm45": Glm45ToolParser,
                                               "minimax_m2": MiniMaxM2ToolParser, "deepseek_v3": DeepSeekV3ToolParser,
                                               "kimi_k2": KimiK2ToolParser, "qwen3_coder": Qwen3CoderToolParser}


def make_tool_parser(name: str, tool_names: Iterable[str] | None,
                     schemas: Mapping[str, dict] | None = None) -> ToolParser:
    """A fresh parser of format ``name`` (:data:`TOOL_PARSER_NAMES`). Raises ValueError for an unknown name."""
    if name == "hermes":
        return HermesToolParser(tool_names)
    cls = PARSER_CLASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(TOOL_PARSER_CHOICES)}")
    return cls(tool_names, schemas)


#: what a chat template writes that names its call format, checked in this order (Qwen3-Coder's and GLM's
#: templates also write ``<tool_call>``, so Hermes' JSON instructions come last)
_TEMPLATE_MARKS: tuple[tuple[str, re.Pattern], ...] = (
    ("minimax_m2", re.compile(re.escape(MiniMaxM2ToolParser.OPEN))),
    ("glm45", re.compile(re.escape("<arg_key>"))),
    ("qwen3_coder", re.compile(re.escape(qwen3_coder.PARAMETER))),   # <function= alone: Llama 3.1 prompt guides
    ("kimi_k2", re.compile(re.escape(kimi_k2.SECTION_BEGIN) + "|" + re.escape(kimi_k2.CALL_BEGIN))),
    ("deepseek_v3", re.compile("<\uff5ctool[\u2581 ]calls?[\u2581 ]begin\uff5c>")),
    ("hermes", re.compile(r'<tool_call>(?:\\n|\s)*\{\\?"name\\?"')),
)


def template_format(chat_template: Any) -> str | None:
    """The call format a chat template (a string, or a dict of named templates) writes, or None when it shows
    none (:data:`_TEMPLATE_MARKS`)."""
    texts = list(chat_template.values()) if isinstance(chat_template, dict) else [chat_template]
    texts = [t for t in texts if isinstance(t, str)]
    for fmt, mark in _TEMPLATE_MARKS:
        if any(mark.search(t) for t in texts):
            return fmt
    return None


def choose_tool_parser(flag: str | None, architecture: str | None = None, chat_template: Any = None,
                       model_type: str | None = None) -> str:
    """The tool-call format of a served model: ``flag`` (``--tool-call-parser``; an alias of
    :data:`TOOL_PARSER_ALIASES` gives the format it names) unless it is ``auto`` / None;
    then the chat template's own markup (:func:`template_format`: ``<minimax:tool_call>`` → ``minimax_m2``,
    ``<arg_key>`` → ``glm45``, ``<parameter=`` → ``qwen3_coder``, ``<|tool_calls_section_begin|>`` → ``kimi_k2``,
    ``<｜tool▁calls▁begin｜>`` → ``deepseek_v3``, Hermes' ``<tool_call>{"name": ...`` → ``hermes``), then the
    config's ``model_type`` (``kimi_k2``), then the architecture (:data:`_ARCH_PARSERS`), else ``hermes``.

    Raises:
        ValueError: ``flag`` is not one of :data:`TOOL_PARSER_CHOICES`.
    """
    if flag not in (None, *TOOL_PARSER_CHOICES):
        raise ValueError(f"unknown tool-call parser {flag!r}; choose from {', '.join(TOOL_PARSER_CHOICES)}")
    if flag not in (None, "auto"):
        return TOOL_PARSER_ALIASES.get(flag, flag)
    return (template_format(chat_template) or _MODEL_TYPE_PARSERS.get(model_type or "")
            or _ARCH_PARSERS.get(architecture or "", "hermes"))
