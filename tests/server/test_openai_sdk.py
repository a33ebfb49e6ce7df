"""The real ``openai`` SDK against the ASGI app (no sockets)."""

from __future__ import annotations

import httpx
import pytest

from ferrylm.server.api.app import create_app

from .conftest import SCRIPT_TEXT, SERVED, FakeEngine

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio


def sdk(app) -> "openai.AsyncOpenAI":
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False))
    return openai.AsyncOpenAI(http_client=http, base_url="http://test/v1", api_key="x", max_retries=0)


async def test_sdk_chat_non_stream_and_stream(engine: FakeEngine, codec) -> None:
    client = sdk(create_app(engine, codec, SERVED))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    resp = await client.chat.completions.create(model=SERVED, messages=msgs, max_completion_tokens=100,
                                                extra_body={"top_k": 5, "min_p": 0.05})
    assert resp.choices[0].message.content == SCRIPT_TEXT
    assert resp.choices[0].finish_reason == "stop" and resp.usage.completion_tokens > 0
    assert engine.requests[-1][2].top_k == 5

    stream = await client.chat.completions.create(model=SERVED, messages=msgs, stream=True,
                                                  stream_options={"include_usage": True})
    parts, finishes, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finishes.append(ch.finish_reason)
    assert "".join(parts) == resp.choices[0].message.content
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert usage is not None and usage.total_tokens == resp.usage.total_tokens


async def test_sdk_completions_and_models(engine: FakeEngine, codec) -> None:
    client = sdk(create_app(engine, codec, SERVED))
    models = await client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    resp = await client.completions.create(model=SERVED, prompt="Hello", max_tokens=5, logprobs=1)
    assert resp.choices[0].finish_reason == "length" and len(resp.choices[0].logprobs.tokens) == 5
    text = ""
    async for chunk in await client.completions.create(model=SERVED, prompt="Hello", max_tokens=5, stream=True):
        text += chunk.choices[0].text
    assert text == resp.choices[0].text


async def test_sdk_errors_map_to_sdk_exceptions(engine: FakeEngine, codec) -> None:
    client = sdk(create_app(engine, codec, SERVED))
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as ei:
        await client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=100_000)
    assert ei.value.code == "context_length_exceeded"
    assert str(ei.value.body["message"]).startswith("This model's maximum context length is 256 tokens.")
