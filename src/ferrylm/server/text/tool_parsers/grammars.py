"""Forced tool calls (``tool_choice: "required"`` or a named function) in the formats of
:mod:`ferrylm.server.text.tool_parsers` (GLM-4.5, MiniMax-M2, DeepSeek-V3, Kimi-K2, Qwen3-Coder, the DSML of
DeepSeek-V4 and V3.2) and harmony's: Lark grammars (llguidance) that emit exactly the markup
:mod:`ferrylm.server.text.tool_parsers` parses, with OpenAI's strict semantics for the arguments: every ``required``
key present, only keys the schema's ``properties`` name (as if ``additionalProperties`` were false), each value of
its property's type. So a forced call always closes and parses.

The JSON formats (DeepSeek, Kimi) take the arguments as one JSON object valid against the tool's schema, made
strict the same way (a schema without ``properties`` admits no keys unless it allows ``additionalProperties``). In the
XML-style formats keys come in the schema's ``properties`` order, the optional ones skippable. Values: a ``string``
property is free text without ``<`` (GLM-4.5, MiniMax-M2: the formats end a value at the next tag; Qwen3-Coder: any
text without ``</parameter>``), or one of its ``enum``; every other property is JSON
valid against its schema (``%json``, llguidance's JSON-schema lexer; keywords it cannot enforce are ignored, as
for Hermes' forced calls; nested objects get ``additionalProperties: false`` unless they say otherwise,
:func:`ferrylm.server.text.tools.strict_schema`). There a schema without ``properties`` admits no arguments. A ``required``
reply holds at most ``MAX_FORCED_CALLS`` calls. The Hermes format's grammar is
:func:`ferrylm.server.text.tools.tool_call_grammar`.

This module must not import torch.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ferrylm.errors import InvalidRequest
from ferrylm.server.text.structured import JSON_OPTIONS
from ferrylm.server.text.tools import MAX_FORCED_CALLS, ToolChoice, ToolSpec, forcing_grammar, strict_schema

Term = Callable[[str], str]  # text -> its Lark term (a literal, or an added token ``<[id]>``; tools.lark_term)


def _literal(text: str) -> str:
    return json.dumps(text)


FREE_TEXT = r"/[^<]*/"


def _value_rule(schema: Any, free_text: str = FREE_TEXT) -> str:
    """The Lark expansion of one argument value (module docstring); ``free_text``: the expansion of a string
    without an enum."""
    schema = schema if isinstance(schema, dict) else {}
    types = schema.get("type")
    if types == "string" or (isinstance(types, list) and types == ["string"]):
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(e, str) and "<" not in e for e in enum):
            return " | ".join(_literal(e) for e in enum)
        return free_text
    return _json_rule(schema)


def _arguments_json(tool: ToolSpec) -> str:
    """The arguments of a JSON-format call: an object valid against the tool's schema, strict as the XML-style
    formats are (a schema without ``properties`` that says nothing of ``additionalProperties`` admits no keys)."""
    schema = tool.parameters
    if "properties" not in schema and "additionalProperties" not in schema:
        schema = {**schema, "properties": {}}
    return _json_rule(schema)


def _json_rule(schema: dict) -> str:
    """JSON valid against ``schema`` made strict (llguidance's ``%json``)."""
    return "%json" + json.dumps({**strict_schema(schema), "x-guidance": {**JSON_OPTIONS, "lenient": True}})


def _arguments(tool: ToolSpec, prefix: str, pair: Callable[[str, str], str], rules: list[str],
               free_text: str = FREE_TEXT) -> str:
    """Rules for the key/value pairs of ``tool`` (one rule per key, optional keys ``?``); returns the sequence.
    ``free_text``: the expansion of a string value without an enum (:func:`_value_rule`)."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    missing = required - set(props)
    if missing:
        raise InvalidRequest(f"'{tool.param}': required parameter {sorted(missing)[0]!r} is not among its "
                             f"'properties', so a forced call cannot give it", param=tool.param)
    seq = []
    for j, (key, sub) in enumerate(props.items()):
        name = f"{prefix}_k{j}"
        rules.append(f"{name}: {pair(key, _value_rule(sub, free_text))}")
        seq.append(name if key in required else f"{name}?")
    return " ".join(seq)


def _chosen(tools: list[ToolSpec], choice: ToolChoice) -> list[ToolSpec]:
    return [t for t in tools if choice.mode == "required" or t.name == choice.name]


def _forced_calls(tools: list[ToolSpec], choice: ToolChoice, start: str, alt: str,
                  expand: Callable[[int, ToolSpec, list[str]], str], rules: list[str] | None = None) -> str:
    """The forcing grammar of a reply ``start`` whose rule ``alt`` (``call`` / ``invoke``) is one alternative per
    chosen tool: ``expand(i, tool, rules)`` is tool ``i``'s expansion, and appends the rules it names to ``rules``
    (which starts with the given ``rules``)."""
    chosen = _chosen(tools, choice)
    rules = list(rules or [])
    alts = []
    for i, tool in enumerate(chosen):
        body = expand(i, tool, rules)
        rules.append(f"{alt[0]}{i}: {body}")
        alts.append(f"{alt[0]}{i}")
    lark = "\n".join([start, f"{alt}: {' | '.join(alts)}", *rules]) + "\n"
    return forcing_grammar(lark, chosen)


def glm45_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str:
    """``<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>``; ``required`` with
    parallel calls allows several blocks, one per line."""
    t_open, t_close = term("<tool_call>"), term("</tool_call>")
    k_open, k_close, v_open, v_close = (term(x) for x in ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))

    def pair(key: str, value: str) -> str:
        return f'{k_open} {_literal(key)} {k_close} "\\n" {v_open} ({value}) {v_close} "\\n"'

    def expand(i: int, tool: ToolSpec, rules: list[str]) -> str:
        return f'{t_open} {_literal(tool.name)} "\\n" {_arguments(tool, f"t{i}", pair, rules)} {t_close}'

    return _forced_calls(tools, choice, f"start: call{_repeat(choice)}", "call", expand)


def minimax_m2_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str:
    """``<minimax:tool_call>\\n<invoke name="f">\\n<parameter name="k">v</parameter>\\n...</invoke>\\n
    </minimax:tool_call>``; ``required`` with parallel calls allows several invokes in the block."""
    b_open, b_close = term("<minimax:tool_call>"), term("</minimax:tool_call>")

    def pair(key: str, value: str) -> str:
        return f'{_literal(f"<parameter name={json.dumps(key)}>")} ({value}) "</parameter>" "\\n"'

    def expand(i: int, tool: ToolSpec, rules: list[str]) -> str:
        args = _arguments(tool, f"t{i}", pair, rules)
        return f'{_literal(f"<invoke name={json.dumps(tool.name)}>")} "\\n" {args} "</invoke>"'

    start = f'start: {b_open} "\\n" invoke{_repeat(choice, what="invoke")} "\\n" {b_close}'
    return _forced_calls(tools, choice, start, "invoke", expand)


def _repeat(choice: ToolChoice, sep: str = '"\\n"', what: str = "call") -> str:
    """The tail of a ``required`` reply with parallel calls: up to ``MAX_FORCED_CALLS - 1`` more ``what``."""
    if choice.mode != "required" or not choice.parallel:
        return ""
    return f" ({sep} {what}){{0,{MAX_FORCED_CALLS - 1}}}" if sep else f" {what}{{0,{MAX_FORCED_CALLS - 1}}}"


_OPTIONAL_NEWLINE = '"\\n"?'


def deepseek_v3_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str:
    """One ``<｜tool▁calls▁begin｜>`` section of calls, each in V3 / R1's form (``function`` type, name line,
    fenced JSON) or V3.1's (name, plain JSON): the model writes the one it was trained on. ``required`` with
    parallel calls allows several calls, optionally a newline apart."""
    from ferrylm.server.text.tool_parsers import deepseek_v3 as ds

    b_open, b_close, c_open, c_close, sep = (term(x) for x in (ds.CALLS_BEGIN, ds.CALLS_END, ds.CALL_BEGIN,
                                                               ds.CALL_END, ds.SEP))

    def expand(i: int, tool: ToolSpec, rules: list[str]) -> str:
        name = _literal(tool.name)
        rules.append(f"a{i}: {_arguments_json(tool)}")
        return (f'{c_open} ({_literal(ds.CALL_TYPE)} {sep} {name} "\\n```json\\n" a{i} "\\n```" '
                f"| {name} {sep} a{i}) {c_close}")

    return _forced_calls(tools, choice, f"start: {b_open} call{_repeat(choice, _OPTIONAL_NEWLINE)} {b_close}",
                         "call", expand)


def kimi_k2_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str:
    """One ``<|tool_calls_section_begin|>`` section of ``functions.NAME:IDX`` calls with JSON arguments; ``required``
    with parallel calls allows several calls."""
    from ferrylm.server.text.tool_parsers import kimi_k2 as kimi

    s_open, s_close, c_open, a_open, c_close = (term(x) for x in (kimi.SECTION_BEGIN, kimi.SECTION_END,
                                                                  kimi.CALL_BEGIN, kimi.ARGS_BEGIN, kimi.CALL_END))

    def expand(i: int, tool: ToolSpec, rules: list[str]) -> str:
        return (f"{c_open} {_literal(kimi.PREFIX + tool.name + ':')} /[0-9]{{1,4}}/ {a_open} "
                f"{_arguments_json(tool)} {c_close}")

    return _forced_calls(tools, choice, f"start: {s_open} call{_repeat(choice, '')} {s_close}", "call", expand)


#: a Qwen3-Coder string value and its closing tag: any text up to the first ``</parameter>`` (the parser ends the
#: value there; llguidance's lexer is greedy, so the closer is part of the terminal)
_QC_TEXT = r"/(?s:.*)<\/parameter>/ & ~/(?s:.*<\/parameter>(?s:.)+)/"


def qwen3_coder_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str:
    """``<tool_call>\\n<function=f>\\n<parameter=k>\\nv\\n</parameter>\\n...</function>\\n</tool_call>``; a string
    value is any text without ``</parameter>`` (``<`` allowed: code), or one of its ``enum``; ``required`` with
    parallel calls allows several blocks, one per line."""
    from ferrylm.server.text.tool_parsers import qwen3_coder as qc

    t_open, t_close = term(qc.OPEN), term(qc.CLOSE)

    def pair(key: str, value: str) -> str:
        head = _literal(f"{qc.PARAMETER}{key}>")
        if value == "QC_TEXT":
            return f'{head} QC_TEXT "\\n"'
        return f'{head} "\\n" ({value}) {_literal(chr(10) + qc.PARAMETER_END + chr(10))}'

    def expand(i: int, tool: ToolSpec, rules: list[str]) -> str:
        args = _arguments(tool, f"t{i}", pair, rules, free_text="QC_TEXT")
        return (f'{t_open} {_literal(chr(10) + qc.FUNCTION + tool.name + ">" + chr(10))} {args} '
                f'{_literal(qc.FUNCTION_END + chr(10))} {t_close}')

    return _forced_calls(tools, choice, f"start: call{_repeat(choice)}", "call", expand, ["QC_TEXT: " + _QC_TEXT])


def _dsml_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term, block: tuple[str, str]) -> str:
    """One DSML block (``block``: its opening and closing tags) of ``invoke`` calls, one ``parameter`` a line,
    ``string="true"`` for a string value (free text without ``<``, or its ``enum``), ``"false"`` for JSON;
    ``required`` with parallel calls allows several invokes."""
    from ferrylm.server.text.tool_parsers import deepseek_v4 as ds4


    def pair(key: str, value: str) -> str:
        literal = "false" if value.startswith("%json") else "true"
        head = _literal(f'{ds4.PARAMETER} name={json.dumps(key)} string="{literal}">')
        return f'{head} ({value}) {_literal(ds4.PARAMETER_END)} "\\n"'

    def expand(i: int, tool: ToolSpec, rules: list[str]) -> str:
        args = _arguments(tool, f"t{i}", pair, rules)
        empty = "" if tool.parameters.get("properties") else ' "\\n"'
        return (f'{_literal(f"{ds4.INVOKE} name={json.dumps(tool.name)}>")} "\\n" {args}{empty} '
                f"{_literal(ds4.INVOKE_END)}")

    start = f'start: {term(block[0])} "\\n" invoke{_repeat(choice, what="invoke")} "\\n" {term(block[1])}'
    return _forced_calls(tools, choice, start, "invoke", expand)


def deepseek_v4_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str:
    """DeepSeek-V4's ``<｜DSML｜tool_calls>`` block (:func:`_dsml_grammar`)."""
    from ferrylm.server.text.tool_parsers import deepseek_v4 as ds4

    return _dsml_grammar(tools, choice, term, (ds4.CALLS_BEGIN, ds4.CALLS_END))


def deepseek_v32_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str:
    """DeepSeek-V3.2's ``<｜DSML｜function_calls>`` block (:func:`_dsml_grammar`)."""
    from ferrylm.server.text.tool_parsers import deepseek_v32 as ds32

    return _dsml_grammar(tools, choice, term, (ds32.CALLS_BEGIN, ds32.CALLS_END))


def harmony_call_rules(tools: list[ToolSpec], term: Term = _literal) -> list[str]:
    """Lark rules ``call`` (the header and arguments of one harmony call to one of ``tools``: ``commentary
    to=functions.NAME <|constrain|>json<|message|>{arguments}``, after its ``<|channel|>``) and one rule per tool."""
    constrain, message = term("<|constrain|>"), term("<|message|>")
    rules, alts = [], []
    for i, tool in enumerate(tools):
        rules.append(f'c{i}: {_literal(f"commentary to=functions.{tool.name} ")} {constrain} "json" {message} '
                     f"{_arguments_json(tool)}")
        alts.append(f"c{i}")
    return [f"call: {' | '.join(alts)}", *rules]


def harmony_grammar(tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str:
    """Harmony (gpt-oss): one message on the commentary channel to ``functions.NAME``, ``<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>``, written right after the prompt's
    ``<|start|>assistant``; ``<|call|>`` ends the turn, so ``required`` makes one call."""
    lark = "\n".join([f"start: {term('<|channel|>')} call {term('<|call|>')}",
                      *harmony_call_rules(_chosen(tools, choice), term)]) + "\n"
    return forcing_grammar(lark, _chosen(tools, choice))


GRAMMARS = {"harmony": harmony_grammar, "glm45": glm45_grammar, "minimax_m2": minimax_m2_grammar, "deepseek_v3": deepseek_v3_grammar,
            "kimi_k2": kimi_k2_grammar, "qwen3_coder": qwen3_coder_grammar, "deepseek_v4": deepseek_v4_grammar,
            "deepseek_v32": deepseek_v32_grammar}


def forced_call_grammar(fmt: str, tools: list[ToolSpec], choice: ToolChoice, term: Term = _literal) -> str | None:
    """The forcing grammar of format ``fmt`` (a key of :data:`GRAMMARS`) for ``choice``; None unless the choice
    forces a call. Raises InvalidRequest when a schema cannot be enforced, ValueError for another format."""
    if not choice.forced:
        return None
    if fmt not in GRAMMARS:
        raise ValueError(f"no forced-call grammar for format {fmt!r} here (Hermes: tools.tool_call_grammar)")
    return GRAMMARS[fmt](tools, choice, term)
