"""What clients see of the prefix cache (issue 23), against the ASGI app with a scripted engine that emulates a
prefix cache: ``usage.prompt_tokens_details.cached_tokens`` (chat, completions), Anthropic's
``cache_read_input_tokens`` (with ``input_tokens`` the rest of the prompt), Responses'
``input_tokens_details.cached_tokens``, through the real ``openai`` / ``anthropic`` SDKs over several turns;
the prefix-cache metrics from the heartbeat stats."""

from __future__ import annotations

import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine, make_client, parse_sse
from .test_agent_apis import anth, oai
from .test_metrics import sample

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.anyio

SYSTEM = "system: you are a helpful assistant. Say hello to the world. " * 3
PAGE = 4


def cache_engine(codec) -> FakeEngine:
    eng = FakeEngine(codec, max_model_len=4096, prefix_pages=PAGE)
    eng.script = lambda rid, ids, p: codec.encode("Hello world!", add_special_tokens=False) + [eng.eos]
    return eng


async def test_chat_cached_tokens_grow_turn_by_turn(codec) -> None:
    eng = cache_engine(codec)
    client = oai(create_app(eng, codec, SERVED))
    history = [{"role": "system", "content": SYSTEM}]
    seen = []
    for turn in range(3):
        history.append({"role": "user", "content": f"turn {turn}: the quick brown fox"})
        if turn % 2 == 0:
            resp = await client.chat.completions.create(model=SERVED, messages=history, max_tokens=8)
            usage, answer = resp.usage, resp.choices[0].message.content
        else:
            stream = await client.chat.completions.create(model=SERVED, messages=history, max_tokens=8, stream=True,
                                                          stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            usage = chunks[-1].usage
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        seen.append(usage.prompt_tokens_details.cached_tokens)
        assert usage.prompt_tokens == len(eng.requests[-1][1])
        history.append({"role": "assistant", "content": answer})
    assert seen[0] == 0 and 0 < seen[1] < seen[2] < len(eng.requests[-1][1])
    assert all(c % PAGE == 0 for c in seen)


async def test_completions_report_cached_tokens(client, engine: FakeEngine) -> None:
    engine.prefix_pages = PAGE
    body = {"model": SERVED, "prompt": SYSTEM + "one", "max_tokens": 2}
    first = (await client.post("/v1/completions", json=body)).json()["usage"]
    again = (await client.post("/v1/completions", json=body)).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    n = again["prompt_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] == (n - 1) // PAGE * PAGE
    # stream with usage: the last chunk carries it
    r = await client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = parse_sse(r.text)
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // PAGE * PAGE


async def test_anthropic_cache_read_input_tokens_grow(codec) -> None:
    eng = cache_engine(codec)
    client = anth(create_app(eng, codec, SERVED))
    messages: list[dict] = []
    reads = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"turn {turn}: the quick brown fox"})
        if turn < 2:
            msg = await client.messages.create(model=SERVED, max_tokens=8, system=SYSTEM, messages=messages)
            usage = msg.usage
            text = msg.content[0].text
        else:
            async with client.messages.stream(model=SERVED, max_tokens=8, system=SYSTEM, messages=messages) as s:
                final = await s.get_final_message()
            usage, text = final.usage, final.content[0].text
        prompt = len(eng.requests[-1][1])
        assert usage.input_tokens + usage.cache_read_input_tokens == prompt
        assert usage.cache_creation_input_tokens == 0
        reads.append(usage.cache_read_input_tokens)
        messages.append({"role": "assistant", "content": text})
    assert reads[0] == 0 and 0 < reads[1] < reads[2]


async def test_responses_cached_tokens_and_prompt_cache_key(codec) -> None:
    eng = cache_engine(codec)
    client = oai(create_app(eng, codec, SERVED))
    r1 = await client.responses.create(model=SERVED, input="hi there", instructions=SYSTEM, max_output_tokens=8,
                                       extra_body={"prompt_cache_key": "conv-1"})
    r2 = await client.responses.create(model=SERVED, input="and again?", previous_response_id=r1.id,
                                       instructions=SYSTEM, max_output_tokens=8,
                                       extra_body={"prompt_cache_key": "conv-1"})
    assert r1.usage.input_tokens_details.cached_tokens == 0
    assert 0 < r2.usage.input_tokens_details.cached_tokens < r2.usage.input_tokens
    stream = await client.responses.create(model=SERVED, input="third", previous_response_id=r2.id,
                                           instructions=SYSTEM, max_output_tokens=8, stream=True)
    done = [e async for e in stream if e.type == "response.completed"]
    assert done[0].response.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens_details.cached_tokens


async def test_prefix_cache_metrics_from_heartbeat(codec) -> None:
    eng = FakeEngine(codec)
    eng.engine_pid = 1
    eng.last_stats = {"prefix_cache": {"queries": 400, "hits": 300}}
    async with make_client(create_app(eng, codec, SERVED)) as c:
        t = (await c.get("/metrics")).text
        assert sample(t, "ferrylm:prefix_cache_queries_total") == 400
        assert sample(t, "ferrylm:prefix_cache_hits_total") == 300
        assert sample(t, "ferrylm:prefix_cache_hit_rate") == 0.75
        eng.engine_pid = 2                                   # a restarted engine counts from 0 again
        eng.last_stats = {"prefix_cache": {"queries": 100, "hits": 0}}
        t = (await c.get("/metrics")).text
    assert sample(t, "ferrylm:prefix_cache_queries_total") == 500
    assert sample(t, "ferrylm:prefix_cache_hits_total") == 300
    assert sample(t, "ferrylm:prefix_cache_hit_rate") == 0.6
