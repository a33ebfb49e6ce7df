"""Property tests of the Anthropic and Responses stream encoders: for any sequence of turn deltas the event
sequence is well formed and adds up to the same content as the non-stream reply."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.server.api import anthropic as an
from ferrylm.server.api import responses as rs
from ferrylm.server.api.assistant import CallDelta, TurnDelta
from ferrylm.server.text.tool_parsers.base import ToolCall

_CALLS = st.builds(lambda n, a: ToolCall(n, json.dumps({"x": a})), st.sampled_from(["f", "g"]), st.integers(0, 9))
#: a turn's parts: reasoning, text, or a call with the cuts of its arguments (none: released whole)
_SEGMENT = st.one_of(st.tuples(st.just("reasoning"), st.sampled_from(["think "])),
                     st.tuples(st.just("content"), st.sampled_from(["text ", "é🙂"])),
                     st.tuples(st.just("call"), _CALLS, st.lists(st.integers(0, 12), max_size=3)))


def _deltas(raw) -> list[TurnDelta]:
    """Deltas as a turn yields them: text first in a delta, a streamed call's parts over several deltas."""
    out, k, d = [], 0, TurnDelta(0)
    for kind, *rest in raw:
        if kind != "call":
            if d.calls:
                out.append(d)
                d = TurnDelta(0)
            setattr(d, kind, getattr(d, kind) + rest[0])
            continue
        call, cuts = rest
        n = len(call.arguments)
        bounds = sorted({min(c, n) for c in cuts})
        pieces = [call.arguments[a:b] for a, b in zip([0, *bounds], [*bounds, n])]
        head = ToolCall(call.name, "", call.id, complete=False)
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            d.calls.append(CallDelta(k, call if last else head, piece, first=i == 0, done=last))
            if not last:
                out.append(d)
                d = TurnDelta(0)
        k += 1
    return out + [d]


def _released(deltas: list[TurnDelta]) -> list[tuple[str, dict]]:
    return [(p.call.name, json.loads(p.call.arguments)) for d in deltas for p in d.calls if p.done]


def _parse(events: list[str]) -> list[tuple[str, dict]]:
    out = []
    for e in events:
        head, data = e.rstrip("\n").split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


@settings(max_examples=200, deadline=None)
@given(raw=st.lists(_SEGMENT, max_size=8), finish=st.sampled_from(["end_turn", "max_tokens", "tool_use"]))
def test_anthropic_events_are_well_formed(raw, finish) -> None:
    deltas = _deltas(raw)
    enc = an.StreamEncoder({"id": "msg_1"})
    events = [enc.start()]
    for d in deltas:
        events += enc.feed(d)
    events += enc.finish(finish, None, 7)
    parsed = _parse(events)
    kinds = [k for k, _ in parsed]
    assert all(k == d["type"] for k, d in parsed)
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks: list[dict] = []
    open_index = None
    for k, d in parsed[1:-2]:
        if k == "content_block_start":
            assert open_index is None and d["index"] == len(blocks)
            open_index = d["index"]
            blocks.append(dict(d["content_block"]))
        elif k == "content_block_delta":
            assert d["index"] == open_index
            b, delta = blocks[-1], d["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial"}[delta["type"]]
            b[field] = b.get(field, "") + delta.get(field if field != "partial" else "partial_json")
        else:
            assert k == "content_block_stop" and d["index"] == open_index
            open_index = None
    assert open_index is None   # every block closed; none for an empty reply, never an empty text block
    assert bool(blocks) == any(d.content or d.reasoning or d.calls for d in deltas)
    assert all(b.get("text") for b in blocks if b["type"] == "text")
    assert "".join(b.get("text", "") for b in blocks) == "".join(d.content for d in deltas)
    assert "".join(b.get("thinking", "") for b in blocks) == "".join(d.reasoning for d in deltas)
    assert [(b["name"], json.loads(b["partial"])) for b in blocks if b["type"] == "tool_use"] == _released(deltas)
    assert parsed[-2][1]["delta"]["stop_reason"] == finish and parsed[-2][1]["usage"] == {"output_tokens": 7}


@settings(max_examples=200, deadline=None)
@given(raw=st.lists(_SEGMENT, max_size=8), incomplete=st.booleans())
def test_responses_events_are_well_formed(raw, incomplete) -> None:
    deltas = _deltas(raw)
    req = rs.ResponsesRequest(input="x")
    enc = rs.StreamEncoder(rs.ResponseShell("resp_1", 0, "m", req, 3))
    events = enc.start()
    for d in deltas:
        events += enc.feed(d)
    done, final = enc.finish(5, incomplete)
    parsed = _parse(events + done)
    assert [d["sequence_number"] for _, d in parsed] == list(range(len(parsed)))
    assert all(k == d["type"] for k, d in parsed)
    assert [k for k, _ in parsed[:2]] == ["response.created", "response.in_progress"]
    assert parsed[-1][0] == ("response.incomplete" if incomplete else "response.completed")
    added = [d["output_index"] for k, d in parsed if k == "response.output_item.added"]
    finished = [d for k, d in parsed if k == "response.output_item.done"]
    assert added == [d["output_index"] for d in finished] == list(range(len(final["output"])))
    assert [d["item"] for d in finished] == final["output"]
    text = "".join(d["delta"] for k, d in parsed if k == "response.output_text.delta")
    assert text == "".join(d.content for d in deltas)
    assert text == "".join(p["text"] for it in final["output"] if it["type"] == "message" for p in it["content"])
    calls = [(it["name"], json.loads(it["arguments"])) for it in final["output"] if it["type"] == "function_call"]
    assert calls == _released(deltas)
    streamed: dict[int, str] = {}
    for k, d in parsed:
        if k == "response.function_call_arguments.delta":
            streamed[d["output_index"]] = streamed.get(d["output_index"], "") + d["delta"]
    assert [json.loads(a) for _, a in sorted(streamed.items())] == [a for _, a in calls]
    assert final["usage"]["output_tokens"] == 5 and final["usage"]["input_tokens"] == 3


def test_response_store_evicts_oldest_by_count_and_bytes() -> None:
    store = rs.ResponseStore(capacity=3, max_bytes=2000)
    convo = [{"role": "user", "content": "x" * 400}]
    for i in range(4):
        store.put(f"r{i}", rs.StoredResponse({"id": f"r{i}"}, convo))
    assert store.get("r0") is None and [store.get(f"r{i}") is not None for i in (1, 2, 3)] == [True] * 3
    store.put("big", rs.StoredResponse({"id": "big"}, [{"role": "user", "content": "y" * 1500}]))
    assert store.get("big") is not None and store.get("r1") is None and store.bytes <= 2000
    store.put("huge", rs.StoredResponse({"id": "huge"}, [{"role": "user", "content": "z" * 5000}]))
    assert store.get("huge") is None and store.get("big") is not None   # larger than the bound: not stored
