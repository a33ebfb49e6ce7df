"""The tool-call side of the server without HTTP: the Hermes parser (incl. the chunking property), the reasoning
split, tool / tool_choice validation, the fallback rendering and the forcing grammar."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.errors import InvalidRequest
from ferrylm.server.api.assistant import TurnConfig, whole_turn
from ferrylm.server.text.reasoning import ReasoningSplitter, prompt_opens_thinking, template_has_reasoning
from ferrylm.server.text.tool_parsers.hermes import HermesToolParser
from ferrylm.server.text.tools import (ToolChoice, ToolSpec, fallback_messages, parse_openai_tools, parse_tool_choice,
                                      template_supports_tools, tool_call_grammar)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NAMES = ("get_weather", "search")


def run(parser: HermesToolParser, chunks: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    text, calls = [], []
    for c in chunks:
        for p in parser.feed(c):
            text.append(p.text) if p.call is None else calls.append((p.call.name, json.loads(p.call.arguments)))
    for p in parser.finish():
        text.append(p.text) if p.call is None else calls.append((p.call.name, json.loads(p.call.arguments)))
    return "".join(text), calls


def test_calls_and_text_are_separated() -> None:
    text, calls = run(HermesToolParser(NAMES), ["Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome")])
    assert text == "Let me check."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_a_reply_of_calls_only_has_no_text() -> None:
    assert run(HermesToolParser(NAMES), ["\n" + CALL + "\n\n"]) == ("", [("get_weather", {"city": "Paris"})])


@pytest.mark.parametrize("raw", [
    "I write <tool_call> tags around calls.",                         # a mention, not a call
    "<tool_call>\n{not json}\n</tool_call> and more",                  # malformed body
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',    # not one of the tools
    '<tool_call>\n{"name": "search", "arguments": [1]}\n</tool_call>',  # arguments not an object
    "<tool_cal",                                                        # a tag prefix at the very end
])
def test_text_that_is_not_a_call_is_never_swallowed(raw: str) -> None:
    assert run(HermesToolParser(NAMES), [raw]) == (raw, [])


def test_a_call_begun_with_its_name_and_an_object_is_a_call_even_unclosed() -> None:
    """Its arguments went out as they came (a stream cannot take them back): the model stopping before the closing
    tag still made the call; arguments never closed make it unfinished."""
    assert run(HermesToolParser(NAMES), ['<tool_call>\n{"name": "search", "arguments": {"q": 1}}']) == \
        ("", [("search", {"q": 1})])
    parser = HermesToolParser(NAMES)
    (call,) = [p.call for p in parser.feed('<tool_call>{"name": "search", "arguments": {"q": "a') + parser.finish()
               if p.call]
    assert (call.arguments, call.complete) == ('{"q": "a', False)


def test_arguments_as_json_text_and_parameters_alias() -> None:
    body = '<tool_call>{"name": "search", "parameters": {"q": "x"}}</tool_call>' \
           '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"y\\"}"}</tool_call>'
    assert run(HermesToolParser(NAMES), [body])[1] == [("search", {"q": "x"}), ("search", {"q": "y"})]


_PIECES = st.sampled_from([CALL, "<tool_call>", "</tool_call>", "{", "}", '"name"', " ", "\n", "hello", "<tool",
                           '{"name": "search", "arguments": {}}', "é🙂", "<", "call>"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=12), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_any_chunking_gives_the_same_calls_and_text(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    whole = run(HermesToolParser(NAMES), [text])
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    assert run(HermesToolParser(NAMES), chunks) == whole
    one_by_one = run(HermesToolParser(NAMES), list(text))
    assert one_by_one == whole
    if not whole[1]:   # no call: the text comes back exactly
        assert whole[0] == text


def split(s: ReasoningSplitter, chunks: list[str]) -> tuple[str, str]:
    r, c = [], []
    for ch in chunks:
        a, b = s.feed(ch)
        r.append(a), c.append(b)
    a, b = s.finish()
    return "".join(r) + a, "".join(c) + b


@pytest.mark.parametrize("start,text,want", [
    (False, "<think>\nplan it\n</think>\n\nThe answer.", ("plan it", "The answer.")),
    (False, "No thinking here <think>x</think>", ("", "No thinking here <think>x</think>")),
    (True, "\nstill thinking\n</think>\n\nDone.", ("still thinking", "Done.")),
    (True, "cut off while thinking", ("cut off while thinking", "")),
    (False, "<thi", ("", "<thi")),
    (False, "  ", ("", "  ")),
])
def test_reasoning_split(start: bool, text: str, want: tuple[str, str]) -> None:
    assert split(ReasoningSplitter(start), [text]) == want
    assert split(ReasoningSplitter(start), list(text)) == want


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from(["<think>", "</think>", "\n", " ", "a", "<", "/", "think>", "b c"]),
                       max_size=10), cut=st.integers(0, 60), start=st.booleans())
def test_reasoning_split_ignores_chunking(pieces: list[str], cut: int, start: bool) -> None:
    text = "".join(pieces)
    k = min(cut, len(text))
    assert split(ReasoningSplitter(start), [text[:k], text[k:]]) == split(ReasoningSplitter(start), [text])


def test_reasoning_switches() -> None:
    assert template_has_reasoning("{{ '</think>' }}") and not template_has_reasoning("{{ messages }}")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_turn_with_reasoning_and_calls() -> None:
    cfg = TurnConfig(reasoning=True, tool_names=NAMES)
    res = whole_turn(cfg, "<think>need weather</think>\n\n" + CALL, "stop")
    assert (res.reasoning, res.content, res.finish_reason) == ("need weather", "", "tool_calls")
    assert [c.name for c in res.calls] == ["get_weather"]
    assert whole_turn(cfg, CALL, "length").finish_reason == "tool_calls"   # cut right after a whole call
    assert whole_turn(cfg, "<think>need weather", "length").finish_reason == "length"
    assert whole_turn(TurnConfig(), CALL, "stop").content == CALL   # no tools offered: nothing is parsed



def test_a_reply_cut_inside_its_second_call_drops_it() -> None:
    """A reply cut inside its second call (``max_tokens``): the first call is parsed, the cut one dropped (no
    markup as content) and the turn ends ``tool_calls``, as vLLM answers; streamed or not."""
    cut = CALL + '\n<tool_call>\n{"name":'
    whole = whole_turn(TurnConfig(tool_names=NAMES), cut, "length")
    assert [c.name for c in whole.calls] == ["get_weather"] and whole.content == ""
    assert whole.finish_reason == "tool_calls"
    streamed = TurnConfig(tool_names=NAMES).new_turn()
    deltas = [streamed.feed(cut[i:i + 7]) for i in range(0, len(cut), 7)] + [streamed.finish(cut=True)]
    assert "".join(d.content for d in deltas) == ""
    assert [p.call.name for d in deltas for p in d.calls if p.done] == ["get_weather"]
    assert streamed.finish_reason("length") == "tool_calls"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "search"}}]


@pytest.mark.parametrize("tools,param", [
    ("x", "tools"), ([{"type": "retrieval"}], "tools.0.type"), ([{"type": "function"}], "tools.0.function"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "tools.0.function.parameters"),
    ([TOOLS[1], TOOLS[1]], "tools"),
])
def test_bad_tools(tools, param) -> None:
    with pytest.raises(InvalidRequest) as e:
        parse_openai_tools(tools)
    assert e.value.param == param


@pytest.mark.parametrize("choice,tools,ok", [
    (None, [], "none"), (None, TOOLS, "auto"), ("none", [], "none"), ("auto", TOOLS, "auto"),
    ("required", TOOLS, "required"), ({"type": "function", "function": {"name": "search"}}, TOOLS, "named"),
    ({"type": "function", "name": "search"}, TOOLS, "named"),   # the Responses API's shape
    ("bogus", TOOLS, None), ("auto", [], None), ("required", [], None),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, None), ({"type": "function"}, TOOLS, None),
    (3, TOOLS, None),
])
def test_tool_choice(choice, tools, ok) -> None:
    specs = parse_openai_tools(tools)
    if ok is None:
        with pytest.raises(InvalidRequest) as e:
            parse_tool_choice(choice, specs)
        assert e.value.param.startswith("tool_choice")
    else:
        assert parse_tool_choice(choice, specs).mode == ok


def test_forcing_grammar_only_for_required_and_named() -> None:
    specs = parse_openai_tools(TOOLS)
    assert tool_call_grammar(specs, ToolChoice("auto")) is None
    assert tool_call_grammar(specs, ToolChoice("none")) is None
    g = tool_call_grammar(specs, ToolChoice("named", "get_weather", parallel=False))
    assert "get_weather" in g and "search" not in g
    assert "search" in tool_call_grammar(specs, ToolChoice("required"))


def test_fallback_rendering() -> None:
    specs = [ToolSpec("search", "Search the web", {"type": "object"})]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "result"}]
    out = fallback_messages(msgs, specs)
    assert out[0]["role"] == "system" and '"name": "search"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\nresult\n</tool_response>"}
    with_system = fallback_messages([{"role": "system", "content": "Be brief."}, msgs[0]], specs)
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools") and len(with_system) == 2


def test_template_detection(qwen_codec) -> None:
    assert template_supports_tools(qwen_codec.chat_template)
    assert template_has_reasoning(qwen_codec.chat_template)
    assert not template_supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
