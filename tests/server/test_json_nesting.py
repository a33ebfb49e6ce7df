"""Client JSON nested too deeply is a 400 naming the field it is in, on every route and in every place it can come
from: a tool's schema (the 500 of issue 43: jsonschema's RecursionError), earlier calls' arguments as text or as
an object, a schema sent as a string, template arguments, the body itself; JSON nested up to the limit
(``MAX_JSON_DEPTH`` levels counted from the body) is served. A model's output nested past Python's recursion limit is
text, never an exception."""

from __future__ import annotations

import json

import httpx
import pytest

from ferrylm.server.api.app import create_app
from ferrylm.server.text.json_limits import MAX_JSON_DEPTH
from ferrylm.server.text.tool_parsers import make_tool_parser

from .conftest import SERVED, FakeEngine, assert_error, make_client

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hi"}]


def schema(levels: int) -> dict:
    """An object schema with ``levels`` objects nested in its properties: ``2 * levels + 1`` JSON levels."""
    s: dict = {"type": "object"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


def nested_object(levels: int) -> dict:
    x: dict = {}
    for _ in range(levels - 1):
        x = {"a": x}
    return x


def nested_text(levels: int) -> str:
    return '{"a": ' * (levels - 1) + "{}" + "}" * (levels - 1)


@pytest.fixture
async def client(codec) -> httpx.AsyncClient:
    async with make_client(create_app(FakeEngine(codec, max_model_len=16384), codec, SERVED)) as c:
        yield c


def tool_request(route: str, parameters: dict, stream: bool) -> tuple[str, dict, str]:
    """``(path, body, param)``: a request offering one tool with ``parameters`` and where that schema sits."""
    if route in ("chat", "tokenize"):
        body = {"model": SERVED, "messages": USER, "max_tokens": 2, "stream": stream,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
        return ("/v1/chat/completions" if route == "chat" else "/tokenize"), body, "tools.0.function.parameters"
    if route == "responses":
        return "/v1/responses", {"model": SERVED, "input": "hi", "max_output_tokens": 2, "stream": stream,
                                 "tools": [{"type": "function", "name": "f", "parameters": parameters}]}, \
            "tools.0.parameters"
    path = "/v1/messages" if route == "messages" else "/v1/messages/count_tokens"
    return path, {"model": SERVED, "messages": USER, "max_tokens": 2, "stream": stream,
                  "tools": [{"name": "f", "input_schema": parameters}]}, "tools.0.input_schema"


def assert_names(r: httpx.Response, param: str) -> None:
    """A 400 naming ``param``: OpenAI's ``param``, or in the message of Anthropic's shape."""
    assert r.status_code == 400, (r.status_code, r.text[:300])
    body = r.json()
    if body.get("type") == "error":
        assert f"'{param}'" in body["error"]["message"], body
    else:
        err = assert_error(r, 400, param=param)
        assert f"deeper than {MAX_JSON_DEPTH} levels" in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["chat", "responses", "messages", "tokenize", "count_tokens"])
async def test_a_deep_tool_schema_is_a_400_naming_it(client, route: str, stream: bool) -> None:
    path, body, param = tool_request(route, schema(150), stream)
    assert_names(await client.post(path, json=body), param)
    # at the limit: served (the body and the tool around the schema count; chat's are 4 levels, the others' 3)
    fits = (MAX_JSON_DEPTH - (4 if route in ("chat", "tokenize") else 3) - 1) // 2
    path, body, _ = tool_request(route, schema(fits), stream)
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text[:300]


async def test_deep_json_text_inside_a_field_is_a_400_naming_it(client) -> None:
    """JSON sent as text (earlier arguments, a schema as a string) nested past Python's recursion limit."""
    deep = nested_text(3000)
    chat_call = [*USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": deep}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    cases = [
        ("/v1/chat/completions", {"messages": chat_call}, "messages.1.tool_calls.0.function.arguments"),
        ("/v1/chat/completions", {"messages": USER, "stream": True, "structured_outputs": {"json": deep}},
         "structured_outputs.json"),
        ("/v1/chat/completions", {"messages": USER, "guided_json": deep}, "guided_json"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": deep}}, "structured_outputs.json"),
        ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep},
                                     {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
         "input.0.arguments"),
        ("/tokenize", {"messages": chat_call}, "messages.1.tool_calls.0.function.arguments"),
    ]
    for path, extra, param in cases:
        assert_names(await client.post(path, json={"model": SERVED, "max_tokens": 2, **extra}), param)


async def test_deep_json_in_the_body_names_the_field_it_is_in(client) -> None:
    deep = nested_object(MAX_JSON_DEPTH)
    chat_call = [*USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": deep}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    anthropic_call = [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                                "input": deep}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]
    cases = [
        ("/v1/chat/completions", {"messages": chat_call}, "messages.1.tool_calls.0.function.arguments"),
        ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": deep}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": deep}}}}},
         "response_format.json_schema.schema"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                                              "extra": deep}]}]}, "messages.0"),
        ("/v1/messages", {"messages": anthropic_call}, "messages.1.content.0.input"),
        ("/v1/responses", {"input": "hi", "metadata": deep}, "metadata"),
        ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": deep}}},
         "text.format.schema"),
    ]
    for path, extra, param in cases:
        assert_names(await client.post(path, json={"model": SERVED, "max_tokens": 2, **extra}), param)


async def test_a_body_nested_past_the_parser_is_a_400_saying_so(client) -> None:
    body = json.dumps({"model": SERVED, "messages": USER, "x": "PLACE"}).replace('"PLACE"', "[" * 5000 + "]" * 5000)
    r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    err = assert_error(r, 400)
    assert f"deeper than {MAX_JSON_DEPTH} levels" in err["message"], err


@pytest.mark.parametrize("fmt", ["hermes", "deepseek_v3", "kimi_k2", "qwen3_coder"])
def test_model_output_nested_past_the_recursion_limit_is_no_error(fmt: str) -> None:
    """A model's call whose arguments nest 5000 levels: not a call (the JSON cannot be read), no exception."""
    deep = "[" * 5000 + "]" * 5000
    text = {"hermes": f'<tool_call>\n{{"name": "f", "arguments": {{"a": {deep}}}}}\n</tool_call>',
            "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": " + deep
                           + "}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
                       '{"a": ' + deep + "}<|tool_call_end|><|tool_calls_section_end|>",
            "qwen3_coder": f"<tool_call>\n<function=f>\n<parameter=a>\n{deep}\n</parameter>\n</function>\n"
                           "</tool_call>"}[fmt]
    parser = make_tool_parser(fmt, ("f",), {"f": {"type": "object", "properties": {"a": {"type": "array"}}}})
    pieces = parser.feed(text) + parser.finish()
    assert all(p.call is None or p.call.name == "f" for p in pieces)
