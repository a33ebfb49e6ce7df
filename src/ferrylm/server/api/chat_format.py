"""How the served model speaks a chat turn, chosen once at start: harmony or a chat template, the tool-call format,
a ``<think>`` split, and markup the vocabulary holds as special tokens. The app holds one (``app.py``); the request
preparation (``prepare.py``) and the route modules read it.

This module must not import torch.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from ferrylm.server.text.harmony import HarmonyCodec
from ferrylm.server.text.reasoning import template_has_reasoning
from ferrylm.server.text.tokenizer import TextCodec
from ferrylm.server.text.tool_parsers import choose_tool_parser, format_markup
from ferrylm.server.text.tools import lark_term, tag_terms

logger = logging.getLogger("ferrylm.server")


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """How the served model speaks a chat turn.

    Attributes:
        harmony: gpt-oss: harmony renders the prompt and the output is read by channel (server/text/harmony*.py);
            None for a chat template.
        native_tools: the chat template renders ``tools`` itself (else the fallback system turn).
        reasoning: the template thinks first: the output is split at ``<think>`` … ``</think>``.
        tool_tags / tool_term: the Hermes tags' Lark terms, and any tag's, as the vocabulary has them.
        tool_parser: the call format (a name of ``server/text/tool_parsers.TOOL_PARSERS``, or ``harmony``).
        special_tool_markup / special_think_markup: the vocabulary holds the call / think markup as special tokens
            (GLM-4.5's ``<tool_call>``, ``<arg_key>``, ``<think>``): such a turn is detokenized with
            ``skip_special_tokens`` off, else the parsers would never see it.
    """

    harmony: HarmonyCodec | None
    native_tools: bool
    reasoning: bool
    tool_tags: Any
    tool_term: Callable[[str], str]
    tool_parser: str
    special_tool_markup: bool
    special_think_markup: bool

    @classmethod
    def choose(cls, codec: TextCodec, tool_call_parser: str = "auto", architecture: str | None = None,
               model_type: str | None = None) -> "ChatFormat":
        """The format of ``codec``'s model (``tool_call_parser``: ``--tool-call-parser``; ``architecture`` and
        ``model_type`` for its ``auto`` choice). Logs the choice. Raises ValueError for an unknown parser name."""
        template = getattr(codec, "chat_template", None)
        harmony = codec if isinstance(codec, HarmonyCodec) else None
        reasoning = template_has_reasoning(template) and harmony is None
        tool_parser = choose_tool_parser(tool_call_parser, architecture, template, model_type)
        special = frozenset(getattr(codec, "special_strings", ()) or ())
        special_tool_markup = any(m in special for m in format_markup(tool_parser))
        if harmony is not None:
            if tool_call_parser not in (None, "auto"):
                logger.warning("--tool-call-parser %s is not used: this model speaks harmony", tool_call_parser)
            tool_parser, special_tool_markup = "harmony", False
            logger.info("chat format: harmony (openai-harmony renders the prompt; the output is read by channel)")
        else:
            logger.info("tool-call format: %s", tool_parser)
            if architecture == "GptOssForCausalLM":
                logger.warning("gpt-oss with a tokenizer that is not harmony's: chat goes through its chat template")
        return cls(harmony=harmony, native_tools=codec.renders_tools, reasoning=reasoning,
                   tool_tags=tag_terms(codec), tool_term=lark_term(codec), tool_parser=tool_parser,
                   special_tool_markup=special_tool_markup,
                   special_think_markup=reasoning and any(m in special for m in ("<think>", "</think>")))
