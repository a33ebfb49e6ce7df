"""``JsonPrefix``: the incremental check behind streamed tool-call arguments. It takes exactly a whole JSON object
(any chunking), stops before the first character no object could continue with, and every prefix it takes is read
by the SDKs' partial JSON reader (jiter, which the ``anthropic`` SDK runs on each ``input_json_delta``)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.server.text.json_limits import MAX_JSON_DEPTH
from ferrylm.server.text.tool_parsers.json_prefix import JsonPrefix

jiter = pytest.importorskip("jiter")

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                       max_leaves=12)
_OBJECTS = st.dictionaries(st.text(max_size=5), _VALUES, max_size=4)


def take(text: str, chunk: int = 0) -> JsonPrefix:
    j = JsonPrefix()
    for i in range(0, len(text), chunk or max(len(text), 1)):
        j.feed(text[i:i + (chunk or len(text))])
    return j


@settings(max_examples=300, deadline=None)
@given(obj=_OBJECTS, indent=st.sampled_from([None, 0, 2]), ascii_=st.booleans(), chunk=st.integers(1, 7))
def test_a_whole_object_is_taken_exactly_and_every_prefix_reads(obj, indent, ascii_, chunk) -> None:
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_)
    j = take(text + "\n</tool_call>", chunk)
    assert (j.done, j.broken, j.taken) == (True, False, len(text))
    for k in range(1, len(text), max(1, len(text) // 23)):   # the SDKs read no empty buffer
        p = take(text[:k])
        assert (p.taken, p.done, p.broken) == (k, False, False)
        jiter.from_json(text[:k].encode(), partial_mode=True)   # raises on a prefix it cannot read


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet='{}[]":,-+.0123456789eEtrufalsn \\u\n\x01ab<', max_size=24))
def test_the_taken_text_is_a_prefix_of_an_object_and_stops_where_none_is(text) -> None:
    """What is taken is valid JSON (done) or readable as a prefix; a break is where ``json.loads`` agrees the text
    stops being an object: the whole text parses as one only when it was taken whole and done."""
    j = take(text)
    head = text[:j.taken]
    if j.done:
        assert isinstance(json.loads(head), dict)
    elif head:
        jiter.from_json(head.encode(), partial_mode=True)
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and text.lstrip() == text:
        assert j.done and text[j.taken:].strip() == ""


@pytest.mark.parametrize("bad, at", [('{"a": tru}', 9), ('{"a": 1.}', 8), ('{"a": 01}', 7), ('{"a"  1}', 6),
                                     ('{"a": "x\ny"}', 8), ('{"a": "\\x"}', 8), ('{"a": [1,]}', 9), ('[1]', 0),
                                     ('{"a": 1 <', 8), ('{"a": NaN}', 6), ('{"a": 1]', 7)])
def test_it_stops_at_the_first_character_no_object_continues_with(bad: str, at: int) -> None:
    j = take(bad)
    assert (j.broken, j.taken) == (True, at)


def test_nesting_past_the_limit_breaks() -> None:
    ok = '{"a":' * MAX_JSON_DEPTH
    assert not take(ok).broken
    assert take(ok + "{").broken and take(ok + "[").broken
