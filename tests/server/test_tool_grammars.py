"""Forced tool calls in the GLM-4.5, MiniMax-M2, DeepSeek-V3, Kimi-K2, Qwen3-Coder and DeepSeek-V4 formats
(server/text/tool_parsers/grammars.py), checked with llguidance's
own matcher over a byte vocabulary: well-formed calls are accepted, calls that break OpenAI's strict semantics
(a missing required key, a key the schema does not name, a wrong type) are not, and random walks through the
grammar always end in markup the format's parser turns into calls of the right shape (no text left over)."""

from __future__ import annotations

import json
import random

import pytest

from ferrylm.errors import InvalidRequest
from ferrylm.server.text.tool_parsers import make_tool_parser
from ferrylm.server.text.tool_parsers.grammars import forced_call_grammar
from ferrylm.server.text.tools import ToolChoice, ToolSpec

llguidance = pytest.importorskip("llguidance")

TOOLS = [ToolSpec("get_weather", "", {"type": "object", "required": ["city"], "properties": {
             "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "string", "enum": ["c", "f"]},
             "extra": {"type": "object", "properties": {"hourly": {"type": "boolean"}},
                       "required": ["hourly"], "additionalProperties": False}}}),
         ToolSpec("search", "", {"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}}),
         ToolSpec("ping", "", {"type": "object"})]
SCHEMAS = {t.name: t.parameters for t in TOOLS}


def _glm(name: str, pairs: list[tuple[str, str]]) -> str:
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                            for k, v in pairs) + "</tool_call>"


def _mm(*invokes: tuple[str, list[tuple[str, str]]]) -> str:
    body = "\n".join(f'<invoke name="{n}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in ps)
                     + "</invoke>" for n, ps in invokes)
    return f"<minimax:tool_call>\n{body}\n</minimax:tool_call>"


def _json_value(v: str, schema: dict | None) -> str:
    """A value's text in a JSON object: a string property's quoted; another property's as it is (so a bad value
    stays bad); a key no schema names: as it is when it is JSON, else quoted."""
    if schema is not None:
        return json.dumps(v) if schema.get("type") == "string" else v
    try:
        json.loads(v)
        return v
    except ValueError:
        return json.dumps(v)


def _json_args(name: str, pairs: list[tuple[str, str]]) -> str:
    """The pairs as a JSON object's text (:func:`_json_value`)."""
    props = SCHEMAS.get(name, {}).get("properties", {})
    return "{" + ", ".join(f"{json.dumps(k)}: {_json_value(v, props.get(k))}" for k, v in pairs) + "}"


def _ds(*invokes: tuple[str, list[tuple[str, str]]], v3: bool = False) -> str:
    from ferrylm.server.text.tool_parsers import deepseek_v3 as ds

    calls = (f"{ds.CALL_BEGIN}function{ds.SEP}{n}\n```json\n{_json_args(n, ps)}\n```{ds.CALL_END}" if v3 else
             f"{ds.CALL_BEGIN}{n}{ds.SEP}{_json_args(n, ps)}{ds.CALL_END}" for n, ps in invokes)
    return ds.CALLS_BEGIN + ("\n" if v3 else "").join(calls) + ds.CALLS_END


def _kimi(*invokes: tuple[str, list[tuple[str, str]]]) -> str:
    from ferrylm.server.text.tool_parsers import kimi_k2 as k

    return k.SECTION_BEGIN + "".join(f"{k.CALL_BEGIN}functions.{n}:{i}{k.ARGS_BEGIN}{_json_args(n, ps)}{k.CALL_END}"
                                     for i, (n, ps) in enumerate(invokes)) + k.SECTION_END


def _qc(*invokes: tuple[str, list[tuple[str, str]]]) -> str:
    return "\n".join(f"<tool_call>\n<function={n}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                                                                for k, v in ps) + "</function>\n</tool_call>"
                     for n, ps in invokes)


def _dsml(*invokes: tuple[str, list[tuple[str, str]]], block: str = "tool_calls") -> str:
    """DeepSeek-V4 (V3.2: ``block`` ``function_calls``): a string property's value with ``string="true"``, any other
    as JSON with ``"false"``."""
    from ferrylm.server.text.tool_parsers import deepseek_v4 as d

    def param(n: str, k: str, v: str) -> str:
        literal = (SCHEMAS.get(n, {}).get("properties", {}).get(k) or {}).get("type") == "string"
        return f'{d.PARAMETER} name="{k}" string="{str(literal).lower()}">{v}{d.PARAMETER_END}'

    body = "\n".join(f'{d.INVOKE} name="{n}">\n' + "".join(param(n, k, v) + "\n" for k, v in ps)
                     + ("" if ps or n != "ping" else "\n") + d.INVOKE_END for n, ps in invokes)
    begin, end = d.block_tags(block)
    return f"{begin}\n{body}\n{end}"


FORMAT = {"glm45": lambda *inv: "\n".join(_glm(n, ps) for n, ps in inv), "minimax_m2": _mm,
          "deepseek_v3": _ds, "kimi_k2": _kimi, "qwen3_coder": _qc, "deepseek_v4": _dsml,
          "deepseek_v32": lambda *inv: _dsml(*inv, block="function_calls")}
ALL = sorted(FORMAT)


def accepts(grammar: str, text: str) -> bool:
    tok = llguidance.LLTokenizer("byte")
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    assert not m.get_error(), m.get_error()
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


@pytest.mark.parametrize("fmt", ALL)
def test_well_formed_calls_are_accepted_and_strict_violations_are_not(fmt: str) -> None:
    g = forced_call_grammar(fmt, TOOLS, ToolChoice("required"))
    make = FORMAT[fmt]
    good = [make(("get_weather", [("city", "Paris")])),
            make(("get_weather", [("city", "Paris"), ("days", "3"), ("units", "c"), ("extra", '{"hourly": true}')])),
            make(("search", [("q", "x y")]), ("ping", [])),                     # parallel calls allowed
            make(("ping", []))]
    for text in good:
        assert accepts(g, text), text
    bad = [make(("get_weather", [("days", "3")])),                          # required 'city' missing
           make(("get_weather", [("city", "Paris"), ("country", "FR")])),   # a key the schema does not name
           make(("get_weather", [("city", "Paris"), ("days", "three")])),   # integer expected
           make(("get_weather", [("city", "Paris"), ("units", "k")])),      # not in the enum
           make(("get_weather", [("city", "Paris"), ("extra", '{"hourly": true, "x": 1}')])),  # nested strict
           make(("rm_rf", [])),                                             # not a tool
           make(("get_weather", [("city", "Paris")])) + " and some text"]   # nothing after the call
    for text in bad:
        assert not accepts(g, text), text
    one = forced_call_grammar(fmt, TOOLS, ToolChoice("named", "search", parallel=False))
    assert accepts(one, make(("search", [("q", "x")])))
    assert not accepts(one, make(("search", [("q", "x")]), ("search", [("q", "y")])))
    assert not accepts(one, make(("ping", [])))


#: closers a walk tries now and then (free text that only a whole closing tag ends, as Qwen3-Coder's values, would
#: not end by chance)
HINTS = ("</parameter>\n", "</function>\n")


def _random_walk(grammar: str, rng: random.Random, limit: int = 3000) -> str:
    """Random tokens the matcher allows (tags and closers favoured so walks end) until it stops."""
    tok = llguidance.LLTokenizer("byte")
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    out = bytearray()
    for _ in range(limit):
        if m.is_stopped():
            break
        hint = list(rng.choice(HINTS).encode())
        if rng.random() < 0.05 and m.validate_tokens(hint) == len(hint):
            assert m.consume_tokens(hint), m.get_error()
            out.extend(hint)
            continue
        mask = m.compute_bitmask()
        allowed = [i for i in range(tok.vocab_size) if mask[i // 8] >> (i % 8) & 1]
        if allowed == [tok.eos_token] or (m.is_accepting() and rng.random() < 0.5):
            break
        allowed = [i for i in allowed if i != tok.eos_token]
        favoured = [i for i in allowed if i < 256 and chr(i) in '<"}]\n0123456789tfn,']
        t = rng.choice(favoured if favoured and rng.random() < 0.6 else allowed)
        assert m.consume_token(t), m.get_error()
        out.append(t)
    assert m.is_accepting(), bytes(out)
    return out.decode("utf-8")


@pytest.mark.parametrize("mode", ["required", "named"])
@pytest.mark.parametrize("fmt", ALL)
def test_any_walk_through_the_grammar_parses_into_strict_calls(fmt: str, mode: str) -> None:
    choice = ToolChoice("required") if mode == "required" else ToolChoice("named", "get_weather", parallel=False)
    g = forced_call_grammar(fmt, TOOLS, choice)
    rng = random.Random(7)
    for _ in range(25):
        text = _random_walk(g, rng)
        parser = make_tool_parser(fmt, [t.name for t in TOOLS], SCHEMAS)
        pieces = parser.feed(text) + parser.finish()
        assert all(p.call is not None for p in pieces), (text, pieces)  # no markup left as content
        assert pieces and (mode == "required" or len(pieces) == 1)
        for p in pieces:
            args, schema = json.loads(p.call.arguments), SCHEMAS[p.call.name]
            props = schema.get("properties", {})
            assert set(schema.get("required", [])) <= set(args) <= set(props), text
            if "days" in args:
                assert isinstance(args["days"], int) and not isinstance(args["days"], bool)
            if "units" in args:
                assert args["units"] in ("c", "f")
            if "extra" in args:
                assert set(args["extra"]) == {"hourly"} and isinstance(args["extra"]["hourly"], bool)


def test_format_variants_and_free_text() -> None:
    """DeepSeek: V3 / R1's fenced form and V3.1's plain form are both allowed (the model writes its own).
    Qwen3-Coder: a string value may hold ``<`` and other tags (code), only ``</parameter>`` ends it; Kimi: the id
    names the function."""
    g = forced_call_grammar("deepseek_v3", TOOLS, ToolChoice("required"))
    assert accepts(g, _ds(("get_weather", [("city", "Paris"), ("days", "2")]), ("ping", []), v3=True))
    assert not accepts(g, _ds(("get_weather", [("city", "Paris"), ("days", "x")]), v3=True))
    q = forced_call_grammar("qwen3_coder", TOOLS, ToolChoice("named", "search", parallel=False))
    assert accepts(q, _qc(("search", [("q", "if a < b:\n    return '<tool_call>'")])))
    assert not accepts(q, _qc(("search", [("q", "a</parameter>b")])))
    code = _qc(("search", [("q", "x = '</tool_call>'")]))   # the block's own closing tag, inside a value
    assert accepts(q, code)
    parser = make_tool_parser("qwen3_coder", [t.name for t in TOOLS], SCHEMAS)
    (piece,) = parser.feed(code) + parser.finish()
    assert json.loads(piece.call.arguments) == {"q": "x = '</tool_call>'"}
    k = forced_call_grammar("kimi_k2", TOOLS, ToolChoice("named", "search", parallel=False))
    assert accepts(k, _kimi(("search", [("q", "x")])))
    assert not accepts(k, _kimi(("search", [("q", "x")])).replace("functions.search", "functions.ping"))


def test_none_and_auto_force_nothing_and_bad_schemas_are_refused() -> None:
    assert forced_call_grammar("glm45", TOOLS, ToolChoice("auto")) is None
    broken = [ToolSpec("f", "", {"type": "object", "required": ["a"], "properties": {}})]
    with pytest.raises(InvalidRequest, match="'a'"):
        forced_call_grammar("minimax_m2", broken, ToolChoice("required"))


def _hermes(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_hermes_forced_calls_are_strict_and_bounded() -> None:
    """OpenAI strict semantics for the Hermes grammar too: no keys the schema does not name (top level and nested,
    when the schema says nothing of additionalProperties), at most MAX_FORCED_CALLS calls (a greedy model that
    repeats its call still ends)."""
    from ferrylm.server.text.tools import MAX_FORCED_CALLS, tool_call_grammar

    tools = [ToolSpec("get_weather", "", {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}}}})]
    g = tool_call_grammar(tools, ToolChoice("required"))
    ok = _hermes("get_weather", {"city": "Paris", "opts": {"hourly": True}})
    assert accepts(g, ok)
    assert not accepts(g, _hermes("get_weather", {"city": "Paris", "country": "FR"}))
    assert not accepts(g, _hermes("get_weather", {"city": "Paris", "opts": {"hourly": True, "x": 1}}))
    assert not accepts(g, _hermes("get_weather", {}))
    assert accepts(g, "\n".join([ok] * MAX_FORCED_CALLS))
    assert not accepts(g, "\n".join([ok] * (MAX_FORCED_CALLS + 1)))


@pytest.mark.parametrize("fmt", ALL)
def test_nested_objects_are_strict_and_calls_bounded(fmt: str) -> None:
    from ferrylm.server.text.tools import MAX_FORCED_CALLS

    tools = [ToolSpec("f", "", {"type": "object", "properties": {
        "opts": {"type": "object", "properties": {"a": {"type": "integer"}}}}})]
    g = forced_call_grammar(fmt, tools, ToolChoice("required"))
    make = FORMAT[fmt]
    assert accepts(g, make(("f", [("opts", '{"a": 1}')])))
    assert not accepts(g, make(("f", [("opts", '{"a": 1, "b": 2}')])))
    assert accepts(g, make(*[("f", [])] * MAX_FORCED_CALLS))
    assert not accepts(g, make(*[("f", [])] * (MAX_FORCED_CALLS + 1)))


def test_strict_schema() -> None:
    from ferrylm.server.text.tools import strict_schema

    src = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                            "l": {"type": "array", "items": {"type": "object", "properties": {}}},
                                            "free": {"type": "object", "additionalProperties": True}}}
    out = strict_schema(src)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["l"]["items"]["additionalProperties"] is False
    assert out["properties"]["free"]["additionalProperties"] is True  # the schema's own word stands
    assert "additionalProperties" not in src  # not modified in place
