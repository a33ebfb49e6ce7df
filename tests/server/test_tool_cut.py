"""A forced tool call cut by ``max_tokens`` (``ToolParser.finish_forced``): in every call format the block the
output ended in is an unfinished call (the arguments generated so far), never content with markup; the same for
any chunking, and for harmony's call messages. The routes' side is tests/server/test_tool_cut_app.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.server.api.assistant import TurnConfig, whole_turn
from ferrylm.server.text.tool_parsers import TOOL_PARSERS, format_calls_as, make_tool_parser
from ferrylm.server.text.tool_parsers.base import ToolCall

NAMES = ("get_weather", "search")
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
           "search": {"type": "object", "properties": {"q": {"type": "string"}}}}
ARGS = {"city": "Oslo", "days": 3}
WHOLE = json.dumps(ARGS)
FORMATS = list(TOOL_PARSERS.names)


def forced_output(fmt: str) -> str:
    """One call of ``get_weather`` in ``fmt``'s markup, as a forced reply writes it."""
    return format_calls_as(fmt, [{"id": "functions.get_weather:0", "function": {"name": "get_weather",
                                                                                "arguments": ARGS}}])


def cut(fmt: str, text: str, chunk: int = 0) -> list:
    parser = make_tool_parser(fmt, NAMES, SCHEMAS)
    chunks = [text[i:i + chunk] for i in range(0, len(text), chunk)] if chunk else [text]
    return [p for c in chunks for p in parser.feed(c)] + parser.finish_forced()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_cut_of_a_forced_call_is_a_call_or_nothing(fmt: str) -> None:
    """Cut at every character: no text (markup or other) comes out; at most one call, of the right tool, whose
    arguments are a prefix of the whole call's (equal once it is complete); the whole output is the whole call."""
    text = forced_output(fmt)
    seen_cut = False
    for k in range(len(text) + 1):
        pieces = cut(fmt, text[:k])
        assert all(not p.text.strip() for p in pieces if p.call is None), (k, text[:k], pieces)
        calls = [p.call for p in pieces if p.call is not None]
        assert len(calls) <= 1, (k, calls)
        if not calls:
            assert not seen_cut, f"a call was released at a shorter cut, none at {text[:k]!r}"
            continue
        (call,) = calls
        assert call.name == "get_weather"
        if call.complete:
            assert json.loads(call.arguments) == ARGS, (k, call)
        else:
            seen_cut = True
            assert WHOLE.startswith(call.arguments), (k, text[:k], call.arguments)
    assert seen_cut   # some cut falls inside the arguments
    (last,) = [p.call for p in cut(fmt, text) if p.call is not None]
    assert last.complete and json.loads(last.arguments) == ARGS


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(FORMATS), k=st.integers(0, 400), chunk=st.integers(1, 9))
def test_a_cut_forced_call_does_not_depend_on_chunking(fmt: str, k: int, chunk: int) -> None:
    text = forced_output(fmt)[:k]

    def key(pieces: list) -> list:   # a streamed call's head and argument pieces follow the chunks; their sum not
        streamed = ([p.head.name for p in pieces if p.head], "".join(p.args for p in pieces))
        return [(p.text, p.call and (p.call.name, p.call.arguments, p.call.complete)) for p in pieces
                if p.head is None and not p.args] + [streamed]

    assert key(cut(fmt, text, chunk)) == key(cut(fmt, text))


def test_hermes_cut_inside_the_arguments_and_before_the_closing_tag() -> None:
    head = '<tool_call>\n{"name": "get_weather", "arguments": '
    (call,) = [p.call for p in cut("hermes", head + '{"city": "Oslo", "da') if p.call]
    assert (call.name, call.arguments, call.complete) == ("get_weather", '{"city": "Oslo", "da', False)
    assert call.arguments_object() == {"city": "Oslo"}   # what the SDKs' partial JSON readers see
    (call,) = [p.call for p in cut("hermes", head + WHOLE + "}\n</tool_") if p.call]   # only the closing tag is short
    assert call.complete and json.loads(call.arguments) == ARGS
    assert cut("hermes", '<tool_call>\n{"name": "get_wea') == []   # the name unfinished: nothing to name
    assert [p.call.arguments for p in cut("hermes", head) if p.call] == [""]   # the arguments not begun
    assert cut("hermes", '<tool_call>\n{"name": "unknown", "arguments": {') == []


def test_a_forced_turn_cut_inside_its_second_call() -> None:
    """The whole turn: the first call whole, the second cut short is dropped, no content, ``tool_calls`` (as vLLM
    answers: the turn made a call); the same without ``forced``. The stream sent the second call's head before the
    cut: it ends unfinished and the reason is ``length`` (as OpenAI answers: the client holds a call it must not
    run). Cut inside its only call it is that call unfinished and ``length``."""
    first = forced_output("hermes")
    text = first + '\n<tool_call>\n{"name": "search", "arguments": {"q": "fjo'
    for forced in (True, False):
        cfg = TurnConfig(tool_names=NAMES, forced=forced)
        res = whole_turn(cfg, text, "length")
        assert (res.content, res.finish_reason) == ("", "tool_calls"), forced
        assert [(c.name, c.arguments, c.complete) for c in res.calls] == [("get_weather", WHOLE, True)]
        turn = cfg.new_turn()
        deltas = [turn.feed(text[i:i + 5]) for i in range(0, len(text), 5)] + [turn.finish(cut=True)]
        assert "".join(d.content for d in deltas) == ""
        # the stream sent the cut call's head and arguments as they came: it ends there, unfinished
        assert [(p.call.name, p.call.arguments, p.call.complete) for d in deltas for p in d.calls if p.done] == \
            [(c.name, c.arguments, c.complete) for c in res.calls] + [("search", '{"q": "fjo', False)]
        assert turn.finish_reason("length") == "length"
    cfg = TurnConfig(tool_names=NAMES, forced=True)
    assert whole_turn(cfg, text, "stop").finish_reason == "tool_calls"   # a stop string cut the second call
    assert whole_turn(cfg, first, "stop").finish_reason == "tool_calls"
    only = whole_turn(cfg, text[len(first) + 1:], "length")
    assert [(c.name, c.complete) for c in only.calls] == [("search", False)] and only.finish_reason == "length"


def test_prose_cut_after_a_call_is_length() -> None:
    """``max_tokens`` cut the text after a whole call (not a further call): the reply was cut, ``length``."""
    text = forced_output("hermes") + "\nNow I will also"
    res = whole_turn(TurnConfig(tool_names=NAMES), text, "length")
    assert (len(res.calls), res.content, res.finish_reason) == (1, "Now I will also", "length")
    assert whole_turn(TurnConfig(tool_names=NAMES), forced_output("hermes") + "\n<tool_", "length").finish_reason \
        == "tool_calls"


def test_partial_arguments_as_an_object() -> None:
    assert ToolCall("f", "", complete=False).arguments_object() == {}
    assert ToolCall("f", '{"a": [1, 2', complete=False).arguments_object() == {"a": [1, 2]}
    assert ToolCall("f", '{"a": 1}').arguments_object() == {"a": 1}


def test_harmony_call_cut_is_an_unfinished_call(harmony_codec) -> None:
    """gpt-oss: a message to ``functions.NAME`` the output ended in is that call, unfinished (the channel says it
    is a call), forced or not; a message to an unknown function stays content."""
    from ferrylm.server.text.harmony import open_message

    codec = harmony_codec
    prime = tuple(open_message(codec.encoding.encode("<|start|>assistant", allowed_special="all")))
    out = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo", "da'
    ids = codec.encoding.encode(out, allowed_special="all")
    cfg = TurnConfig(tool_names=NAMES, harmony=codec, harmony_prime=prime)
    text = '{"city": "Oslo", "da'   # the message text the choice's text stream released
    res = whole_turn(cfg, text, "length", ids)
    assert res.content == "" and [(c.name, c.arguments, c.complete) for c in res.calls] == [
        ("get_weather", '{"city": "Oslo", "da', False)]
    other = TurnConfig(tool_names=("search",), harmony=codec, harmony_prime=prime)
    res = whole_turn(other, text, "length", ids)
    assert res.calls == [] and res.content == '{"city": "Oslo", "da'
