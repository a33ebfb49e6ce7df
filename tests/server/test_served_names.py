"""Several served model names, as vLLM takes them (issue 43): ``--served-model-name a b`` is two names, not the
model ``b``; each is accepted in ``model`` on every route, ``/v1/models`` lists them in order, responses (stream or
not) report the first; an unknown name is a 404 naming ``model`` and the served ones."""

from __future__ import annotations

import pytest

from ferrylm.cli import build_parser, parse_args
from ferrylm.server.api.app import create_app
from ferrylm.server.process.launch import check_serve_args

from .conftest import FakeEngine, assert_error, make_client, parse_sse

pytestmark = pytest.mark.anyio

NAMES = ["team-model", "gpt-4o-mini", "team-model"]   # the repeat is listed once
USER = [{"role": "user", "content": "hi"}]


def test_the_flag_takes_several_names() -> None:
    a = parse_args(build_parser(), ["serve", "smollm2-135m", "--served-model-name", "a", "b"])
    assert (a.model, a.served_model_name, a.notes) == ("smollm2-135m", ["a", "b"], [])
    b = parse_args(build_parser(), ["serve", "--served-model-name", "a", "b"])
    assert b.served_model_name == ["a", "b"] and b.model == "smollm2-moe"
    (note,) = b.notes   # no MODEL: said, in case the last name was meant as one
    assert "smollm2-moe" in note and "--served-model-name takes every word" in note
    c = parse_args(build_parser(), ["serve", "--served-model-name", "a", "--model", "m"])
    assert (c.served_model_name, c.model, c.notes) == (["a"], "m", [])
    assert "must not be empty" in check_serve_args(parse_args(build_parser(), ["serve", "--served-model-name", "a", ""]),
                                                    None)


@pytest.fixture
async def client(codec):
    async with make_client(create_app(FakeEngine(codec), codec, NAMES)) as c:
        yield c


async def test_models_lists_every_name_and_each_is_served_as_the_first(client) -> None:
    r = await client.get("/v1/models")
    assert [m["id"] for m in r.json()["data"]] == ["team-model", "gpt-4o-mini"]
    assert (await client.get("/v1/models/gpt-4o-mini")).json()["id"] == "gpt-4o-mini"
    assert_error(await client.get("/v1/models/other"), 404, param="model")
    for name in ("team-model", "gpt-4o-mini"):
        r = await client.post("/v1/chat/completions", json={"model": name, "messages": USER, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "team-model", r.text
        r = await client.post("/v1/chat/completions", json={"model": name, "messages": USER, "max_tokens": 2,
                                                            "stream": True})
        assert {e["model"] for e in parse_sse(r.text)[:-1]} == {"team-model"}
        r = await client.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
        assert r.json()["model"] == "team-model", r.text
        r = await client.post("/v1/messages", json={"model": name, "messages": USER, "max_tokens": 2})
        assert r.json()["model"] == "team-model", r.text
        r = await client.post("/v1/responses", json={"model": name, "input": "hi", "max_output_tokens": 2})
        assert r.json()["model"] == "team-model", r.text
        assert (await client.post("/tokenize", json={"model": name, "prompt": "hi"})).status_code == 200
    err = assert_error(await client.post("/v1/chat/completions", json={"model": "b", "messages": USER}), 404,
                       param="model")
    assert "'team-model'" in err["message"] and "'gpt-4o-mini'" in err["message"], err


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "hi"}),
    ("/v1/messages", {"messages": USER, "max_tokens": 2}), ("/v1/responses", {"input": "hi"}),
])
async def test_an_empty_model_is_a_404_and_an_absent_one_is_served(client, path, body) -> None:
    """docs/API.md: a served name or absent; ``""`` is neither (it used to be served as absent)."""
    r = await client.post(path, json={"model": "", **body, "max_tokens": 2})
    assert r.status_code == 404 and "The model '' does not exist" in r.json()["error"]["message"], r.text
    if path != "/v1/messages":   # Anthropic's error shape has no param
        assert r.json()["error"]["param"] == "model"
    assert (await client.post(path, json={**body, "max_tokens": 2})).status_code == 200
