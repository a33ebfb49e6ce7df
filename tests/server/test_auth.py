"""API key: every /v1/* route (and /tokenize, /detokenize) needs it; missing/wrong key → 401 in the OpenAI shape;
/health, /metrics, /version and /openapi.json stay open. Also the request limits (body size) and CORS switch."""

from __future__ import annotations

import pytest

from ferrylm.server.api.app import CorsPolicy, create_app

from .conftest import SERVED, assert_error, make_client

pytestmark = pytest.mark.anyio

KEY = "sekrit-key"
MSGS = [{"role": "user", "content": "hi"}]
PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{SERVED}", None),
    ("POST", "/v1/chat/completions", {"model": SERVED, "messages": MSGS, "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/memory", None),
    ("GET", "/v1/live", None),
    ("POST", "/tokenize", {"model": SERVED, "prompt": "hi"}),
    ("POST", "/detokenize", {"model": SERVED, "tokens": [1, 2]}),
    ("POST", "/v1/responses", {"model": SERVED, "input": "hi", "max_output_tokens": 2}),
    ("POST", "/v1/chat/completions/render", {"model": SERVED, "messages": MSGS}),
    ("POST", "/v1/completions/render", {"model": SERVED, "prompt": "hi"}),
    ("POST", "/v1/responses/render", {"model": SERVED, "input": "hi"}),
]
# Anthropic's routes answer 401 in Anthropic's error shape
ANTHROPIC = [
    ("POST", "/v1/messages", {"model": SERVED, "messages": MSGS, "max_tokens": 2}),
    ("POST", "/v1/messages/count_tokens", {"model": SERVED, "messages": MSGS}),
]
UNKNOWN_RESPONSE = "/v1/responses/resp_unknown"
OPEN = ["/health", "/metrics", "/version", "/openapi.json", "/", "/webui/main.js"]


@pytest.fixture
def keyed_engine(engine):
    engine.memory = lambda: {"plan": {"kv_pages": 1}}   # so /v1/memory answers 200 with the right key
    return engine


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
@pytest.mark.parametrize("headers,ok", [
    ({}, False),
    ({"Authorization": "Bearer wrong"}, False),
    ({"x-api-key": "wrong"}, False),
    ({"Authorization": f"Basic {KEY}"}, False),
    ({"Authorization": f"Bearer {KEY}"}, True),
    ({"authorization": f"bearer {KEY}"}, True),
    ({"x-api-key": KEY}, True),
], ids=["missing", "wrong-bearer", "wrong-x-api-key", "not-bearer", "bearer", "bearer-lowercase", "x-api-key"])
async def test_key_on_each_route(codec, keyed_engine, method, path, body, headers, ok) -> None:
    async with make_client(create_app(keyed_engine, codec, SERVED, api_key=KEY)) as c:
        r = await c.request(method, path, json=body, headers=headers)
    if ok:
        assert r.status_code == 200, (r.status_code, r.text)
    else:
        err = assert_error(r, 401, code="invalid_api_key")
        assert r.json()["error"]["type"] == "authentication_error"
        assert KEY not in err["message"]
        assert r.headers.get("www-authenticate") == "Bearer"


@pytest.mark.parametrize("path", OPEN)
async def test_open_routes_need_no_key(codec, keyed_engine, path) -> None:
    async with make_client(create_app(keyed_engine, codec, SERVED, api_key=KEY)) as c:
        assert (await c.get(path)).status_code == 200


async def test_every_v1_route_is_covered(codec, keyed_engine) -> None:
    """A new /v1 route must be added to PROTECTED (and so be tested for the key)."""
    app = create_app(keyed_engine, codec, SERVED, api_key=KEY)
    paths = {getattr(r, "path", "") for r in app.routes}
    v1 = {p.replace("{model_id:path}", SERVED).replace("{response_id}", "resp_unknown")
          for p in paths if p.startswith("/v1/")}
    assert v1 <= {p for _, p, _ in PROTECTED + ANTHROPIC} | {UNKNOWN_RESPONSE}, v1


@pytest.mark.parametrize("method,path,body", ANTHROPIC, ids=[p for _, p, _ in ANTHROPIC])
async def test_key_on_anthropic_routes(codec, keyed_engine, method, path, body) -> None:
    async with make_client(create_app(keyed_engine, codec, SERVED, api_key=KEY)) as c:
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            r = await c.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": r.json()["error"]["message"]}}
            assert KEY not in r.text
        for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
            r = await c.request(method, path, json=body, headers=headers)
            assert r.status_code == 200, r.text


async def test_key_on_stored_responses(codec, keyed_engine) -> None:
    async with make_client(create_app(keyed_engine, codec, SERVED, api_key=KEY)) as c:
        assert_error(await c.get(UNKNOWN_RESPONSE), 401, code="invalid_api_key")
        assert_error(await c.get(UNKNOWN_RESPONSE, headers={"x-api-key": KEY}), 404, param="response_id")


async def test_no_key_configured_means_open(client) -> None:
    assert (await client.get("/v1/models")).status_code == 200


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
async def test_overflowing_float_literal_is_400(client, field) -> None:
    body = b'{"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "%s": 1e400}' % field.encode()
    assert_error(await client.post("/v1/chat/completions", content=body), 400)


# ---- limits -------------------------------------------------------------------------------------------------

async def test_body_over_max_request_bytes_is_413_in_openai_shape(codec, engine) -> None:
    async with make_client(create_app(engine, codec, SERVED, max_request_bytes=1000)) as c:
        big = {"model": SERVED, "messages": [{"role": "user", "content": "x" * 2000}]}
        r = await c.post("/v1/chat/completions", json=big)
        assert_error(r, 413, code="request_too_large")

        async def chunks():   # no Content-Length: the limit is enforced while reading
            yield b'{"model": "tiny-model", "prompt": "'
            for _ in range(20):
                yield b"y" * 100
            yield b'"}'
        r = await c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert_error(r, 413, code="request_too_large")
        ok = await c.post("/v1/chat/completions", json={"model": SERVED, "messages": MSGS, "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.parametrize("body,param", [
    ({"model": SERVED, "messages": []}, "messages"),
    ({"model": SERVED, "messages": MSGS, "stop": [str(i) for i in range(17)]}, "stop"),
    ({"model": SERVED, "messages": MSGS, "n": 17}, "n"),
    ({"model": SERVED, "messages": MSGS, "max_tokens": 10**30}, None),
    ({"model": SERVED, "messages": MSGS, "max_tokens": 0}, "max_tokens"),
], ids=["empty-messages", "too-many-stops", "n-too-large", "huge-max-tokens", "zero-max-tokens"])
async def test_limits_are_400(client, body, param) -> None:
    assert_error(await client.post("/v1/chat/completions", json=body), 400, param=param)


async def test_cors_off_by_default_on_when_allowed(codec, engine) -> None:
    hdr = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    async with make_client(create_app(engine, codec, SERVED)) as c:
        r = await c.get("/v1/models", headers={"Origin": "https://ui.example"})
        assert "access-control-allow-origin" not in r.headers
    async with make_client(create_app(engine, codec, SERVED, cors=CorsPolicy(["https://ui.example"]))) as c:
        r = await c.options("/v1/chat/completions", headers=hdr)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
        r = await c.options("/v1/chat/completions", headers={**hdr, "Origin": "https://evil.example"})
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"


async def test_openapi_documents_routes_and_bodies(client) -> None:
    s = (await client.get("/openapi.json")).json()
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        ref = s["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in s["components"]["schemas"]
    for path in ("/v1/models", "/v1/memory", "/health", "/metrics", "/version", "/v1/models/{model_id}"):
        assert any(p.replace(":path", "") == path for p in s["paths"]), (path, list(s["paths"]))
    chat = s["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["properties"] and "messages" in chat.get("required", [])
    assert "ChatCompletionResponse" in s["components"]["schemas"]
