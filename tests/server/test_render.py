"""The render routes (server/api/render.py): a request's prompt ids in vLLM's ``GenerateRequest`` shape, equal to what
the generation route hands the engine for the same body, nothing run; bad input is the generation route's 400
naming the field."""

from __future__ import annotations

import httpx
import pytest

from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.server.api.render import VLLM_SAMPLING_FIELDS

from .conftest import SERVED, FakeEngine, assert_error

pytestmark = pytest.mark.anyio

GENERATE_REQUEST_KEYS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                         "stream_options", "cache_salt", "priority", "kv_transfer_params"}
SAMPLING_KEYS = set(VLLM_SAMPLING_FIELDS) | {"logit_bias"}
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


@pytest.fixture
def engine(codec) -> FakeEngine:
    """A context long enough for the tool fallback's system turn in the tiny tokenizer."""
    return FakeEngine(codec, max_model_len=2048)


def _check_shape(obj: dict) -> None:
    assert set(obj) == GENERATE_REQUEST_KEYS, obj
    assert set(obj["sampling_params"]) == SAMPLING_KEYS, obj["sampling_params"]
    assert obj["features"] is None and obj["cache_salt"] is None and obj["kv_transfer_params"] is None
    assert obj["priority"] == 0 and obj["model"] == SERVED
    assert obj["token_ids"] and all(isinstance(t, int) for t in obj["token_ids"])


def test_vllm_field_names_exist_on_sampling_params() -> None:
    fields = set(SamplingParams.__dataclass_fields__)
    assert set(VLLM_SAMPLING_FIELDS) <= fields


@pytest.mark.parametrize("body", [
    {"messages": MSGS},
    {"messages": MSGS, "max_tokens": 7, "temperature": 0.5, "stop": ["x"], "seed": 3},
    {"messages": MSGS, "tools": [TOOL]},                                       # tools rendered (fallback)
    {"messages": MSGS + [{"role": "assistant", "content": "Hi"}], "continue_final_message": True,
     "add_generation_prompt": False},
], ids=["plain", "sampling", "tools", "continue"])
async def test_chat_render_equals_the_chat_routes_prompt(client: httpx.AsyncClient, engine: FakeEngine,
                                                         body: dict) -> None:
    r = await client.post("/v1/chat/completions/render", json={"model": SERVED, **body},
                          headers={"x-request-id": "req-1"})
    assert r.status_code == 200, r.text
    out = r.json()
    _check_shape(out)
    assert out["request_id"] == "req-1" and out["stream"] is False and out["stream_options"] is None
    assert engine.requests == []                       # nothing was run
    g = await client.post("/v1/chat/completions", json={"model": SERVED, **body})
    assert g.status_code == 200, g.text
    (_, prompt_ids, params), = engine.requests
    assert out["token_ids"] == prompt_ids
    sp = out["sampling_params"]
    assert sp["max_tokens"] == params.max_tokens       # the request's, or the rest of the context
    for k in ("temperature", "top_p", "seed", "stop", "n", "skip_special_tokens"):
        assert sp[k] == getattr(params, k), k
    if "max_tokens" not in body:
        assert sp["max_tokens"] == engine.model_info.max_model_len - len(prompt_ids)
    assert sp["logit_bias"] is None                    # none given: null, as vLLM's


async def test_chat_render_stream_fields_and_logit_bias(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions/render", json={
        "messages": MSGS, "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {"5": -100},
        "top_k": 4})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stream"] is True and out["stream_options"]["include_usage"] is True
    assert out["sampling_params"]["logit_bias"] == {"5": -100.0}   # JSON keys: vLLM's {token id: bias}
    assert out["sampling_params"]["top_k"] == 4


async def test_completions_render_one_object_per_prompt(client: httpx.AsyncClient, engine: FakeEngine,
                                                        codec) -> None:
    r = await client.post("/v1/completions/render", json={"model": SERVED, "prompt": ["Hello world", "Hi there"]},
                          headers={"x-request-id": "c1"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 2
    for o in out:
        _check_shape(o)
        assert o["sampling_params"]["max_tokens"] == 16          # the completions default
    assert [o["request_id"] for o in out] == ["c1-0", "c1-1"]
    assert out[0]["token_ids"] == codec.encode("Hello world") and out[1]["token_ids"] == codec.encode("Hi there")
    ids = codec.encode("Hello there")
    as_ids = (await client.post("/v1/completions/render", json={"prompt": ids})).json()
    assert [o["token_ids"] for o in as_ids] == [ids]
    assert engine.requests == []
    single = (await client.post("/v1/completions/render", json={"prompt": "Hello world", "max_tokens": 3},
                                headers={"x-request-id": "c2"})).json()
    assert [o["request_id"] for o in single] == ["c2"] and single[0]["sampling_params"]["max_tokens"] == 3
    g = await client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 3})
    assert g.status_code == 200
    assert engine.requests[0][1] == single[0]["token_ids"]


async def test_responses_render_equals_the_responses_routes_prompt(client: httpx.AsyncClient,
                                                                   engine: FakeEngine) -> None:
    body = {"model": SERVED, "input": "Hello world", "instructions": "Be brief.", "max_output_tokens": 5}
    r = await client.post("/v1/responses/render", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    _check_shape(out)
    assert out["sampling_params"]["max_tokens"] == 5
    assert engine.requests == []
    assert (await client.post("/v1/responses", json=body)).status_code == 200
    assert engine.requests[0][1] == out["token_ids"]


async def test_render_needs_no_ready_engine(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.health_status = "restarting"
    r = await client.post("/v1/chat/completions/render", json={"messages": MSGS})
    assert r.status_code == 200, r.text
    assert (await client.post("/v1/chat/completions", json={"messages": MSGS})).status_code == 503


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/chat/completions/render", {}, 400, "messages", None),
    ("/v1/chat/completions/render", {"messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": []}]}, 400, "messages.0.content",
     None),
    ("/v1/chat/completions/render", {"messages": MSGS, "max_tokens": "5"}, 400, "max_tokens", None),
    ("/v1/chat/completions/render", {"messages": MSGS, "max_tokens": 10_000}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions/render", {"messages": MSGS, "tool_choice": "required"}, 400, "tool_choice", None),
    ("/v1/chat/completions/render", {"messages": MSGS, "model": "other"}, 404, "model", None),
    ("/v1/completions/render", {}, 400, "prompt", None),
    ("/v1/completions/render", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions/render", {"prompt": [10**9]}, 400, "prompt", None),
    ("/v1/completions/render", {"prompt": "hi", "suffix": "x"}, 400, "suffix", None),
    ("/v1/completions/render", {"prompt": "hi", "model": "other"}, 404, "model", None),
    ("/v1/responses/render", {}, 400, "input", None),
    ("/v1/responses/render", {"input": "hi", "previous_response_id": "resp_nope"}, 400, "previous_response_id",
     None),
], ids=lambda v: v if isinstance(v, str) and v.startswith("/") else None)
async def test_render_bad_input_names_the_field(client: httpx.AsyncClient, engine: FakeEngine, path: str,
                                                body: dict, status: int, param: str, code: str | None) -> None:
    r = await client.post(path, json=body)
    assert_error(r, status, param=param, code=code)
    assert engine.requests == []


async def test_render_routes_in_openapi(client: httpx.AsyncClient) -> None:
    s = (await client.get("/openapi.json")).json()
    for p in ("/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render"):
        assert "post" in s["paths"][p], p
    many = s["paths"]["/v1/completions/render"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert many["type"] == "array"
    assert "RenderedPrompt" in s["components"]["schemas"]
