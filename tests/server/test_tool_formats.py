"""GLM-4.5 and MiniMax-M2 tool-call parsers (server/text/tool_parsers/glm45.py, minimax_m2.py): calls and text separated, values typed by
the tool's schema, text that is not a call never swallowed, any chunking of the stream giving the same calls and
text (hypothesis), reasoning split before them, and the choice of parser for a model."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.server.api.assistant import TurnConfig, whole_turn
from ferrylm.server.text.tool_parsers import choose_tool_parser, make_tool_parser
from ferrylm.server.text.tool_parsers.calls import coerce_value
from ferrylm.server.text.tool_parsers.glm45 import Glm45ToolParser
from ferrylm.server.text.tool_parsers.minimax_m2 import MiniMaxM2ToolParser

NAMES = ("get_weather", "search")
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                             "units": {"type": "string"}}},
           "search": {"type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"},
                                                        "exact": {"type": "boolean"}}}}

GLM_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
GLM_CALL2 = ('<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>42</arg_value>\n<arg_key>filters</arg_key>\n'
             '<arg_value>{"lang": "fr"}</arg_value>\n<arg_key>exact</arg_key>\n<arg_value>true</arg_value>\n'
             '</tool_call>')
MM_CALL = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
           '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>')
MM_TWO = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Rome</parameter>\n</invoke>\n'
          '<invoke name="search">\n<parameter name="q">\nmulti\nline\n</parameter>\n'
          '<parameter name="filters">{"lang": "fr"}</parameter>\n</invoke>\n</minimax:tool_call>')
PARSERS = {"glm45": Glm45ToolParser, "minimax_m2": MiniMaxM2ToolParser}


def run(parser, chunks: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    text, calls = [], []
    for p in [p for c in chunks for p in parser.feed(c)] + parser.finish():
        text.append(p.text) if p.call is None else calls.append((p.call.name, json.loads(p.call.arguments)))
    return "".join(text), calls


def test_glm45_calls_and_text() -> None:
    text, calls = run(Glm45ToolParser(NAMES, SCHEMAS), ["Checking.\n" + GLM_CALL + "\n" + GLM_CALL2 + "\n"])
    assert text == "Checking."
    assert calls == [("get_weather", {"city": "Paris", "days": 3}),
                     ("search", {"q": "42", "filters": {"lang": "fr"}, "exact": True})]  # q is a string property


def test_minimax_m2_calls_and_text() -> None:
    text, calls = run(MiniMaxM2ToolParser(NAMES, SCHEMAS), ["Sure.\n\n" + MM_CALL + "\n" + MM_TWO])
    assert text == "Sure."
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"}),
                     ("search", {"q": "multi\nline", "filters": {"lang": "fr"}})]


def test_a_reply_of_calls_only_has_no_text() -> None:
    assert run(Glm45ToolParser(NAMES), ["\n" + GLM_CALL + "\n\n"])[0] == ""
    assert run(MiniMaxM2ToolParser(NAMES), ["\n" + MM_CALL + "\n"])[0] == ""


@pytest.mark.parametrize("fmt,raw", [
    ("glm45", "GLM writes <tool_call> tags around calls."),
    ("glm45", "<tool_call>rm_rf\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>"),  # unknown tool
    ("glm45", "<tool_call>search\n<arg_key>q</arg_key>\n</tool_call>"),                     # key without value
    ("glm45", "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>x</arg_value>"),        # never closed
    ("glm45", "<tool_call>search\n<arg_key>q</arg_key><arg_value>x</arg_value>"
              "<arg_key>q</arg_key><arg_value>y</arg_value></tool_call>"),                  # key twice
    ("glm45", "<tool_call>\n</tool_call>"),                                                  # no name
    ("minimax_m2", "MiniMax uses <minimax:tool_call> blocks."),
    ("minimax_m2", "<minimax:tool_call>\n<invoke name=\"rm_rf\">\n</invoke>\n</minimax:tool_call>"),
    ("minimax_m2", "<minimax:tool_call>\n<invoke name=\"search\">\nstray\n</invoke>\n</minimax:tool_call>"),
    ("minimax_m2", "<minimax:tool_call>\n</minimax:tool_call>"),
    ("minimax_m2", "<minimax:tool_call>\n<invoke name=\"search\">"),
    ("minimax_m2", "<minimax:tool_ca"),
])
def test_text_that_is_not_a_call_is_never_swallowed(fmt: str, raw: str) -> None:
    assert run(PARSERS[fmt](NAMES, SCHEMAS), [raw]) == (raw, [])


def test_values_follow_the_schema() -> None:
    assert coerce_value("3", {"type": "integer"}) == 3
    assert coerce_value("3", {"type": "string"}) == "3"
    assert coerce_value("3", {"type": ["string", "null"]}) == "3"
    assert coerce_value("[1, 2]", {"type": "array"}) == [1, 2]
    assert coerce_value("Paris", {"type": "integer"}) == "Paris"  # not JSON: kept as text
    assert coerce_value(" null ", None) is None and coerce_value("x y", None) == "x y"


_GLM_PIECES = st.sampled_from([GLM_CALL, GLM_CALL2, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                               "<arg_value>", "</arg_value>", "search", "q", "\n", " ", "hi", "<", "é🙂", "<tool_",
                               "call>", "get_weather"])
_MM_PIECES = st.sampled_from([MM_CALL, MM_TWO, "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="search">',
                              "</invoke>", '<parameter name="q">', "</parameter>", "<invoke", "\n", " ", "x", "<",
                              "é🙂", "<minimax:", "tool_call>"])


def _chunkings(fmt: str, pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    whole = run(PARSERS[fmt](NAMES, SCHEMAS), [text])
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    assert run(PARSERS[fmt](NAMES, SCHEMAS), chunks) == whole
    assert run(PARSERS[fmt](NAMES, SCHEMAS), list(text)) == whole
    if not whole[1]:  # no call: the text comes back exactly
        assert whole[0] == text


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_GLM_PIECES, max_size=12), cuts=st.lists(st.integers(0, 600), max_size=8))
def test_glm45_any_chunking_gives_the_same_calls_and_text(pieces: list[str], cuts: list[int]) -> None:
    _chunkings("glm45", pieces, cuts)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_MM_PIECES, max_size=12), cuts=st.lists(st.integers(0, 600), max_size=8))
def test_minimax_m2_any_chunking_gives_the_same_calls_and_text(pieces: list[str], cuts: list[int]) -> None:
    _chunkings("minimax_m2", pieces, cuts)


@pytest.mark.parametrize("fmt,call", [("glm45", GLM_CALL), ("minimax_m2", MM_CALL)])
def test_reasoning_then_calls(fmt: str, call: str) -> None:
    """Both families think first (<think> ... </think>, into reasoning_content), then call."""
    cfg = TurnConfig(reasoning=True, tool_names=NAMES, tool_parser=fmt, tool_schemas=SCHEMAS)
    res = whole_turn(cfg, "<think>\nThe user wants weather.\n</think>\n\nOne moment.\n" + call, "stop")
    assert res.reasoning == "The user wants weather." and res.content == "One moment."
    assert [(c.name, json.loads(c.arguments)) for c in res.calls] == [("get_weather", {"city": "Paris", "days": 3})]
    assert res.finish_reason == "tool_calls"


def test_choice_of_parser() -> None:
    assert choose_tool_parser("auto", "Glm4MoeForCausalLM") == "glm45"
    assert choose_tool_parser(None, "MiniMaxM2ForCausalLM") == "minimax_m2"
    assert choose_tool_parser("auto", "Qwen3MoeForCausalLM") == "hermes"
    assert choose_tool_parser("auto", "LlamaForCausalLM", "{{ '<arg_key>' }}{{ tools }}") == "glm45"
    assert choose_tool_parser("auto", None, {"default": "x", "tool_use": "<minimax:tool_call>"}) == "minimax_m2"
    assert choose_tool_parser("hermes", "Glm4MoeForCausalLM") == "hermes"  # the flag wins
    with pytest.raises(ValueError, match="glm45"):
        choose_tool_parser("glm4", None)
    with pytest.raises(ValueError):
        make_tool_parser("nope", None)


@pytest.mark.parametrize("fmt", ["glm45", "minimax_m2"])
def test_fallback_teaches_and_shows_the_served_format(fmt: str) -> None:
    """A template without a tools section gets the fallback in the served format: its instructions show that
    markup, and an earlier call rendered into the history parses back to the same call."""
    from ferrylm.server.text.tool_parsers import format_call_as
    from ferrylm.server.text.tools import ToolSpec, fallback_messages

    specs = [ToolSpec("get_weather", "", SCHEMAS["get_weather"])]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    out = fallback_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                               "tool_calls": [call]}], specs, fmt)
    assert PARSERS[fmt].OPEN in out[0]["content"] and "<tool_call>\n{" not in out[0]["content"]
    block = out[2]["content"]
    assert block == format_call_as(fmt, call)
    assert run(PARSERS[fmt](NAMES, SCHEMAS), [block]) == ("", [("get_weather", {"city": "Paris", "days": 3})])
