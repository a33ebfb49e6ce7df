"""A tool result must answer a call made earlier in the conversation, as OpenAI's and Anthropic's APIs require
(issue 43): a chat ``tool`` message whose ``tool_call_id``, a Responses ``function_call_output`` whose ``call_id``
(earlier calls of ``previous_response_id`` included), an Anthropic ``tool_result`` whose ``tool_use_id`` matches no
earlier call is a 400 naming that field, streaming or not; results that answer a call are served. Also: a
Responses prompt too long for the context names ``input``, not ``messages``."""

from __future__ import annotations

import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine, assert_error, make_client

pytestmark = pytest.mark.anyio

USER = {"role": "user", "content": "Weather in Oslo?"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def chat_history(answered_id: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    return [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, USER,
            {"role": "tool", "tool_call_id": answered_id, "content": "rain"}]


def anthropic_history(answered_id: str) -> list[dict]:
    return [USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": {}}]},
            {"role": "user", "content": [{"type": "text", "text": "and?"},
                                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                         {"type": "tool_result", "tool_use_id": answered_id, "content": "rain"}]}]


@pytest.fixture
async def client(codec):
    async with make_client(create_app(FakeEngine(codec, max_model_len=4096), codec, SERVED)) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_tool_message_answering_no_call_is_a_400(client, stream: bool) -> None:
    body = {"model": SERVED, "max_tokens": 2, "tools": TOOLS, "stream": stream}
    err = assert_error(await client.post("/v1/chat/completions", json={**body, "messages": chat_history("call_9")}),
                       400, param="messages.4.tool_call_id")
    assert "'call_9'" in err["message"]
    orphan_first = [USER, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert_error(await client.post("/v1/chat/completions", json={**body, "messages": orphan_first}), 400,
                 param="messages.1.tool_call_id")
    assert_error(await client.post("/tokenize", json={"model": SERVED, "messages": chat_history("x")}), 400,
                 param="messages.4.tool_call_id")
    r = await client.post("/v1/chat/completions", json={**body, "messages": chat_history("call_1")})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_tool_result_answering_no_tool_use_is_a_400(client, stream: bool) -> None:
    body = {"model": SERVED, "max_tokens": 2, "stream": stream}
    r = await client.post("/v1/messages", json={**body, "messages": anthropic_history("toolu_9")})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "'messages.2.content.2.tool_use_id'" in r.json()["error"]["message"] and "'toolu_9'" in r.text
    r = await client.post("/v1/messages/count_tokens", json={"model": SERVED, "messages": anthropic_history("x")})
    assert r.status_code == 400 and "'messages.2.content.2.tool_use_id'" in r.text, r.text
    r = await client.post("/v1/messages", json={**body, "messages": anthropic_history("toolu_1")})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_output_answering_no_call_is_a_400(client, stream: bool) -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    body = {"model": SERVED, "max_output_tokens": 2, "stream": stream}
    items = [USER, call, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_9", "output": "rain"}]
    assert_error(await client.post("/v1/responses", json={**body, "input": items}), 400, param="input.3.call_id")
    first = await client.post("/v1/responses", json={"model": SERVED, "max_output_tokens": 2, "input": [USER, call]})
    assert first.status_code == 200, first.text
    later = {**body, "previous_response_id": first.json()["id"]}   # answers the stored response's call
    r = await client.post("/v1/responses", json={**later, "input": [
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]})
    assert r.status_code == 200, r.text
    assert_error(await client.post("/v1/responses", json={**later, "input": [
        {"type": "function_call_output", "call_id": "call_2", "output": "sunny"}]}), 400, param="input.0.call_id")


async def test_responses_context_error_names_input(client) -> None:
    r = await client.post("/v1/responses", json={"model": SERVED, "input": "hello world " * 3000})
    err = assert_error(r, 400, param="input", code="context_length_exceeded")
    assert err["message"].startswith("This model's maximum context length is 4096 tokens.")
    assert "your input resulted in" in err["message"] and "messages" not in err["message"], err
