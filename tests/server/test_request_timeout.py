"""The server-side request deadline (issue 15): ``--request-timeout`` / the ``x-request-timeout`` header become the
engine request's absolute deadline (counted from arrival); a bad header is a 400 naming it; the engine's
``request_timeout`` error is a 408."""

from __future__ import annotations

import time

import pytest

from ferrylm.engine.outputs import EngineOutput
from ferrylm.server.api.app import create_app
from tests.server.conftest import SERVED, FakeEngine, assert_error, make_client

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
