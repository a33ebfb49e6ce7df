"""Forced tool calls (``tool_choice: "required"`` or a named function) in the GLM-4.5 and MiniMax-M2 formats: Lark
grammars (llguidance) that emit exactly the markup :mod:`ferrylm.server.tool_formats` parses, with OpenAI's strict
semantics for the arguments: every ``required`` key present, only keys the schema's ``properties`` name (as if
``additionalProperties`` were false), each value of its property's type. So a forced call always closes and parses.

Keys come in the schema's ``properties`` order, the optional ones skippable. Values: a ``string`` property is free
text without ``<`` (the formats end a value at the next tag), or one of its ``enum``; every other property is JSON
valid against its schema (``%json``, llguidance's JSON-schema lexer; keywords it cannot enforce are ignored, as
for Hermes' forced calls; nested objects get ``additionalProperties: false`` unless they say otherwise,
:func:`ferrylm.server.tools.strict_schema`). A schema without ``properties`` admits no arguments. A ``required``
reply holds at most ``MAX_FORCED_CALLS`` calls. The Hermes format's grammar is
:func:`ferrylm.server.tools.tool_call_grammar`.

This module must not import torch.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ferrylm.errors import InvalidRequest
from ferrylm.server.structured import JSON_OPTIONS, lark_grammar
from ferrylm.server.tools import MAX_FORCED_CALLS, ToolChoice, ToolSpec, strict_schema

Term = Callable[[str], str]  # text -> its Lark term (a literal, or an added token ``<[id]>``; tools.lark_term)


def _literal(text: str) -> str:
    return json.dumps(text)


def _value_rule(schema: Any) -> str:
    """The Lark expansion of one argument value (module docstring)."""
    schema = schema if isinstance(schema, dict) else {}
    types = schema.get("type")
    if types == "string" or (isinstance(types, list) and types == ["string"]):
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(e, str) and "<" not in e for e in enum):
            return " | ".join(_literal(e) for e in enum)
        return r"/[^<]*/"
    return "%json" + json.dumps({**strict_schema(schema), "x-guidance": {**JSON_OPTIONS, "lenient": True}})


def _arguments(tool: ToolSpec, prefix: str, pair: Callable[[str, str], str], rules: list[str]) -> str:
    """Rules for the key/value pairs of ``tool`` (one rule per key, optional keys ``?``); returns the sequence."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    missing = required - set(props)
    if missing:
        raise InvalidRequest(f"tool {tool.name!r}: required parameter {sorted(missing)[0]!r} is not among its "
                             f"'properties', so a forced call cannot give it", param="tools")
    seq = []
    for j, (key, sub) in enumerate(props.items()):
        name = f"{prefix}_k{j}"
        rules.append(f"{name}: {pair(key, _value_rule(sub))}")
        seq.append(name if key in required else f"{name}?")
    return " ".join(seq)


def _chosen(tools: list[ToolSpec], choice: ToolChoice) -> list[ToolSpec]:
    return [t for t in tools if choice.mode == "required" or t.name == choice.name]


def glm45_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str:
    """``<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>``; ``required`` with
    parallel calls allows several blocks, one per line."""
    t_open, t_close = term("<tool_call>"), term("</tool_call>")
    k_open, k_close, v_open, v_close = (term(x) for x in ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))
    rules: list[str] = []
    alts = []
    for i, tool in enumerate(_chosen(tools, choice)):
        def pair(key: str, value: str) -> str:
            return f'{k_open} {_literal(key)} {k_close} "\\n" {v_open} ({value}) {v_close} "\\n"'
        args = _arguments(tool, f"t{i}", pair, rules)
        rules.append(f'c{i}: {t_open} {_literal(tool.name)} "\\n" {args} {t_close}')
        alts.append(f"c{i}")
    repeat = f' ("\\n" call){{0,{MAX_FORCED_CALLS - 1}}}' if choice.mode == "required" and choice.parallel else ""
    lark = "\n".join([f"start: call{repeat}", f"call: {' | '.join(alts)}", *rules]) + "\n"
    return lark_grammar(lark, "tools")


def minimax_m2_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str:
    """``<minimax:tool_call>\\n<invoke name="f">\\n<parameter name="k">v</parameter>\\n...</invoke>\\n
    </minimax:tool_call>``; ``required`` with parallel calls allows several invokes in the block."""
    b_open, b_close = term("<minimax:tool_call>"), term("</minimax:tool_call>")
    rules: list[str] = []
    alts = []
    for i, tool in enumerate(_chosen(tools, choice)):
        def pair(key: str, value: str) -> str:
            return f'{_literal(f"<parameter name={json.dumps(key)}>")} ({value}) "</parameter>" "\\n"'
        args = _arguments(tool, f"t{i}", pair, rules)
        rules.append(f'i{i}: {_literal(f"<invoke name={json.dumps(tool.name)}>")} "\\n" {args} "</invoke>"')
        alts.append(f"i{i}")
    repeat = f' ("\\n" invoke){{0,{MAX_FORCED_CALLS - 1}}}' if choice.mode == "required" and choice.parallel else ""
    lark = "\n".join([f'start: {b_open} "\\n" invoke{repeat} "\\n" {b_close}', f"invoke: {' | '.join(alts)}",
                      *rules]) + "\n"
    return lark_grammar(lark, "tools")


GRAMMARS = {"glm45": glm45_grammar, "minimax_m2": minimax_m2_grammar}


def forced_call_grammar(fmt: str, tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str | None:
    """The forcing grammar of format ``fmt`` (``glm45`` | ``minimax_m2``) for ``choice``; None unless the choice
    forces a call. Raises InvalidRequest when a schema cannot be enforced, ValueError for another format."""
    if not choice.forced:
        return None
    if fmt not in GRAMMARS:
        raise ValueError(f"no forced-call grammar for format {fmt!r} here (Hermes: tools.tool_call_grammar)")
    return GRAMMARS[fmt](tools, choice, term)
