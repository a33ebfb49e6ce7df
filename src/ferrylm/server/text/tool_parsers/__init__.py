"""Tool-call formats: one :class:`~ferrylm.server.text.tool_parsers.base.ToolParser` subclass per format, named in
:data:`TOOL_PARSERS` (``--tool-call-parser``, vLLM's flag and names); the choice of format for a served model
(:func:`choose_tool_parser`) and earlier calls written back in a format (:func:`format_calls_as`,
:func:`fallback_footer`: the fallback tools section of ``server/text/tools.py``).

- ``base.py``: the parser interface and what every format shares.
- ``calls.py``: call assembly (the request's tools, typed arguments, ``ToolCall`` objects and their ids).
- ``block.py``: the loop every format shares (a block held to its closing tag), and the skeletons of the formats
  that list a turn's calls in one block.
- ``hermes.py``: Hermes / Qwen ``<tool_call>`` JSON blocks.
- ``glm45.py``, ``minimax_m2.py``, ``deepseek_v3.py``, ``kimi_k2.py``, ``qwen3_coder.py``, ``deepseek_v4.py``,
  ``deepseek_v32.py``: one module per format.
- ``grammars.py``: the forced-call grammars of the tag-delimited formats (Hermes': ``tools.tool_call_grammar``).

Nothing here imports torch.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from ferrylm.registry import Registry
from ferrylm.server.text.tool_parsers.base import ToolParser, call_items

_P = "ferrylm.server.text.tool_parsers"
TOOL_PARSERS: Registry[type[ToolParser]] = Registry("--tool-call-parser", {
    "hermes": f"{_P}.hermes:HermesToolParser",
    "glm45": f"{_P}.glm45:Glm45ToolParser",
    "minimax_m2": f"{_P}.minimax_m2:MiniMaxM2ToolParser",
    "deepseek_v3": f"{_P}.deepseek_v3:DeepSeekV3ToolParser",
    "kimi_k2": f"{_P}.kimi_k2:KimiK2ToolParser",
    "qwen3_coder": f"{_P}.qwen3_coder:Qwen3CoderToolParser",
    "deepseek_v4": f"{_P}.deepseek_v4:DeepSeekV4ToolParser",
    "deepseek_v32": f"{_P}.deepseek_v32:DeepSeekV32ToolParser",
})
#: vLLM's other names for the same formats (its V3.1 parser; its XML variant of Qwen3-Coder's): accepted by
#: ``--tool-call-parser``, served by the parser they name here
TOOL_PARSER_ALIASES = {"deepseek_v31": "deepseek_v3", "qwen3_xml": "qwen3_coder"}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS.names, *TOOL_PARSER_ALIASES)
_ARCH_PARSERS = {"Glm4MoeForCausalLM": "glm45", "MiniMaxM2ForCausalLM": "minimax_m2",
                 "DeepseekV3ForCausalLM": "deepseek_v3", "Qwen3NextForCausalLM": "qwen3_coder",
                 "Qwen3_5MoeForCausalLM": "qwen3_coder", "Qwen4ExpForCausalLM": "qwen3_coder",
                 "DeepseekV4ForCausalLM": "deepseek_v4", "DeepseekV32ForCausalLM": "deepseek_v32"}
#: ``config.json`` ``model_type`` values whose format may differ from their architecture's (Kimi-K2 is a
#: ``DeepseekV3ForCausalLM``)
_MODEL_TYPE_PARSERS = {"kimi_k2": "kimi_k2", "deepseek_v32": "deepseek_v32"}
#: the order chat templates are checked in (Qwen3-Coder's and GLM's templates also write ``<tool_call>``, so
#: Hermes' JSON instructions come last; a V3.2 template's DSML ``function_calls`` before V4's DSML)
_TEMPLATE_ORDER = ("minimax_m2", "glm45", "qwen3_coder", "kimi_k2", "deepseek_v3", "deepseek_v32", "deepseek_v4",
                   "hermes")


def make_tool_parser(name: str, tool_names: Iterable[str] | None,
                     schemas: Mapping[str, dict] | None = None) -> ToolParser:
    """A fresh parser of format ``name`` (:data:`TOOL_PARSERS`). Raises ValueError for an unknown name."""
    return TOOL_PARSERS.get(name)(tool_names, schemas)


def format_markup(name: str) -> tuple[str, ...]:
    """The tags format ``name``'s calls are written with (``ToolParser.MARKUP``)."""
    return TOOL_PARSERS.get(name).MARKUP


def format_calls_as(fmt: str, calls: list[Any]) -> str:
    """Earlier calls (OpenAI ``tool_calls`` entries) of one assistant turn as the markup of format ``fmt``, the text
    the format's parser reads back: one section for the formats that group calls (``deepseek_v3``, ``kimi_k2``),
    else one block per call, a newline apart."""
    return TOOL_PARSERS.get(fmt).render_calls(call_items(calls))


def format_call_as(fmt: str, call: Any) -> str:
    """One earlier call (OpenAI ``tool_calls`` entry) as the markup of format ``fmt`` (:func:`format_calls_as`)."""
    return format_calls_as(fmt, [call])


def fallback_footer(fmt: str) -> str:
    """The call-format instructions of the fallback tools section (``tools.fallback_messages``) for ``fmt``."""
    if fmt == "hermes":
        return ("\n</tools>\n\nTo call a function, answer with one line per call, each of the form\n"
                "<tool_call>\n{\"name\": <function name>, \"arguments\": <JSON object of arguments>}\n</tool_call>")
    example = format_call_as(fmt, {"name": "<function name>", "arguments": {"<parameter>": "<value>"}})
    if TOOL_PARSERS.get(fmt).ONE_SECTION:
        return ("\n</tools>\n\nTo call functions, answer with one section holding one entry per call, of the "
                "form\n" + example + "\nwith the arguments as one JSON object.")
    return ("\n</tools>\n\nTo call a function, answer with one block per call, each of the form\n" + example +
            "\nwith one parameter entry per argument (strings as they are, other values as JSON).")


def template_format(chat_template: Any) -> str | None:
    """The call format a chat template (a string, or a dict of named templates) writes, or None when it shows
    none (each format's ``TEMPLATE_MARK``, in :data:`_TEMPLATE_ORDER`)."""
    texts = list(chat_template.values()) if isinstance(chat_template, dict) else [chat_template]
    texts = [t for t in texts if isinstance(t, str)]
    for fmt in _TEMPLATE_ORDER:
        mark = re.compile(TOOL_PARSERS.get(fmt).TEMPLATE_MARK)
        if any(mark.search(t) for t in texts):
            return fmt
    return None


def choose_tool_parser(flag: str | None, architecture: str | None = None, chat_template: Any = None,
                       model_type: str | None = None) -> str:
    """The tool-call format of a served model: ``flag`` (``--tool-call-parser``; an alias of
    :data:`TOOL_PARSER_ALIASES` gives the format it names) unless it is ``auto`` / None;
    then the chat template's own markup (:func:`template_format`: ``<minimax:tool_call>`` → ``minimax_m2``,
    ``<arg_key>`` → ``glm45``, ``<parameter=`` → ``qwen3_coder``, ``<|tool_calls_section_begin|>`` → ``kimi_k2``,
    ``<｜tool▁calls▁begin｜>`` → ``deepseek_v3``, ``｜DSML｜`` with ``function_calls`` → ``deepseek_v32``, other
    ``｜DSML｜`` → ``deepseek_v4``, Hermes' ``<tool_call>{"name": ...`` → ``hermes``), then the config's
    ``model_type`` (``kimi_k2``, ``deepseek_v32``), then the architecture (:data:`_ARCH_PARSERS`), else ``hermes``.

    Raises:
        ValueError: ``flag`` is not one of :data:`TOOL_PARSER_CHOICES`.
    """
    if flag is not None:
        TOOL_PARSERS.check(flag, extra=("auto", *TOOL_PARSER_ALIASES))
    if flag not in (None, "auto"):
        return TOOL_PARSER_ALIASES.get(flag, flag)
    return (template_format(chat_template) or _MODEL_TYPE_PARSERS.get(model_type or "")
            or _ARCH_PARSERS.get(architecture or "", "hermes"))
