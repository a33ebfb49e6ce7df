"""Every bad input gets an OpenAI-shaped error with the right status; never 422."""

from __future__ import annotations

import httpx
import pytest
from pydantic import BaseModel

from ferrylm.errors import EngineUnavailable, InsufficientMemory, QueueTimeout, RequestQuarantined
from ferrylm.server.api.app import create_app
from ferrylm.server.api.errors import status_for

from .conftest import SERVED, FakeEngine, assert_error, make_client, parse_sse

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


async def test_wrong_method_is_405_in_openai_shape(client: httpx.AsyncClient, caplog) -> None:
    with caplog.at_level("INFO", logger="ferrylm.server"):
        r = await client.get(CHAT)
    assert assert_error(r, 405)["code"] == "method_not_allowed"
    assert "405 MethodNotAllowed" in caplog.text and "RouteNotFound" not in caplog.text
    assert r.headers["allow"] == "POST"   # RFC 9110 (found by the fuzzer: the handler dropped it)
    r = await client.request("TRACE", "/v1/models")
    assert_error(r, 405)
    assert r.headers["allow"] == "GET"


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


@pytest.mark.parametrize("path,field", [(CHAT, "messages"), ("/v1/completions", "prompt")])
async def test_a_prompt_no_tokenization_could_fit_is_refused_before_tokenizing(client, codec, monkeypatch, path,
                                                                                 field) -> None:
    """Megabytes past the context are refused from their length (the longest vocabulary entry bounds what one
    token covers), not after seconds of tokenizing; a prompt that might fit is still tokenized."""
    from ferrylm.server.text.tokenizer import TextCodec

    def no_encoding(*a, **k):
        raise AssertionError("the prompt was tokenized")

    text = "x" * (2 * codec.longest_token * 256 + 10)   # at least 256 tokens, whatever the tokenizer: the context
    body = {"model": SERVED, "messages": [{"role": "user", "content": text}]} if field == "messages" else \
        {"model": SERVED, "prompt": text}
    with monkeypatch.context() as m:
        m.setattr(TextCodec, "encode", no_encoding)
        m.setattr(TextCodec, "apply_chat_template", no_encoding)
        err = assert_error(await post(client, body, path), 400, param=field, code="context_length_exceeded")
    assert err["message"].startswith("This model's maximum context length is 256 tokens.")
    assert f"{len(text)} characters" in err["message"]
    short = "x" * (codec.longest_token * 256 // 4)   # could be 256 tokens or fewer: tokenized, then judged
    body[field] = [{"role": "user", "content": short}] if field == "messages" else short
    r = await post(client, body, path)
    assert r.status_code in (200, 400) and "characters" not in r.text


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
    err = assert_error(await post(client, {"model": SERVED, "prompt": ""}, "/v1/completions"), 400, param="prompt")
    assert err["message"] == "'prompt' must not be empty (the prompt has no tokens)", err
    assert_error(await post(client, {"model": SERVED, "prompt": []}, "/v1/completions"), 400, param="prompt")


async def test_max_tokens_zero_needs_echo(client: httpx.AsyncClient) -> None:
    body = {"model": SERVED, "prompt": "hi", "max_tokens": 0}
    assert_error(await post(client, body, "/v1/completions"), 400, param="max_tokens")


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
                                       (RequestQuarantined("failed the engine twice"), None)])
async def test_refusals_at_admission_are_http_statuses_for_streams_too(codec, exc, retry) -> None:
    eng = FakeEngine(codec, refuse_exc=exc)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        for stream in (False, True):
            r = await post(c, {"model": SERVED, "messages": MSGS, "stream": stream})
            assert_error(r, status_for(exc), code=exc.code)
            assert r.headers.get("retry-after") == retry
    assert eng.requests == []   # refused before the engine saw it


@pytest.mark.parametrize("exc,retry", [(EngineUnavailable("engine restarting"), "5"),
                                       (QueueTimeout("waited 30 s"), "2"),
                                       (InsufficientMemory("no KV pages"), "2")])
async def test_engine_errors_after_admission_are_503_or_the_streams_error_event(codec, exc, retry) -> None:
    """Admitted, then failed before the first token (a queue timeout, an OOM in the prefill): a non-stream
    request gets the 503; a stream has sent its 200 headers and keep-alive already, so it ends with the error
    event and [DONE]."""
    eng = FakeEngine(codec, start_exc=exc, prefill_delay=0.05)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await post(c, {"model": SERVED, "messages": MSGS})
        assert_error(r, 503, code=exc.code)
        assert r.headers["retry-after"] == retry
        for path, body in ((CHAT, {"messages": MSGS}), ("/v1/completions", {"prompt": "hi"})):
            r = await post(c, {"model": SERVED, "stream": True, **body}, path)
            assert r.status_code == 200 and r.text.startswith(("data: ", ": ping")), r.text
            assert parse_sse(r.text)[-2]["error"]["code"] == exc.code
    assert len(eng.aborts) == 3  # the frontend told the engine to forget each request


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


async def test_generate_raising_before_returning_an_iterator_is_503_or_an_error_event(codec) -> None:
    class EagerFailEngine(FakeEngine):
        def generate(self, request_id, prompt_token_ids, params):  # a plain function, not an async generator
            self.requests.append((request_id, prompt_token_ids, params))
            raise EngineUnavailable("engine is dead")

    eng = EagerFailEngine(codec)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        assert_error(await post(c, {"model": SERVED, "messages": MSGS}), 503, code="engine_unavailable")
        r = await post(c, {"model": SERVED, "messages": MSGS, "stream": True})   # admitted: headers sent
        assert r.status_code == 200 and parse_sse(r.text)[-2]["error"]["code"] == "engine_unavailable"


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
async def test_chat_template_kwargs_named_like_our_own_arguments(client: httpx.AsyncClient, path: str) -> None:
    """Found by the fuzzer: ``chat_template_kwargs: {"messages": ...}`` was a TypeError (500) where the server
    passes its own ``messages`` / ``add_generation_prompt`` / ``tools``. Reserved names are ignored."""
    for kwargs in ({"messages": [{"role": "user", "content": "other"}]}, {"add_generation_prompt": False},
                   {"tools": [1]}, {"conversation": 0}, {"self": 1, "": None}):
        r = await post(client, {"model": SERVED, "messages": MSGS, "max_tokens": 2, "chat_template_kwargs": kwargs},
                       path)
        if "self" in kwargs:   # not reserved: reaches the template call, which refuses it
            assert r.status_code in (200, 400), r.text
        else:
            assert r.status_code == 200, (kwargs, r.text)


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"messages": MSGS, "max_tokens": "3"}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": 3.0}, "max_tokens"),
    (CHAT, {"messages": MSGS, "stream": "true"}, "stream"),
    (CHAT, {"messages": MSGS, "add_generation_prompt": 0}, "add_generation_prompt"),
    ("/v1/completions", {"prompt": [[False]]}, "prompt"),
    ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
])
async def test_json_types_are_the_schema_types(client: httpx.AsyncClient, path: str, body: dict, param: str) -> None:
    """Found by the fuzzer: pydantic's lax mode read "3" / 3.0 as an int, 0 as false and false as token id 0,
    which the schema does not allow (nor does OpenAI's API)."""
    err = assert_error(await post(client, {"model": SERVED, **body}, path), 400)
    assert err["param"].startswith(param), err


async def test_lone_surrogate_is_400(client: httpx.AsyncClient) -> None:
    """Found by the fuzzer: a JSON ``\\ud800`` escape reached the tokenizer (TypeError, 500)."""
    for path, body in ((CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
                       ("/tokenize", b'{"prompt": "\\udfff"}'), ("/v1/completions", b'{"prompt": "x", "\\udc00": 1}')):
        err = assert_error(await client.post(path, content=body), 400)
        assert "surrogate" in err["message"]
    r = await client.post(CHAT, content='{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}')
    assert r.status_code == 200   # an escaped pair is one character


async def test_text_part_without_text_is_400(client: httpx.AsyncClient) -> None:
    body = {"model": SERVED, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}
    assert_error(await post(client, body), 400, param="messages.0.content.0.text")


async def test_extreme_integers_reach_the_engine_in_range(codec) -> None:
    """Found by the fuzzer: top_k = 2**70 passed validation and then overflowed msgpack on the way to the engine
    (500). A seed at the top of its range with n = 2 made choice 1's seed out of range (400). The range is int64,
    as OpenAI's: one past it is a 400 naming ``seed``."""
    from ferrylm.engine import ipc

    eng = FakeEngine(codec)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        for top_k in (2**70, -1):
            r = await post(c, {"model": SERVED, "messages": MSGS, "max_tokens": 1, "top_k": top_k})
            assert r.status_code == 200, r.text
        # below -1 is out of range (issue 26: vLLM's rule, -1 or 0 is off)
        assert_error(await post(c, {"model": SERVED, "messages": MSGS, "max_tokens": 1, "top_k": -2**70}), 400,
                     param="top_k")
        r = await post(c, {"model": SERVED, "messages": MSGS, "max_tokens": 1, "n": 2, "seed": 2**63 - 1})
        assert r.status_code == 200, r.text
        for seed in (2**63, -2**63 - 1, 2**64 - 1):
            assert_error(await post(c, {"model": SERVED, "messages": MSGS, "max_tokens": 1, "seed": seed}), 400,
                         param="seed")
    assert [p.top_k for _, _, p in eng.requests[:2]] == [2**31 - 1, -1]
    assert [p.seed for _, _, p in eng.requests[2:]] == [2**63 - 1, -2**63]
    for rid, ids, p in eng.requests:
        ipc.decode(ipc.encode(ipc.AddRequest(rid, ids, p.to_dict())))


async def test_health_generate_timeout_must_be_a_number(client: httpx.AsyncClient) -> None:
    """``?timeout=nan`` went through min/max unchanged into the event loop's timers."""
    for bad in ("nan", "inf", "1e400", "soon"):
        assert_error(await client.get("/health/generate", params={"timeout": bad}), 400, param="timeout")
    for ok in ("0", "-3", "2.5", "1e9"):
        r = await client.get("/health/generate", params={"timeout": ok})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("limit", [None, 1 << 20])
async def test_client_leaving_while_sending_the_body_is_an_abort_not_a_500(engine, codec, caplog, limit) -> None:
    """A body cut short by a disconnect (Content-Length promised more) is a client abort: status 499, counted as
    client_disconnected, no traceback, no internal_error."""
    app = create_app(engine, codec, SERVED, max_request_bytes=limit)
    messages = [{"type": "http.request", "body": b'{"model": "', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 8000)}
    with caplog.at_level("INFO", logger="ferrylm"):
        await app(scope, receive, send)
    start = [m for m in sent if m["type"] == "http.response.start"]
    assert start and start[0]["status"] == 499
    assert "Traceback" not in caplog.text and "unexpected error" not in caplog.text
    text = app.state.server.metrics.render().decode()
    assert 'code="internal_error"' not in text
    assert f'code="client_disconnected",model_name="{SERVED}"}} 1.0' in text


async def test_tokenization_runs_off_the_event_loop(engine, codec, monkeypatch) -> None:
    """A slow tokenization (a multi-MB prompt) must not stall /health: it runs in a worker thread."""
    import asyncio
    import time

    slow = codec.encode

    def encode(text, *a, **kw):
        time.sleep(1.0)  # blocks its thread, as a huge prompt does
        return slow(text, *a, **kw)

    monkeypatch.setattr(codec, "encode", encode)
    async with make_client(create_app(engine, codec, SERVED)) as c:
        t0 = time.monotonic()
        big = asyncio.create_task(c.post("/v1/completions", json={"model": SERVED, "prompt": "hello",
                                                                  "max_tokens": 1}))
        await asyncio.sleep(0.2)  # the completion is now tokenizing (a blocked loop would stall right here)
        health = await c.get("/health")
        waited = time.monotonic() - t0
        assert health.status_code == 200 and waited < 0.8, waited
        assert (await big).status_code == 200


@pytest.mark.parametrize("body,param,words", [
    ({"messages": MSGS, "logit_bias": {"999999999": 5}}, "logit_bias", "out of range"),
    ({"messages": MSGS, "logit_bias": {"abc": 5}}, "logit_bias", "token ids"),
    ({"messages": MSGS, "logit_bias": {"3": 101}}, "logit_bias", "[-100, 100]"),
    ({"messages": MSGS, "top_logprobs": 3}, "top_logprobs", "'logprobs': true"),
    ({"messages": MSGS, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "'top_logprobs' must be in"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "'messages.0.content' is required"),
])
async def test_found_by_the_fresh_clone_trial(client: httpx.AsyncClient, body: dict, param: str, words: str) -> None:
    """The fresh-clone trial (2026-11-30) found logit_bias silently ignored, top_logprobs without logprobs and a
    user message without content answered 200, and a top_logprobs error naming 'logprobs'."""
    err = assert_error(await post(client, {"model": SERVED, **body}), 400)
    assert err["param"] == param and words in err["message"], err



@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/tokenize"])
@pytest.mark.parametrize("field, value", [("request_id", "someone-elses"), ("isolate", True), ("priority", -10),
                                          ("num_computed_tokens", 5), ("_debug", True), ("faults", "logits")])
async def test_fields_a_client_must_not_set_are_400(client: httpx.AsyncClient, path: str, field: str,
                                                    value) -> None:
    """Issue 18: fields that name the server's own request state (internal flags, scheduling) are refused."""
    body = {"model": SERVED, "max_tokens": 2, field: value}
    body.update({"prompt": "hi"} if path != CHAT else {"messages": MSGS})
    r = await post(client, body, path)
    err = assert_error(r, 400, param=field)
    assert "cannot be set by a client" in err["message"]


async def test_other_unknown_fields_are_still_ignored(client: httpx.AsyncClient) -> None:
    r = await post(client, {"model": SERVED, "messages": MSGS, "max_tokens": 2, "user": "u1", "metadata": {"a": "b"},
                            "store": False, "parallel_tool_calls": True})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
async def test_unknown_fields_are_logged_at_debug_on_every_route(client: httpx.AsyncClient, path: str,
                                                                 caplog) -> None:
    body = {"/v1/chat/completions": {"messages": MSGS, "max_tokens": 2},
            "/v1/completions": {"prompt": "hi", "max_tokens": 2},
            "/v1/messages": {"messages": MSGS, "max_tokens": 2},
            "/v1/responses": {"input": "hi", "max_output_tokens": 2}}[path]
    with caplog.at_level("DEBUG", logger="ferrylm.server"):
        r = await post(client, {"model": SERVED, **body, "zzz_future": 1}, path)
    assert r.status_code == 200, r.text
    assert "ignoring unknown fields: ['zzz_future']" in caplog.text
