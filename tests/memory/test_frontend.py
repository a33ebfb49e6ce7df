"""The frontend side: a host allocation failure while detokenizing fails only that request with 503
insufficient_memory (a stream, whose headers went out at admission: its error event) and the next request is
served; GET /v1/memory serves the engine's plan and honours the API key. Fake engine, no torch model."""

from __future__ import annotations

import pytest

from ferrylm.faults import FaultInjector
from ferrylm.server.api.app import create_app
from ferrylm.server.text.tokenizer import TextCodec
from tests.server.conftest import SERVED, FakeEngine, make_client, parse_sse, tiny_tokenizer_dir  # noqa: F401 - fixture

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def faulty_codec(tiny_tokenizer_dir):  # noqa: F811 - fixture
    codec = TextCodec.from_pretrained(tiny_tokenizer_dir)   # our own: the session codec stays fault-free
    codec.faults = FaultInjector.parse("detokenize:min_prompt=30")
    return codec


async def test_detokenize_oom_fails_only_that_request(faulty_codec):
    eng = FakeEngine(faulty_codec)
    long_prompt = list(range(10, 50))                   # 40 tokens: every detokenizer step fails
    async with make_client(create_app(eng, faulty_codec, SERVED)) as c:
        for stream in (False, True):
            r = await c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 5, "stream": stream})
            if stream:
                assert r.status_code == 200
                err = parse_sse(r.text)[-2]["error"]
            else:
                assert r.status_code == 503 and r.headers["retry-after"]
                err = r.json()["error"]
            assert err["code"] == "insufficient_memory" and "out of memory in the server" in err["message"]
        r = await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert faulty_codec.faults.fired("detokenize") == 2
    assert len(eng.aborts) == 2                         # the engine requests of the failed ones were aborted


class MemoryEngine(FakeEngine):
    def memory(self):
        return {"plan": {"kv_tokens": 1024, "reserve_bytes": 1 << 30}, "live": {"free_bytes": 5},
                "oom_recoveries": {"retry": 2}}


async def test_v1_memory_route(tiny_tokenizer_dir):  # noqa: F811 - fixture
    codec = TextCodec.from_pretrained(tiny_tokenizer_dir)
    async with make_client(create_app(MemoryEngine(codec), codec, SERVED, api_key="k")) as c:
        assert (await c.get("/v1/memory")).status_code == 401
        r = await c.get("/v1/memory", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["plan"]["kv_tokens"] == 1024
        assert r.json()["oom_recoveries"] == {"retry": 2}
    async with make_client(create_app(FakeEngine(codec), codec, SERVED)) as c:   # no plan yet
        r = await c.get("/v1/memory")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
