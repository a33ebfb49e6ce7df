"""The server-side request deadline (issue 15): ``--request-timeout`` / the ``x-request-timeout`` header become the
engine request's absolute deadline (counted from arrival); a bad header is a 400 naming it; the engine's
``request_timeout`` error is a 408."""

from __future__ import annotations

import time

import pytest

from ferrylm.engine.outputs import EngineOutput
from ferrylm.server.api.app import create_app
from tests.server.conftest import SERVED, FakeEngine, assert_error, make_client, parse_sse

pytestmark = pytest.mark.anyio

CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_deadline_reaches_the_engine_from_the_flag_and_the_header(codec):
    engine = FakeEngine(codec)
    async with make_client(create_app(engine, codec, SERVED, request_timeout=600.0)) as c:
        t0 = time.monotonic()
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await c.post("/v1/completions", json={"model": SERVED, "prompt": "x", "max_tokens": 2},
                             headers={"x-request-timeout": "2.5"})).status_code == 200
        t1 = time.monotonic()
    (_, _, p1), (_, _, p2) = engine.requests
    assert t0 + 600 <= p1.deadline <= t1 + 600
    assert t0 + 2.5 <= p2.deadline <= t1 + 2.5


async def test_no_deadline_without_flag_and_header(codec):
    engine = FakeEngine(codec)
    async with make_client(create_app(engine, codec, SERVED)) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert engine.requests[0][2].deadline is None


async def test_bad_header_is_a_400_naming_it(codec):
    engine = FakeEngine(codec)
    async with make_client(create_app(engine, codec, SERVED, request_timeout=60.0)) as c:
        for bad in ("soon", "0", "-3", "nan", "inf"):
            r = await c.post("/v1/chat/completions", json=CHAT, headers={"x-request-timeout": bad})
            assert_error(r, 400, param="x-request-timeout")
    assert engine.requests == []


async def test_engine_deadline_error_is_a_408(codec):
    class Late(FakeEngine):
        async def generate(self, request_id, prompt_token_ids, params):
            self.requests.append((request_id, list(prompt_token_ids), params))
            yield EngineOutput(request_id, [], error_code="request_timeout",
                               error_message="the request ran past its deadline")

    engine = Late(codec)
    async with make_client(create_app(engine, codec, SERVED, request_timeout=1.0)) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert_error(r, 408, code="request_timeout")


ROUTES = {"chat": ("/v1/chat/completions", CHAT),
          "completions": ("/v1/completions", {"model": SERVED, "prompt": "x", "max_tokens": 3}),
          "messages": ("/v1/messages", {"model": SERVED, "messages": CHAT["messages"], "max_tokens": 3}),
          "responses": ("/v1/responses", {"model": SERVED, "input": "hi", "max_output_tokens": 3})}
DEADLINE_S = 0.5


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_the_answer_comes_at_the_deadline_while_the_engine_computes(codec, route: str, stream: bool):
    """A prefill (10 s here) that outlasts the deadline: the answer does not wait for the engine's next step
    boundary; it comes at the deadline (408, or the stream's error event and its end) and the engine request is
    aborted."""
    engine = FakeEngine(codec, prefill_delay=10.0)
    path, body = ROUTES[route]
    async with make_client(create_app(engine, codec, SERVED, request_timeout=60.0)) as c:
        t0 = time.monotonic()
        r = await c.post(path, json={**body, "stream": stream}, headers={"x-request-timeout": str(DEADLINE_S)})
        took = time.monotonic() - t0
    assert DEADLINE_S <= took < DEADLINE_S + 1.5, took
    if not stream:
        body = r.json()
        if route == "messages":
            assert r.status_code == 408 and "deadline" in body["error"]["message"], body
        else:
            assert_error(r, 408, code="request_timeout")
    elif route in ("chat", "completions"):
        events = parse_sse(r.text)
        assert events[-2]["error"]["code"] == "request_timeout", events[-2:]
    else:   # the route's error event ends the stream
        last = r.text.rstrip().split("\n\n")[-1]
        assert last.startswith("event: error") and "deadline" in last, r.text[-300:]
    assert engine.aborts == [rid for rid, _, _ in engine.requests] and engine.aborts
