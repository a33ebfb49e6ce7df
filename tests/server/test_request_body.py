"""Request bodies as clients send them (issue 43): a ``Content-Encoding: gzip`` / ``deflate`` body is decoded on
every JSON route, bounded by ``--max-request-bytes`` after decompressing (a zip bomb is refused once the limit is
passed, without inflating the rest); another coding is a 415 naming Content-Encoding; a body that is not valid in its
coding a 400 naming it."""

from __future__ import annotations

import gzip
import json
import time
import zlib

import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine, assert_error, make_client, parse_sse

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hi"}]
BODIES = {"/v1/chat/completions": {"messages": USER, "max_tokens": 3},
          "/v1/completions": {"prompt": "hi", "max_tokens": 3},
          "/v1/messages": {"messages": USER, "max_tokens": 3},
          "/v1/responses": {"input": "hi", "max_output_tokens": 3},
          "/tokenize": {"prompt": "hi"}}
LIMIT = 64 << 10


@pytest.fixture
async def client(codec):
    async with make_client(create_app(FakeEngine(codec), codec, SERVED, max_request_bytes=LIMIT)) as c:
        yield c


def raw(path: str, **extra) -> bytes:
    return json.dumps({"model": SERVED, **BODIES[path], **extra}).encode()


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_a_compressed_body_is_served_as_the_plain_one(client, path: str) -> None:
    plain = await client.post(path, content=raw(path))
    assert plain.status_code == 200, plain.text
    deflated = zlib.compress(raw(path))
    two_members = gzip.compress(raw(path)[:10]) + gzip.compress(raw(path)[10:])   # gzip allows several members
    for coding, body in (("gzip", gzip.compress(raw(path))), ("x-gzip", two_members), ("deflate", deflated),
                         ("identity", raw(path)), ("GZIP", gzip.compress(raw(path)))):
        r = await client.post(path, content=body, headers={"content-type": "application/json",
                                                           "content-encoding": coding})
        assert r.status_code == 200, (coding, r.text)
        if path == "/tokenize":
            assert r.json() == plain.json()
    if path != "/tokenize":   # a stream too
        r = await client.post(path, content=gzip.compress(raw(path, stream=True)),
                              headers={"content-encoding": "gzip"})
        assert r.status_code == 200 and r.text.rstrip().endswith(("[DONE]", '{"type": "message_stop"}',
                                                                  "}")), r.text[-200:]


async def test_a_zip_bomb_is_refused_at_the_limit_without_inflating_it(client) -> None:
    bomb = gzip.compress(raw("/v1/chat/completions", x="a" * (48 << 20)), compresslevel=9)   # 48 MiB inflated
    assert len(bomb) < LIMIT
    t0 = time.monotonic()
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = await client.post(path, content=bomb, headers={"content-encoding": "gzip"})
        assert r.status_code == 413, r.text
        assert "decompresses to more than" in r.text and str(LIMIT) in r.text
    assert time.monotonic() - t0 < 5.0
    assert r.json()["error"]["type"] == "request_too_large"   # Anthropic's shape
    just_over = gzip.compress(raw("/v1/chat/completions", x="a" * LIMIT))
    assert_error(await client.post("/v1/chat/completions", content=just_over, headers={"content-encoding": "gzip"}),
                 413, code="request_too_large")


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "gzip, gzip", "nonsense"])
async def test_another_coding_is_a_415_naming_the_header(client, coding: str) -> None:
    body = raw("/v1/chat/completions")
    err = assert_error(await client.post("/v1/chat/completions", content=body, headers={"content-encoding": coding}),
                       415, param="Content-Encoding", code="unsupported_media_type")
    assert "Content-Encoding" in err["message"]
    r = await client.post("/v1/messages", content=raw("/v1/messages"), headers={"content-encoding": coding})
    assert r.status_code == 415 and "Content-Encoding" in r.json()["error"]["message"], r.text


async def test_a_body_that_is_not_its_coding_is_a_400_naming_the_header(client) -> None:
    whole = gzip.compress(raw("/v1/chat/completions"))
    for body in (raw("/v1/chat/completions"), whole[:-8], whole + b"trailing junk"):
        assert_error(await client.post("/v1/chat/completions", content=body, headers={"content-encoding": "gzip"}),
                     400, param="Content-Encoding")


async def test_a_stream_from_a_gzip_body_ends_as_a_plain_one(client) -> None:
    r = await client.post("/v1/chat/completions", content=gzip.compress(raw("/v1/chat/completions", stream=True)),
                          headers={"content-encoding": "gzip"})
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


async def test_the_openapi_document_lists_415(client) -> None:
    """Schema-driven clients and fuzzers (schemathesis) check every status against the document."""
    paths = (await client.get("/openapi.json")).json()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/tokenize"):
        assert "415" in paths[path]["post"]["responses"], path


async def test_an_integer_too_long_to_read_is_a_400_that_says_so(client) -> None:
    body = b'{"model": "%s", "max_tokens": 1%s, "messages": [{"role": "user", "content": "hi"}]}' % (
        SERVED.encode(), b"0" * 5000)
    r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    err = assert_error(r, 400)
    assert "more than 4300 digits" in err["message"] and "sys." not in err["message"]
    fine = await client.post("/v1/chat/completions", content=raw("/v1/chat/completions", seed=10 ** 30))
    assert fine.status_code != 500 and "digits" not in fine.text
