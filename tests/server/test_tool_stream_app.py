"""Tool calls through the real ``openai`` / ``anthropic`` SDKs against the ASGI app with a scripted engine: a reply
cut by ``max_tokens`` inside its second call ends ``tool_calls`` / ``tool_use`` / ``completed`` with the whole call
only (as vLLM answers), stream and non-stream alike."""

from __future__ import annotations

import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED
from .test_fresh_user_api import anth, oai, scripted
from .test_tool_cut_app import ANTH_WEATHER, MSGS, RESP_WEATHER, WEATHER

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.anyio

FIRST = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
SECOND = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen", "days": 5}}\n</tool_call>'
FIRST_ARGS = '{"city": "Oslo", "days": 3}'


def cut_in_second(codec) -> int:
    """``max_tokens`` that ends the output inside the second call's arguments (after ``"city": "Ber``)."""
    ids = codec.encode(FIRST + SECOND, add_special_tokens=False)
    return next(n for n in range(len(ids)) if '"Ber' in codec.decode(ids[:n]))


async def test_chat_complete_then_cut_is_tool_calls(codec) -> None:
    eng = scripted(codec, FIRST + SECOND)
    client = oai(create_app(eng, codec, SERVED))
    kw = dict(model=SERVED, messages=MSGS, tools=[WEATHER], max_tokens=cut_in_second(codec))
    (choice,) = (await client.chat.completions.create(**kw)).choices
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", FIRST_ARGS)]
    finish, content = None, ""
    async for chunk in await client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content += ch.delta.content or ""
    assert (finish, content) == ("tool_calls", "")
    async with client.chat.completions.stream(**kw) as s:
        final = await s.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.tool_calls[0].function.arguments == FIRST_ARGS


async def test_anthropic_complete_then_cut_is_tool_use(codec) -> None:
    eng = scripted(codec, FIRST + SECOND)
    client = anth(create_app(eng, codec, SERVED))
    kw = dict(model=SERVED, max_tokens=cut_in_second(codec), messages=MSGS, tools=[ANTH_WEATHER])
    msg = await client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in msg.content] == [("tool_use", "get_weather", {"city": "Oslo", "days": 3})]
    async with client.messages.stream(**kw) as s:
        final = await s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name) for b in final.content][0] == ("tool_use", "get_weather")
    assert final.content[0].input == {"city": "Oslo", "days": 3}


async def test_responses_complete_then_cut_is_completed(codec) -> None:
    eng = scripted(codec, FIRST + SECOND)
    client = oai(create_app(eng, codec, SERVED))
    kw = dict(model=SERVED, input="Weather in Oslo?", tools=[RESP_WEATHER], max_output_tokens=cut_in_second(codec))
    r = await client.responses.create(**kw)
    assert r.status == "completed" and r.incomplete_details is None
    assert [(it.type, it.name, it.arguments, it.status) for it in r.output] == [
        ("function_call", "get_weather", FIRST_ARGS, "completed")]
    events = [ev async for ev in await client.responses.create(**kw, stream=True)]
    assert events[-1].type == "response.completed"
    assert [(it.type, it.arguments) for it in events[-1].response.output][0] == ("function_call", FIRST_ARGS)
