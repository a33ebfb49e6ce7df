"""What a new user's trial found in the HTTP face (issue 43), through the real ``openai`` / ``anthropic`` SDKs
against the ASGI app with a scripted engine: Anthropic's ``message_start`` carries the cache figures, error ``param``
names, HEAD on the probe routes, CORS. A forced tool call cut by ``max_tokens`` (item 1): test_tool_cut_app.py."""

from __future__ import annotations

import httpx
import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine, make_client

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.anyio

MSGS = [{"role": "user", "content": "Weather in Oslo?"}]


def scripted(codec, text: str, **kw) -> FakeEngine:
    eng = FakeEngine(codec, max_model_len=4096, **kw)
    eng.script = lambda rid, ids, p: codec.encode(text, add_special_tokens=False) + [eng.eos]
    return eng


def oai(app) -> "openai.AsyncOpenAI":
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False))
    return openai.AsyncOpenAI(http_client=http, base_url="http://test/v1", api_key="x", max_retries=0)


def anth(app) -> "anthropic.AsyncAnthropic":
    hx = pytest.importorskip("httpx2") if "httpx2" in anthropic._base_client.__dict__ else httpx
    http = hx.AsyncClient(transport=hx.ASGITransport(app=app, raise_app_exceptions=False))
    return anthropic.AsyncAnthropic(http_client=http, base_url="http://test", api_key="x", max_retries=0)


# ---- item 2: Anthropic message_start and the prefix cache ---------------------------------------------


async def test_anthropic_message_start_has_the_cache_figures_of_a_slow_first_token(codec) -> None:
    """The headers leave before the first token (a long prefill): ``message_start`` still reports the prompt's
    cached tokens, equal to ``message_delta``'s and the non-stream reply's."""
    eng = scripted(codec, "Hello world! done.", prefix_pages=4, delay=0.05)
    app = create_app(eng, codec, SERVED, sse_ping_interval=0.01)
    client = anth(app)
    kw = dict(model=SERVED, max_tokens=20, system="You are a helpful assistant. Say hello to the world.",
              messages=[{"role": "user", "content": "hi"}])
    whole = await client.messages.create(**kw)   # fills the cache
    whole = await client.messages.create(**kw)
    assert whole.usage.cache_read_input_tokens > 0
    starts, deltas = [], []
    async with client.messages.stream(**kw) as s:
        async for ev in s:
            if ev.type == "message_start":
                starts.append(ev.message.usage)
            elif ev.type == "message_delta":
                deltas.append(ev.usage)
    (start,), (delta,) = starts, deltas
    assert (start.input_tokens, start.cache_read_input_tokens) == \
        (whole.usage.input_tokens, whole.usage.cache_read_input_tokens)
    assert (delta.input_tokens, delta.cache_read_input_tokens) == \
        (whole.usage.input_tokens, whole.usage.cache_read_input_tokens)


# ---- item 8: error param names ------------------------------------------------------------------------

BAD = [
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}, {"role": "user"}]},
     "messages.1.content"),
    ("/v1/messages", {"messages": [{"role": "user", "content": ""}]}, "messages.0.content"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[p for _, _, p in BAD])
async def test_errors_name_the_missing_field(client: httpx.AsyncClient, path, body, param) -> None:
    r = await client.post(path, json={"model": SERVED, "max_tokens": 2, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err.get("param", param) == param and param in err["message"], r.text
    assert "constrained-str" not in err["message"] and "function-" not in err["message"]   # pydantic's tags


async def test_sdk_sees_the_param_of_a_null_content(codec) -> None:
    client = oai(create_app(FakeEngine(codec), codec, SERVED))
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": None}])
    assert e.value.param == "messages.0.content"


# ---- item 9: HEAD -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/version", "/metrics", f"/v1/models/{SERVED}"])
async def test_head_answers_as_get_without_a_body(client: httpx.AsyncClient, path) -> None:
    get = await client.get(path)
    head = await client.head(path)
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


async def test_head_of_an_unready_engine_and_of_a_post_route(codec) -> None:
    async with make_client(create_app(FakeEngine(codec, health_status="loading"), codec, SERVED)) as c:
        r = await c.head("/health")
        assert r.status_code == 503 and r.content == b""
        assert (await c.head("/v1/chat/completions")).status_code == 405


# ---- item 11: CORS ---------------------------------------------------------------------------------------


async def test_cors_preflight_and_simple_requests_follow_the_flags(codec) -> None:
    from ferrylm.server.api.app import CorsPolicy

    ui = "https://chat.example"
    pre = {"Origin": ui, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    async with make_client(create_app(FakeEngine(codec), codec, SERVED, api_key="k")) as c:   # off by default
        r = await c.options("/v1/chat/completions", headers=pre)
        assert "access-control-allow-origin" not in r.headers
    app = create_app(FakeEngine(codec), codec, SERVED, api_key="k",
                     cors=CorsPolicy([ui], methods=("GET", "POST"), headers=("authorization", "content-type"),
                                     credentials=True))
    async with make_client(app) as c:
        r = await c.options("/v1/chat/completions", headers=pre)   # no key on a preflight: still answered
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ui
        assert set(r.headers["access-control-allow-methods"].replace(" ", "").split(",")) >= {"GET", "POST"}
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        assert r.headers["access-control-allow-credentials"] == "true"
        r = await c.options("/v1/chat/completions", headers={**pre, "Access-Control-Request-Method": "DELETE"})
        assert r.status_code == 400
        r = await c.post("/v1/chat/completions", headers={"Origin": ui, "Authorization": "Bearer k"},
                         json={"model": SERVED, "messages": MSGS, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ui
        assert "x-request-id" in r.headers["access-control-expose-headers"]


# ---- trial 43b, item 4: a schema that is not an object ---------------------------------------------------

SCHEMA_PARAM = "response_format.json_schema.schema"


@pytest.mark.parametrize("schema,needle", [
    ("hello", f"'{SCHEMA_PARAM}' must be a JSON schema object; got the string 'hello'"),
    (5, f"'{SCHEMA_PARAM}' must be a JSON schema object; got a JSON number"),
    ([{"type": "object"}], f"'{SCHEMA_PARAM}' must be a JSON schema object; got a JSON array"),
    (False, f"'{SCHEMA_PARAM}' is false, a schema that accepts no document"),
    ('{"type": ', f"'{SCHEMA_PARAM}' is not valid JSON"),   # a JSON text of an object, broken: the parser's words
])
async def test_a_schema_that_is_not_an_object_is_named_plainly(client: httpx.AsyncClient, schema, needle) -> None:
    body = {"model": SERVED, "messages": MSGS, "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    r = await client.post("/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == SCHEMA_PARAM and err["message"].startswith(needle), r.text
    assert "Unimplemented" not in err["message"] and '"not"' not in err["message"]


async def test_a_true_schema_or_a_json_text_of_one_is_served(client: httpx.AsyncClient) -> None:
    for schema in (True, '{"type": "object"}'):
        body = {"model": SERVED, "messages": MSGS, "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
