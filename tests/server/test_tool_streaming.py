"""Streamed tool-call arguments (Hermes / Qwen ``<tool_call>`` JSON): once a block shows ``{"name": <request tool>,
"arguments": {``, its head and then its arguments are released as they are written; for any chunking the
fragments join to the released call's arguments, the calls and text equal the whole output's, and no fragment
holds text that turned out to be the closing tag."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.server.text.tool_parsers.hermes import HermesToolParser
from ferrylm.server.text.tool_parsers.json_prefix import JsonPrefix

NAMES = ("get_weather", "search")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'


def read(chunks: list[str], end: str = "finish") -> tuple[list, list[tuple[str, str]], list[tuple[str, str, bool]]]:
    """(text and whole-call pieces in order, per streamed call (head name, joined fragments), released calls)."""
    parser = HermesToolParser(NAMES)
    pieces = [p for c in chunks for p in parser.feed(c)] + getattr(parser, end)()
    order, streamed = [], []
    for p in pieces:
        if p.head is not None:
            streamed.append((p.head.name, p.head.id, ""))
        elif p.args:
            name, cid, text = streamed[-1]
            streamed[-1] = (name, cid, text + p.args)
        elif p.call is not None:
            order.append(("", (p.call.name, p.call.arguments, p.call.complete, p.call.id)))
        elif p.text and order and order[-1][1] is None:   # text as the chunks split it: joined
            order[-1] = (order[-1][0] + p.text, None)
        elif p.text:
            order.append((p.text, None))
    calls = [c for _, c in order if c]
    for name, cid, text in streamed:   # every streamed call is released, its arguments its fragments joined
        (call,) = [c for c in calls if c[3] == cid]
        assert (call[0], call[1]) == (name, text), (call, text)
    return ([(t, c and c[:3]) for t, c in order], [(n, t) for n, _, t in streamed],
            [c[:3] for c in calls])


def test_arguments_stream_in_pieces_and_join_to_the_call() -> None:
    order, streamed, calls = read(list(CALL))
    assert streamed == [("get_weather", '{"city": "Paris", "days": [1, 2]}')]
    assert calls == [("get_weather", '{"city": "Paris", "days": [1, 2]}', True)]
    parser = HermesToolParser(NAMES)
    per_char = [parser.feed(c) for c in CALL]
    fragments = [p.args for ps in per_char for p in ps if p.args]
    assert len(fragments) == len('{"city": "Paris", "days": [1, 2]}')   # one per character fed
    first = next(i for i, ps in enumerate(per_char) if any(p.head for p in ps))
    assert CALL[:first + 1].endswith('"arguments": {')   # the head goes out with the arguments' first brace


def test_held_back_bodies_keep_their_old_reading() -> None:
    """Bodies that do not start with a known name and an object of arguments are read whole at the closing tag:
    the arguments as JSON text, ``parameters``, the name after the arguments, an unknown tool."""
    for body, expect in [('{"name": "search", "arguments": "{\\"q\\": 1}"}', [("search", '{"q": 1}', True)]),
                         ('{"arguments": {"q": 1}, "name": "search"}', [("search", '{"q": 1}', True)]),
                         ('{"name": "rm", "arguments": {"q": 1}}', [])]:
        order, streamed, calls = read(["<tool_call>" + body + "</tool_call>"])
        assert (streamed, calls) == ([], expect), body
    assert read(['<tool_call>{"name": "search", "parameters": {"q": 1}}</tool_call>'])[2] == [
        ("search", '{"q": 1}', True)]


def test_a_closing_tag_inside_a_string_is_held_until_the_string_closes() -> None:
    text = '<tool_call>{"name": "search", "arguments": {"q": "a</tool_call>b"}}</tool_call>'
    parser = HermesToolParser(NAMES)
    released = ""
    for i, c in enumerate(text):
        released += "".join(p.args for p in parser.feed(c))
        if i < text.index('b"'):
            assert "</tool_call>"[:2] not in released   # not even its start, while the string may end there
    assert released == '{"q": "a</tool_call>b"}'


_PIECES = st.sampled_from([CALL, '<tool_call>{"name": "search", "arguments": {', '"q": "x</tool_call>y"', "}}",
                           "</tool_call>", "<tool_call>", '"', "\\", "\n", ", ", "1", "]", "[", "text ", "<", "}",
                           '{"name": "get_weather", "arguments": {"a": "', "é🙂", "</tool_"])


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=10), cuts=st.lists(st.integers(0, 300), max_size=8),
       end=st.sampled_from(["finish", "finish_forced", "finish_cut"]))
def test_any_chunking_streams_the_same_calls(pieces: list[str], cuts: list[int], end: str) -> None:
    text = "".join(pieces)
    whole = read([text], end)
    bounds = sorted({min(c, len(text)) for c in cuts})
    assert read([text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])], end) == whole
    assert read(list(text), end) == whole
    for name, args, complete in whole[2]:
        if complete and name:
            assert isinstance(json.loads(args), dict)
        j = JsonPrefix()
        assert j.feed(args) == len(args)   # all of it reads as an object's text
        if j.string_at is not None:        # the string it ends in holds no closing tag, nor the start of one at its end
            assert "</tool_call>" not in args[j.string_at:] and not args.endswith("<")


@settings(max_examples=500, deadline=None)
@given(parts=st.lists(st.sampled_from(['"', "\\", "<", "</tool_call>", "</tool", "_call>", "x", "{"]), max_size=14),
       cuts=st.lists(st.integers(0, 60), max_size=6))
def test_the_closing_tag_read_goes_on_where_it_stopped(parts: list[str], cuts: list[int]) -> None:
    """``close_at`` reads a growing body once: the answer equals a read of the whole body from its start."""
    from ferrylm.server.text.tool_parsers.hermes import _close_outside_json_string

    text = "".join(parts)
    tag = "</tool_call>"
    whole = _close_outside_json_string(text, tag)[0]
    i, in_str, found = 0, False, -1
    for b in [*sorted(min(c, len(text)) for c in cuts), len(text)]:
        found, i, in_str = _close_outside_json_string(text[:b], tag, i, in_str)
        if found >= 0:
            break
    assert found == whole
