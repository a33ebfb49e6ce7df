"""Structured output, frontend side: a request's output constraint as an llguidance grammar string.

The sources, all ending as ``SamplingParams.grammar`` (enforced by ``engine/structured.py``):

- OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
- vLLM ``structured_outputs``: ``{"json": schema | str, "regex": str, "choice": [str], "grammar": str (Lark or
  GBNF), "json_object": true}`` and the older top-level ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar``.
- llama.cpp's top-level ``json_schema`` (a schema) and ``grammar`` (GBNF).
- a forced tool call (``server/text/tools.py`` builds a Lark grammar).

Every grammar is validated here with llguidance (no tokenizer needed, no torch imported), so a bad schema, regex
or grammar is a 400 naming the field before anything reaches the engine. JSON is generated with the separators
``", "`` and ``": "`` and no free whitespace between tokens, so a small model cannot loop on blank lines.
"""

from __future__ import annotations

import json
from typing import Any

from ferrylm.errors import InvalidRequest
from ferrylm.server.text.json_limits import loads_json

# JSON shape of generated documents: readable separators, no runs of free whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_BYTES = 1 << 20


def _ll() -> Any:
    import llguidance

    return llguidance


def validate(grammar: str, param: str) -> str:
    """Return ``grammar`` when llguidance accepts it. Raises InvalidRequest naming ``param`` otherwise."""
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"the grammar built from '{param}' is larger than {MAX_GRAMMAR_BYTES} bytes",
                             param=param)
    err = _ll().LLMatcher.validate_grammar(grammar)
    if err:
        raise InvalidRequest(f"'{param}' cannot be enforced: {err}", param=param)
    return grammar


def json_schema_grammar(schema: Any, param: str, *, strict: bool = True) -> str:
    """Grammar for JSON documents valid against ``schema`` (a dict, or a JSON string of one).

    ``strict`` False: keywords llguidance does not enforce are ignored (lenient) instead of refused.
    Raises InvalidRequest (``param``) for a schema that is not an object (``true`` is ``{}``; ``false`` accepts no
    document, so nothing could be generated) or cannot be enforced.
    """
    if isinstance(schema, str) and schema.lstrip().startswith("{"):
        schema = loads_json(schema, param)
    if schema is True:
        schema = {}
    if schema is False:
        raise InvalidRequest(f"'{param}' is false, a schema that accepts no document: nothing could be generated; "
                             f"give a JSON schema object", param=param)
    if not isinstance(schema, dict):
        got = f"the string {schema[:40]!r}" if isinstance(schema, str) else f"a JSON {_json_type(schema)}"
        raise InvalidRequest(f"'{param}' must be a JSON schema object; got {got}", param=param)
    check_ref_cycles(schema, param)
    ll = _ll().LLMatcher
    grammar = ll.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))
    if not strict and ll.validate_grammar(grammar):
        grammar = ll.grammar_from_json_schema(schema, defaults={**JSON_OPTIONS, "lenient": True})
    return validate(grammar, param)


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type (``number``, ``array``, ``null`` ...)."""
    return {list: "array", type(None): "null", int: "number", float: "number"}.get(type(value), type(value).__name__)


# keywords that do not constrain a document: a node made of "$ref" and these is only its target
_ANNOTATIONS = frozenset({"$ref", "$schema", "$id", "$comment", "$defs", "definitions", "title", "description",
                          "default", "examples", "deprecated", "readOnly", "writeOnly"})


def _pointer(root: Any, ref: str) -> Any:
    """The node a local ``$ref`` (``#``, ``#/a/b``) points at; None when it does not resolve (llguidance then
    reports it)."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def check_ref_cycles(schema: dict, param: str) -> None:
    """A ``$ref`` chain that comes back to itself with nothing else on the way (``{"$ref": "#"}``) matches no
    document: llguidance accepts the grammar, and the request would fail at its first token. Raises
    InvalidRequest naming the field and the pointer instead. Recursion through a real keyword (``properties``,
    ``items``, ``anyOf`` ...) is fine and left to llguidance."""
    stack, seen_nodes = [(schema, "#")], 0
    while stack and seen_nodes < 10_000:
        node, where = stack.pop()
        seen_nodes += 1
        if isinstance(node, list):
            stack.extend((x, f"{where}/{i}") for i, x in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        stack.extend((v, f"{where}/{k}") for k, v in node.items() if isinstance(v, (dict, list)))
        chain, cur = [], node
        while isinstance(cur, dict) and isinstance(cur.get("$ref"), str) and cur["$ref"].startswith("#") \
                and set(cur) <= _ANNOTATIONS:
            if any(cur is c for c in chain):
                raise InvalidRequest(f"'{param}' cannot be enforced: '$ref' {node['$ref']!r} at {where} refers "
                                     f"back to itself through {' -> '.join(c['$ref'] for c in chain)} and matches no "
                                     f"document", param=param)
            chain.append(cur)
            cur = _pointer(schema, cur["$ref"])


def regex_grammar(regex: Any, param: str) -> str:
    if not isinstance(regex, str) or not regex:
        raise InvalidRequest(f"'{param}' must be a non-empty regular expression", param=param)
    return validate(_ll().LLMatcher.grammar_from_regex(regex), param)


def choice_grammar(choices: Any, param: str) -> str:
    """Grammar for exactly one of the strings ``choices``."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest(f"'{param}' must be a non-empty list of non-empty strings", param=param)
    return validate(_ll().grammar_from("choice", json.dumps(choices)), param)


def cfg_grammar(text: Any, param: str) -> str:
    """Grammar from Lark (llguidance's dialect) or llama.cpp GBNF text."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest(f"'{param}' must be a non-empty grammar (Lark or GBNF)", param=param)
    try:
        grammar = _ll().grammar_from("grammar", text)
    except (ValueError, RuntimeError) as e:
        raise InvalidRequest(f"'{param}' is not a valid grammar: {e}", param=param) from None
    return validate(grammar, param)


def lark_grammar(text: str, param: str) -> str:
    """Grammar from Lark text this server wrote (tool calls). Raises InvalidRequest naming ``param`` with
    llguidance's first line (the grammar it quotes after it is the server's, no help to the client)."""
    try:
        return validate(_ll().LLMatcher.grammar_from_lark(text), param)
    except InvalidRequest as e:
        raise InvalidRequest(e.message.split("\n", 1)[0], param=param) from None


def response_format_grammar(rf: Any, param: str = "response_format", nested: bool = True) -> str | None:
    """OpenAI ``response_format`` (chat) / ``text.format`` (Responses) → grammar, or None for plain text.
    ``nested``: the schema's object sits under ``json_schema`` (chat) rather than on the format itself
    (Responses).

    Raises InvalidRequest naming the field for an unknown type, a missing ``json_schema`` / ``schema`` or a bad
    schema.
    """
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise InvalidRequest(f"'{param}' must be an object", param=param)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, param)
    if kind == "json_schema":
        spec, where = (rf.get("json_schema"), f"{param}.json_schema") if nested else (rf, param)
        if spec is None:
            raise InvalidRequest(f"'{where}' is required with type 'json_schema'", param=where)
        if not isinstance(spec, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        if "schema" not in spec:
            raise InvalidRequest(f"'{where}.schema' is required", param=f"{where}.schema")
        return json_schema_grammar(spec["schema"], f"{where}.schema", strict=spec.get("strict") is not False)
    raise InvalidRequest(f"'{param}.type' must be one of 'text', 'json_object', 'json_schema'; got {kind!r}",
                         param=f"{param}.type")


def response_format_prompt(rf: Any, nested: bool = True) -> dict | None:
    """The reply's schema for the prompt, from a valid ``json_schema`` ``response_format`` (``nested``: as in
    :func:`response_format_grammar`): ``{"name", "description", "schema"}`` (the template argument
    ``response_format``: harmony's developer message and DeepSeek-V4's system turn show it); None otherwise."""
    if not isinstance(rf, dict) or rf.get("type") != "json_schema":
        return None
    spec = rf.get("json_schema") if nested else rf
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        return None
    description = spec.get("description")
    return {"name": str(spec.get("name") or "response"), "schema": spec["schema"],
            "description": description if isinstance(description, str) else None}


_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options beside the constraint: accepted, no effect here (llguidance has no fallback backend; JSON has no
# free whitespace already)
_VLLM_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def structured_outputs_grammar(so: Any, param: str = "structured_outputs") -> str | None:
    """vLLM's ``structured_outputs`` object → grammar (exactly one constraint key; ``_VLLM_OPTIONS`` beside it).

    Raises InvalidRequest naming ``param``: not an object, an unknown key (a typo such as ``choices``), no
    constraint (``{}``, ``{"json": null}``) or more than one.
    """
    if so is None:
        return None
    if not isinstance(so, dict):
        raise InvalidRequest(f"'{param}' must be an object", param=param)
    unknown = [k for k in so if k not in _VLLM_KEYS and k not in _VLLM_OPTIONS]
    if unknown:
        raise InvalidRequest(f"'{param}' has unknown key {unknown[0]!r}; it takes one of {', '.join(_VLLM_KEYS)} "
                             f"(and the options {', '.join(_VLLM_OPTIONS)})", param=param)
    given = [k for k in _VLLM_KEYS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise InvalidRequest(f"'{param}' takes one of {', '.join(_VLLM_KEYS)}; got {', '.join(given)}", param=param)
    if not given:
        raise InvalidRequest(f"'{param}' gives no constraint: set one of {', '.join(_VLLM_KEYS)} (or leave "
                             f"'{param}' out)", param=param)
    k = given[0]
    if k == "json_object":
        return json_schema_grammar({"type": "object"}, f"{param}.{k}")
    return _single(k, so[k], f"{param}.{k}")


def request_grammar(req: Any) -> tuple[str | None, str | None]:
    """The output constraint of a chat / completions request and the field it came from: ``(grammar, param)``,
    ``(None, None)`` when unconstrained. At most one source may be given.

    Raises:
        InvalidRequest: two sources at once, or an invalid one (``param`` names the field).
    """
    extra = dict(getattr(req, "model_extra", None) or {})
    found: list[tuple[str, str]] = []

    def add(param: str, grammar: str | None) -> None:
        if grammar is not None:
            found.append((grammar, param))

    rf = getattr(req, "response_format", None)
    add("response_format", response_format_grammar(rf))
    add("structured_outputs", structured_outputs_grammar(getattr(req, "structured_outputs", None)))
    legacy = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar"}
    for field, key in legacy.items():
        if extra.get(field) is not None:
            add(field, _single(key, extra[field], field))
    if extra.get("json_schema") is not None:   # llama.cpp
        add("json_schema", json_schema_grammar(extra["json_schema"], "json_schema"))
    if extra.get("grammar") is not None:       # llama.cpp GBNF
        add("grammar", cfg_grammar(extra["grammar"], "grammar"))
    if len(found) > 1:
        raise InvalidRequest(f"only one output constraint may be given; got {', '.join(p for _, p in found)}",
                             param=found[1][1])
    return found[0] if found else (None, None)


def _single(key: str, value: Any, param: str) -> str:
    if key == "json":
        return json_schema_grammar(value, param)
    if key == "regex":
        return regex_grammar(value, param)
    if key == "choice":
        return choice_grammar(value, param)
    return cfg_grammar(value, param)
