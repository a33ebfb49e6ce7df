"""Every bad input gets an OpenAI-shaped error with the right status; never 422."""

from __future__ import annotations

import httpx
import pytest
from pydantic import BaseModel

from ferrylm.errors import EngineUnavailable, InsufficientMemory, QueueTimeout
from ferrylm.server.app import create_app

from .conftest import SERVED, FakeEngine, assert_error, make_client

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


async def post(client: httpx.AsyncClient, body: dict, path: str = CHAT) -> httpx.Response:
    return await client.post(path, json=body)


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, content=b'{"model": "tiny-model", "messages": [',
                          headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_request")


async def test_empty_body_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await client.post(CHAT, content=b""), 400)


async def test_body_not_an_object_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await client.post(CHAT, content=b"[1, 2]"), 400)


async def test_messages_not_a_list_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": SERVED, "messages": "hello"}), 400, param="messages")


async def test_missing_messages_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": SERVED}), 400, param="messages")


async def test_temperature_string_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": SERVED, "messages": MSGS, "temperature": "hot"}), 400,
                 param="temperature")


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
async def test_nan_json_literal_is_400(client: httpx.AsyncClient, literal: bytes) -> None:
    body = b'{"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "temperature": ' + literal + b"}"
    err = assert_error(await client.post(CHAT, content=body), 400)
    assert literal.decode() in err["message"]


async def test_nan_string_temperature_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": SERVED, "messages": MSGS, "temperature": "NaN"}), 400,
                 param="temperature")


async def test_negative_max_tokens_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": SERVED, "messages": MSGS, "max_tokens": -5}), 400, param="max_tokens")


async def test_n_too_large_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": SERVED, "messages": MSGS, "n": 1000}), 400, param="n")


async def test_min_tokens_above_max_tokens_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": SERVED, "messages": MSGS, "max_tokens": 2, "min_tokens": 5}), 400,
                 param="min_tokens")


async def test_bad_role_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": SERVED, "messages": [{"role": "wizard", "content": "x"}]}), 400)


async def test_image_content_part_is_400(client: httpx.AsyncClient) -> None:
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    assert_error(await post(client, {"model": SERVED, "messages": msgs}), 400, param="messages.0.content.0")


async def test_template_error_is_400(client: httpx.AsyncClient) -> None:
    msgs = [{"role": "tool", "content": "result"}]
    err = assert_error(await post(client, {"model": SERVED, "messages": msgs}), 400, param="messages")
    assert "tool_call_id" in err["message"]


async def test_unknown_model_is_404_with_param_model(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": "gpt-9", "messages": MSGS}), 404, param="model", code="model_not_found")
    assert_error(await post(client, {"model": "gpt-9", "prompt": "x"}, "/v1/completions"), 404, param="model")


async def test_unknown_route_is_404(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing-here"), 404)
    assert_error(await client.post("/v2/chat/completions", json={}), 404)


async def test_wrong_method_is_405_in_openai_shape(client: httpx.AsyncClient) -> None:
    assert_error(await client.get(CHAT), 405)


async def test_context_too_long_with_max_tokens_is_400(client: httpx.AsyncClient) -> None:
    err = assert_error(await post(client, {"model": SERVED, "messages": MSGS, "max_tokens": 10_000}), 400,
                       param="max_tokens", code="context_length_exceeded")
    assert err["message"].startswith("This model's maximum context length is 256 tokens. However, you requested ")
    assert "10000 in the completion" in err["message"]


async def test_context_too_long_names_max_completion_tokens(client: httpx.AsyncClient) -> None:
    body = {"model": SERVED, "messages": MSGS, "max_completion_tokens": 300}
    assert_error(await post(client, body), 400, param="max_completion_tokens", code="context_length_exceeded")


async def test_prompt_alone_too_long_is_400(client: httpx.AsyncClient) -> None:
    msgs = [{"role": "user", "content": "hello world " * 300}]
    err = assert_error(await post(client, {"model": SERVED, "messages": msgs}), 400, param="messages",
                       code="context_length_exceeded")
    assert err["message"].startswith("This model's maximum context length is 256 tokens.")


async def test_completions_context_too_long_is_400(client: httpx.AsyncClient) -> None:
    err = assert_error(await post(client, {"model": SERVED, "prompt": list(range(250)), "max_tokens": 10},
                                  "/v1/completions"), 400, param="max_tokens", code="context_length_exceeded")
    assert err["message"].startswith("This model's maximum context length is 256 tokens.")
    assert "250 in the prompt" in err["message"]


async def test_kv_pool_smaller_than_context_limits_requests(codec) -> None:
    eng = FakeEngine(codec, max_model_len=256, kv_pool_tokens=10)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        # the prompt alone (12 tokens) cannot fit the 10-token pool: rejected at once, naming pool and flag
        err = assert_error(await post(c, {"model": SERVED, "messages": MSGS}), 400, code="context_length_exceeded")
        assert err["message"].startswith("This model's maximum context length is 256 tokens.")
        assert "10 tokens" in err["message"] and "--num-tokens" in err["message"]
    eng = FakeEngine(codec, max_model_len=256, kv_pool_tokens=40)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        # fits the pool: served (the engine ends it with "length" if the pool cannot hold more)
        r = await post(c, {"model": SERVED, "messages": MSGS, "max_tokens": 100})
        assert r.status_code == 200, r.text


async def test_out_of_vocab_prompt_ids_are_400(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": SERVED, "prompt": [1, 10**9]}, "/v1/completions"), 400, param="prompt")


async def test_empty_prompt_is_400(client: httpx.AsyncClient) -> None:
    assert_error(await post(client, {"model": SERVED, "prompt": ""}, "/v1/completions"), 400, param="prompt")
    assert_error(await post(client, {"model": SERVED, "prompt": []}, "/v1/completions"), 400, param="prompt")


async def test_echo_with_logprobs_is_400(client: httpx.AsyncClient) -> None:
    body = {"model": SERVED, "prompt": "hi", "echo": True, "logprobs": 1}
    assert_error(await post(client, body, "/v1/completions"), 400, param="echo")


async def test_nothing_is_ever_422(client: httpx.AsyncClient) -> None:
    bad_bodies = [b"", b"{", b"null", b'"x"', b'{"messages": 5}', b'{"messages": [{"role": 1}]}',
                  b'{"messages": [], "n": "two"}', b'{"prompt": {"a": 1}}', b'{"messages": [{}]}',
                  b'{"messages": [{"role": "user", "content": 5}], "stop": 7}']
    for path in (CHAT, "/v1/completions", "/tokenize", "/detokenize"):
        for body in bad_bodies:
            r = await client.post(path, content=body)
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            assert_error(r, 400)


@pytest.mark.parametrize("exc,retry", [(EngineUnavailable("engine restarting"), "5"),
                                       (QueueTimeout("waited 30 s"), "2"),
                                       (InsufficientMemory("no KV pages"), "2")])
async def test_engine_errors_before_start_are_503_with_retry_after(codec, exc, retry) -> None:
    eng = FakeEngine(codec, start_exc=exc)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        for stream in (False, True):
            r = await post(c, {"model": SERVED, "messages": MSGS, "stream": stream})
            assert_error(r, 503, code=exc.code)
            assert r.headers["retry-after"] == retry
    assert eng.aborts  # the frontend told the engine to forget the request


async def test_engine_not_ready_is_503(codec) -> None:
    eng = FakeEngine(codec, health_status="restarting")
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await post(c, {"model": SERVED, "messages": MSGS})
        assert_error(r, 503, code="engine_unavailable")
        assert "Retry-After" in r.headers
        h = await c.get("/health")
        assert h.status_code == 503 and h.json() == {"status": "restarting", "detail": "fake says so"}
    assert eng.requests == []


async def test_engine_error_non_stream_is_mapped(codec) -> None:
    eng = FakeEngine(codec, fail_at=3, fail_exc=InsufficientMemory("out of KV"))
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await post(c, {"model": SERVED, "messages": MSGS})
    assert_error(r, 503, code="insufficient_memory")
    assert r.headers["retry-after"] == "2"


async def test_unexpected_engine_exception_is_500_in_shape(codec) -> None:
    eng = FakeEngine(codec, fail_at=1, fail_exc=RuntimeError("boom"))
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await post(c, {"model": SERVED, "messages": MSGS})
    err = assert_error(r, 500, code="internal_error")
    assert "boom" not in err["message"]  # internals are logged, not sent
    assert r.headers.get("x-request-id")


async def test_api_key(codec, engine) -> None:
    async with make_client(create_app(engine, codec, SERVED, api_key="sekrit")) as c:
        assert_error(await c.get("/v1/models"), 401, code="invalid_api_key")
        assert_error(await c.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert_error(await post(c, {"model": SERVED, "messages": MSGS}), 401)
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})).status_code == 200
        assert (await c.get("/v1/models", headers={"x-api-key": "sekrit"})).status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/version")).status_code == 200


class _Body(BaseModel):
    x: int


async def test_fastapi_validation_and_unexpected_errors_use_the_openai_shape(codec, engine) -> None:
    app = create_app(engine, codec, SERVED)

    @app.post("/test-body")
    async def with_body(body: _Body) -> dict:  # FastAPI validates this body itself
        return {"x": body.x}

    @app.get("/test-crash")
    async def crash() -> dict:
        raise RuntimeError("secret internals")

    async with make_client(app) as c:
        assert_error(await c.post("/test-body", json={"x": "nope"}), 400, param="x")
        assert_error(await c.post("/test-body", content=b"{bad"), 400)
        err = assert_error(await c.get("/test-crash"), 500, code="internal_error")
        assert "secret" not in err["message"]


async def test_generate_raising_before_returning_an_iterator_is_503(codec) -> None:
    class EagerFailEngine(FakeEngine):
        def generate(self, request_id, prompt_token_ids, params):  # a plain function, not an async generator
            self.requests.append((request_id, prompt_token_ids, params))
            raise EngineUnavailable("engine is dead")

    eng = EagerFailEngine(codec)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        for stream in (False, True):
            r = await post(c, {"model": SERVED, "messages": MSGS, "stream": stream})
            assert_error(r, 503, code="engine_unavailable")
