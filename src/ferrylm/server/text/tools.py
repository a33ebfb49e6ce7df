"""Tool calling, the request side: tool definitions, ``tool_choice``, rendering tools into the prompt, the grammar
that forces a Hermes call. The output side (parsing calls out of the model's text, one parser per format) is
``server/text/tool_parsers/``.

Rendering: a chat template that mentions ``tools`` gets them through ``apply_chat_template(tools=...)`` in the
OpenAI shape ``{"type": "function", "function": {...}}`` and the messages as they are. A template without a tools
section (the built-in SmolLM2 models) gets the documented fallback of :func:`fallback_messages`: the tool schemas
and the call format written into the system turn, earlier assistant calls in the served call format, tool results
as user turns wrapped in ``<tool_response>``.

``tool_choice``: ``none`` (tools not rendered, nothing parsed), ``auto`` (rendered, parsed), ``required`` and a
named function (rendered, and enforced by a grammar: :func:`tool_call_grammar` for Hermes,
``tool_parsers/grammars.py`` for the other formats).

This module must not import torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Collection

from ferrylm.errors import InvalidRequest
from ferrylm.server.text.structured import JSON_OPTIONS, check_ref_cycles, json_schema_grammar, lark_grammar
from ferrylm.server.text.tool_parsers import fallback_footer, format_calls_as
from ferrylm.server.text.tool_parsers.hermes import HermesToolParser

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128
#: calls a forced ``required`` reply may hold when parallel calls are allowed (a bound, so that a model repeating
#: its call, as greedy decoding of a small model does, still ends)
MAX_FORCED_CALLS = 8


@dataclass(frozen=True)
class ToolSpec:
    """One function tool: ``parameters`` is its JSON schema (``{"type": "object"}`` when not given); ``param``:
    where that schema sits in the request (``tools.1.function.parameters``), for errors that concern it."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object"})
    strict: bool = False
    param: str = "tools"

    def openai(self) -> dict:
        """The OpenAI chat shape templates expect: ``{"type": "function", "function": {...}}``."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: ``none`` | ``auto`` | ``required`` | ``named`` (then ``name``); ``parallel``: more than one call
    allowed (``parallel_tool_calls``)."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def make_tool(name: Any, description: Any, parameters: Any, strict: Any, param: str,
              schema_field: str = "parameters") -> ToolSpec:
    """Validate one tool's fields (``param`` is where it sits in the request, ``schema_field`` the name of its
    schema there: Anthropic's ``input_schema``). Raises InvalidRequest naming the field."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidRequest(f"'{param}.name' must be 1-64 characters of letters, digits, '_', '-' or '.'; got "
                             f"{name!r}", param=f"{param}.name")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"'{param}.description' must be a string", param=f"{param}.description")
    where = f"{param}.{schema_field}"
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    check_tool_schema(parameters, where)
    return ToolSpec(name, description or "", parameters, strict is True, where)


def check_tool_schema(schema: Any, where: str) -> None:
    """A tool's arguments schema: a valid JSON schema (its ``$schema`` draft's meta-schema, else 2020-12's) of an
    object, without a ``$ref`` loop. Raises InvalidRequest naming ``where`` and the place in the schema."""
    from jsonschema import Draft202012Validator, SchemaError
    from jsonschema.validators import validator_for

    if not isinstance(schema, dict):
        raise InvalidRequest(f"'{where}' must be a JSON schema object", param=where)
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        msg = e.message if len(e.message) <= 160 else e.message[:157] + "..."
        raise InvalidRequest(f"'{where}' is not a valid JSON schema: {msg} (at {e.json_path})", param=where) from None
    if schema.get("type", "object") != "object":
        raise InvalidRequest(f"'{where}' must describe an object (type 'object')", param=where)
    check_ref_cycles(schema, where)


def parse_openai_tools(tools: Any, param: str = "tools") -> list[ToolSpec]:
    """Chat completions ``tools`` (``[{"type": "function", "function": {name, description, parameters,
    strict}}]``) → ToolSpecs. Raises InvalidRequest naming the element for anything else."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest(f"'{param}' must be a list", param=param)
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", param=param)
    out = []
    for i, t in enumerate(tools):
        where = f"{param}.{i}"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise InvalidRequest(f"'{where}.type' must be 'function' (the only tool type served)",
                                 param=f"{where}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequest(f"'{where}.function' must be an object", param=f"{where}.function")
        out.append(make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), fn.get("strict"),
                             f"{where}.function"))
    check_unique(out, param)
    return out


def check_unique(tools: list[ToolSpec], param: str) -> None:
    seen: set[str] = set()
    for t in tools:
        if t.name in seen:
            raise InvalidRequest(f"two tools are named {t.name!r}", param=param)
        seen.add(t.name)


def check_tool_result(call_id: str, calls: Collection[str], param: str, answers: str) -> None:
    """A tool result must answer a call made earlier in the conversation (as OpenAI's and Anthropic's APIs
    require): ``call_id`` among ``calls``, the ids of earlier calls. Raises InvalidRequest naming ``param``;
    ``answers`` says what it should have matched."""
    if call_id not in calls:
        raise InvalidRequest(f"'{param}' {call_id!r} matches no earlier {answers}", param=param)


def parse_tool_choice(choice: Any, tools: list[ToolSpec], *, parallel: Any = None,
                      param: str = "tool_choice") -> ToolChoice:
    """OpenAI ``tool_choice`` (``"none"`` | ``"auto"`` | ``"required"`` | ``{"type": "function", "function":
    {"name"}}``; the Responses API's ``{"type": "function", "name"}`` too) → ToolChoice.

    Default: ``auto`` with tools, ``none`` without. Raises InvalidRequest (``param``) for an unknown value, a name
    that is not among the tools, or ``auto`` / ``required`` / a name with no tools.
    """
    par = parallel is not False
    if choice is None:
        return ToolChoice("auto" if tools else "none", parallel=par)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(f"'{param}' must be 'none', 'auto', 'required' or a named function; got "
                                 f"{choice!r}", param=param)
        if choice != "none" and not tools:
            raise InvalidRequest(f"'{param}' {choice!r} needs 'tools'", param=param)
        return ToolChoice(choice, parallel=par)
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest(f"'{param}.function.name' is required", param=f"{param}.function.name")
        if name not in {t.name for t in tools}:
            raise InvalidRequest(f"'{param}' names the function {name!r}, which is not among 'tools'",
                                 param=param)
        return ToolChoice("named", name, parallel=False)
    raise InvalidRequest(f"'{param}' must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}", param=param)


def strict_schema(schema: Any) -> Any:
    """``schema`` with OpenAI's strict semantics for a forced call: every object schema that names ``properties``
    and says nothing of ``additionalProperties`` gets ``additionalProperties: false`` (no keys the schema does not
    name), recursively through properties, items and the ``anyOf`` / ``oneOf`` / ``allOf`` branches and ``$defs``.
    Other keywords are kept; the input is not modified."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "patternProperties") and isinstance(v, dict):
            out[k] = {name: strict_schema(sub) for name, sub in v.items()}
        elif k in ("items", "additionalItems", "anyOf", "oneOf", "allOf", "prefixItems", "not"):
            out[k] = strict_schema(v)
        else:
            out[k] = v
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _call_schema(t: ToolSpec, at: str = "#") -> dict:
    """The schema of one call to ``t`` (strict, :func:`strict_schema`), placed at the JSON pointer ``at`` of the
    grammar's schema: the parameters' local ``$ref`` s (``#``, ``#/$defs/x``) are rebased to where the parameters
    now sit."""
    args = _rebase_refs(strict_schema(t.parameters), f"{at}/properties/arguments")
    return {"type": "object", "properties": {"name": {"const": t.name}, "arguments": args},
            "required": ["name", "arguments"], "additionalProperties": False}


def _rebase_refs(node: Any, prefix: str) -> Any:
    if isinstance(node, dict):
        return {k: (prefix + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebase_refs(v, prefix)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase_refs(v, prefix) for v in node]
    return node


def lark_term(codec: Any):
    """``text -> Lark term`` with ``codec``'s vocabulary: a tag that is one added token (Qwen's ``<tool_call>`` =
    151657, GLM-4.5's ``<arg_key>``) must be generated as that token, so it is written ``<[id]>``; otherwise the
    literal text."""
    added = getattr(getattr(codec, "tokenizer", None), "added_tokens_decoder", None) or {}

    def term(text: str) -> str:
        ids = codec.encode(text, add_special_tokens=False, parse_special=True) if codec is not None else []
        return f"<[{ids[0]}]>" if len(ids) == 1 and ids[0] in added else json.dumps(text)

    return term


def tag_terms(codec: Any) -> tuple[str, str]:
    """Lark terms for Hermes' opening and closing tags with ``codec``'s vocabulary (:func:`lark_term`)."""
    term = lark_term(codec)
    return term(HermesToolParser.OPEN), term(HermesToolParser.CLOSE)


def tool_call_grammar(tools: list[ToolSpec], choice: ToolChoice, param: str = "tool_choice",
                      tags: tuple[str, str] | None = None) -> str | None:
    """The grammar that forces calls for ``required`` (one or more calls, or exactly one when parallel calls
    are off) and a named function (exactly one call to it); None for ``none`` / ``auto``.

    The output is Hermes format, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, calls joined by
    a newline (at most :data:`MAX_FORCED_CALLS`), the arguments valid against each tool's schema with OpenAI's
    strict semantics (:func:`strict_schema`: no keys the schema does not name). ``tags``: the Lark terms of the two tags
    (:func:`tag_terms`; default the literal text). Raises InvalidRequest when a schema cannot be enforced.
    """
    if not choice.forced:
        return None
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    schemas = ([_call_schema(chosen[0], "#")] if len(chosen) == 1
               else [_call_schema(t, f"#/anyOf/{i}") for i, t in enumerate(chosen)])
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    body = {**body, "x-guidance": {**JSON_OPTIONS, "lenient": True}}
    repeat = f' ("\\n" call){{0,{MAX_FORCED_CALLS - 1}}}' if choice.mode == "required" and choice.parallel else ""
    open_, close = tags or (json.dumps(HermesToolParser.OPEN), json.dumps(HermesToolParser.CLOSE))
    lark = (f"start: call{repeat}\n"
            f"call: {open_} \"\\n\" body \"\\n\" {close}\n"
            f"body: %json{json.dumps(body)}\n")
    return forcing_grammar(lark, chosen)


def forcing_grammar(lark: str, tools: list[ToolSpec]) -> str:
    """``lark``, a grammar that forces calls to ``tools``, checked by llguidance. Raises InvalidRequest naming the
    schema of the tool that cannot be enforced (``ToolSpec.param``) and why, else ``tools``."""
    try:
        return lark_grammar(lark, "tools")
    except InvalidRequest:
        for t in tools:
            json_schema_grammar(strict_schema(t.parameters), t.param, strict=False)
        raise


def template_supports_tools(chat_template: Any) -> bool:
    """True when the chat template renders ``tools`` itself (it refers to the variable)."""
    if isinstance(chat_template, dict):   # named templates: the default one, or a "tool_use" one
        return any(template_supports_tools(v) for v in chat_template.values())
    if isinstance(chat_template, list):
        return any(template_supports_tools(t.get("template")) for t in chat_template if isinstance(t, dict))
    return isinstance(chat_template, str) and re.search(r"\btools\b", chat_template) is not None


FALLBACK_HEADER = ("# Tools\n\nYou can call functions to help with the request. Their signatures, as JSON, are "
                   "between <tools> and </tools>:\n<tools>\n")


def fallback_messages(messages: list[dict], tools: list[ToolSpec], fmt: str = "hermes") -> list[dict]:
    """Messages for a template without a tools section: the tool schemas and the call format appended to the
    system turn (one is added at the front when there is none); assistant ``tool_calls`` become call blocks in its
    text; ``tool`` results become user turns ``<tool_response>\\n...\\n</tool_response>``. ``fmt``: the served
    call format (:mod:`ferrylm.server.text.tool_parsers`: one block per call, or one section for a turn's calls in
    the DeepSeek and Kimi formats), so the model is taught, and shown, the markup its
    parser reads."""
    footer, render = fallback_footer(fmt), (lambda cs: format_calls_as(fmt, cs))
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if m.get("role") == "assistant" and calls:
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + [render(calls)])
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    if tools:
        text = FALLBACK_HEADER + "\n".join(json.dumps(t.openai()["function"], ensure_ascii=False) for t in tools) \
            + footer
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
