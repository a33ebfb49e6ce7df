"""An output constraint (``response_format``, ``structured_outputs``, ...) on a harmony (gpt-oss) turn: it holds
for the ``final`` message's text only; the ``analysis`` messages before it stay free.

The engine runs one grammar from the first generated token, so the turn's whole shape is one grammar
(:func:`harmony_output_grammar`): an llguidance grammar list whose first grammar is this Lark turn and whose
second is the request's own constraint, referenced as ``@answer``::

    start:    analysis* answer                     (the prompt ends in <|start|>assistant)
    analysis: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"
    answer:   <|channel|> "final" [" " <|constrain|> "json"] <|message|> @answer <|return|>
            | <|channel|> call <|call|>             (only when the request offers tools, tool_choice auto)

``TEXT`` is any text (no control token can be text). A prompt left inside an ``analysis`` message (a continued
assistant message) starts with the rest of that message; a prompt left anywhere else (inside the final message, or
outside any message: a completions prompt of text) gets the request's constraint as it is. A call's arguments are
the tool's schema made strict (``tool_parsers.grammars.harmony_call_rules``). This module must not import torch.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

import openai_harmony as oh

from ferrylm.errors import InvalidRequest
from ferrylm.server.text.harmony import CHANNEL, HarmonyCodec
from ferrylm.server.text.structured import validate
from ferrylm.server.text.tools import ToolSpec

#: where a prompt leaves a harmony turn: at a new message's header, inside an analysis message, elsewhere
HEADER, IN_ANALYSIS, ELSEWHERE = "header", "analysis", "elsewhere"
ANSWER_NAME = "answer"
TURN_NAME = "harmony_turn"


def prompt_position(codec: HarmonyCodec, prime: Sequence[int]) -> str:
    """Where the prompt's open message (``harmony.open_message``) leaves the turn: :data:`HEADER` (right after
    ``<|start|>assistant``), :data:`IN_ANALYSIS` or :data:`ELSEWHERE`."""
    if not prime:
        return ELSEWHERE
    parser = oh.StreamableParser(codec.encoding, None, strict=False)
    try:
        for t in prime:
            parser.process(t)
    except oh.HarmonyError:
        return ELSEWHERE
    if parser.state == oh.StreamState.HEADER and CHANNEL not in prime:
        return HEADER
    if parser.state == oh.StreamState.CONTENT and parser.current_channel == "analysis" \
            and parser.current_recipient is None:
        return IN_ANALYSIS
    return ELSEWHERE


def _answer_grammars(answer: str) -> tuple[list[dict], str, dict]:
    """The request's grammar string (Lark text, or llguidance's grammar list as JSON) as grammar entries, the name
    the turn refers to it by, and the list's other top-level fields."""
    if answer.lstrip().startswith("{"):
        top = json.loads(answer)
        grammars = [dict(g) for g in top.pop("grammars")]
    else:
        top, grammars = {}, [{"lark_grammar": answer}]
    if not grammars[0].get("name"):
        grammars[0]["name"] = ANSWER_NAME
    return grammars, grammars[0]["name"], top


def harmony_output_grammar(answer: str, position: str, param: str, *, tools: list[ToolSpec] | None = None,
                           term: Callable[[str], str] = json.dumps) -> str:
    """The grammar of a harmony turn whose final message is constrained by ``answer`` (module docstring).

    Args:
        answer: the request's grammar (from ``server/text/structured.py``).
        position: :func:`prompt_position` of the prompt; :data:`ELSEWHERE` returns ``answer`` unchanged.
        param: the request field the constraint came from (for errors).
        tools: the request's tools when the turn may call them instead of answering (``tool_choice`` auto).
        term: text -> Lark term with the served vocabulary (``tools.lark_term``: control tokens as ``<[id]>``).

    Raises:
        InvalidRequest: llguidance refuses the combined grammar (naming ``param``).
    """
    if position == ELSEWHERE:
        return answer
    from ferrylm.server.text.tool_parsers.grammars import harmony_call_rules

    start, channel, message, end, return_, constrain = (term(x) for x in (
        "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|constrain|>"))
    grammars, name, top = _answer_grammars(answer)
    reply = [f'{channel} "final" (" " {constrain} "json")? {message} @{name} {return_}']
    rules = []
    if tools:
        reply.append(f"{channel} call {term('<|call|>')}")
        rules = harmony_call_rules(tools, term)
    opening = f'TEXT {end} {start} "assistant" ' if position == IN_ANALYSIS else ""
    lark = "\n".join([f"start: {opening}analysis* reply",
                      f'analysis: {channel} "analysis" {message} TEXT {end} {start} "assistant"',
                      f"reply: {' | '.join(reply)}", *rules, "TEXT: /(?s:.*)/"]) + "\n"
    grammar = json.dumps({**top, "grammars": [{"name": TURN_NAME, "lark_grammar": lark}, *grammars]})
    try:
        return validate(grammar, param)
    except InvalidRequest as e:
        raise InvalidRequest(e.message.split("\n", 1)[0], param=param) from None
