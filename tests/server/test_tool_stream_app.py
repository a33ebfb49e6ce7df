"""Tool calls through the real ``openai`` / ``anthropic`` SDKs against the ASGI app with a scripted engine: a reply
cut by ``max_tokens`` inside its second call is, whole, the first call only and ``tool_calls`` / ``tool_use`` /
``completed`` (as vLLM answers); streamed, the cut call's start went out already, so the stream ends with that call
unfinished and ``length`` / ``max_tokens`` / ``incomplete`` (as OpenAI answers: never a "run your tools" reason over
a call that cannot run). A Hermes call's arguments stream in pieces that join to the non-stream reply's arguments,
also through the SDKs' own stream accumulators."""

from __future__ import annotations

import json

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


async def test_chat_complete_then_cut_whole_and_streamed(codec) -> None:
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
    assert (finish, content) == ("length", "")
    async with client.chat.completions.stream(**kw) as s:
        with pytest.raises(openai.LengthFinishReasonError) as cut_short:   # the SDK's own answer to `length`
            await s.get_final_completion()
    final = cut_short.value.completion
    assert final.choices[0].finish_reason == "length"
    first, cut = final.choices[0].message.tool_calls   # the cut call's start went out before the cut
    assert first.function.arguments == FIRST_ARGS and cut.function.arguments.startswith('{"city": "Ber')
    assert '{"city": "Bergen", "days": 5}'.startswith(cut.function.arguments)


async def test_anthropic_complete_then_cut_whole_and_streamed(codec) -> None:
    eng = scripted(codec, FIRST + SECOND)
    client = anth(create_app(eng, codec, SERVED))
    kw = dict(model=SERVED, max_tokens=cut_in_second(codec), messages=MSGS, tools=[ANTH_WEATHER])
    msg = await client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in msg.content] == [
        ("tool_use", "get_weather", {"city": "Oslo", "days": 3})]
    async with client.messages.stream(**kw) as s:
        final = await s.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [(b.type, b.name) for b in final.content] == [("tool_use", "get_weather")] * 2
    assert [b.input for b in final.content] == [{"city": "Oslo", "days": 3}, {}]   # a cut string is left out


async def test_responses_complete_then_cut_whole_and_streamed(codec) -> None:
    eng = scripted(codec, FIRST + SECOND)
    client = oai(create_app(eng, codec, SERVED))
    kw = dict(model=SERVED, input="Weather in Oslo?", tools=[RESP_WEATHER], max_output_tokens=cut_in_second(codec))
    r = await client.responses.create(**kw)
    assert r.status == "completed" and r.incomplete_details is None
    assert [(it.type, it.name, it.arguments, it.status) for it in r.output] == [
        ("function_call", "get_weather", FIRST_ARGS, "completed")]
    events = [ev async for ev in await client.responses.create(**kw, stream=True)]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert [(it.type, it.status) for it in events[-1].response.output] == [("function_call", "completed"),
                                                                           ("function_call", "incomplete")]
    assert events[-1].response.output[0].arguments == FIRST_ARGS


# ---- arguments streamed as the model writes them ------------------------------------------------------------

NOTES = ("Pack a coat. " * 12 + 'Quote: "fjord" \\ back-slash, é🙂, a tag </tool_call> in text, tab\\t. ') * 2
LONG_ARGS = '{"city": "Oslo", "days": 3, "notes": ' + json.dumps(NOTES, ensure_ascii=False) + "}"
LONG = '<tool_call>\n{"name": "get_weather", "arguments": ' + LONG_ARGS + '}\n</tool_call>'
NOTES_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                  "notes": {"type": "string"}}}


async def test_chat_streams_arguments_that_join_to_the_whole_call(codec) -> None:
    eng = scripted(codec, "Let me check.\n" + LONG)
    client = oai(create_app(eng, codec, SERVED))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": NOTES_PARAMS}}
    kw = dict(model=SERVED, messages=MSGS, tools=[tool])
    (choice,) = (await client.chat.completions.create(**kw)).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (whole,) = choice.message.tool_calls
    assert (whole.function.name, whole.function.arguments) == ("get_weather", LONG_ARGS)
    heads, fragments, finish = [], [], None
    async for chunk in await client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or ():
                assert tc.index == 0
                if tc.id is not None:
                    heads.append((tc.id, tc.type, tc.function.name, tc.function.arguments))
                elif tc.function.arguments:
                    assert tc.function.name is None
                    fragments.append(tc.function.arguments)
    assert len(heads) == 1 and heads[0][1:] == ("function", "get_weather", "")
    assert len(fragments) > 10 and "".join(fragments) == LONG_ARGS and finish == "tool_calls"
    async with client.chat.completions.stream(**kw) as s:   # the SDK's own accumulator
        final = await s.get_final_completion()
    (acc,) = final.choices[0].message.tool_calls
    assert (acc.type, acc.function.name, acc.function.arguments) == ("function", "get_weather", LONG_ARGS)
    assert final.choices[0].finish_reason == "tool_calls" and final.choices[0].message.content == "Let me check."


async def test_anthropic_streams_input_json_that_joins_to_the_whole_input(codec) -> None:
    eng = scripted(codec, LONG)
    client = anth(create_app(eng, codec, SERVED))
    kw = dict(model=SERVED, max_tokens=2000, messages=MSGS,
              tools=[{"name": "get_weather", "input_schema": NOTES_PARAMS}])
    msg = await client.messages.create(**kw)
    (block,) = msg.content
    assert msg.stop_reason == "tool_use" and (block.type, block.name) == ("tool_use", "get_weather")
    assert block.input == json.loads(LONG_ARGS)
    partial, kinds = [], []
    async with client.messages.stream(**kw) as s:
        async for ev in s:
            kinds.append(ev.type)
            if ev.type == "input_json":
                partial.append(ev.partial_json)
        final = await s.get_final_message()   # the SDK reads the partial JSON after every delta
    assert len(partial) > 10 and "".join(partial) == LONG_ARGS
    assert kinds.count("content_block_start") == 1 and kinds.count("content_block_stop") == 1
    (acc,) = final.content
    assert (acc.type, acc.name, acc.id, acc.input) == ("tool_use", "get_weather", acc.id, block.input)
    assert final.stop_reason == "tool_use"


async def test_responses_streams_arguments_that_join_to_the_whole_call(codec) -> None:
    eng = scripted(codec, LONG)
    client = oai(create_app(eng, codec, SERVED))
    kw = dict(model=SERVED, input="Weather in Oslo?",
              tools=[{"type": "function", "name": "get_weather", "parameters": NOTES_PARAMS}])
    (item,) = (await client.responses.create(**kw)).output
    assert (item.type, item.name, item.arguments, item.status) == ("function_call", "get_weather", LONG_ARGS,
                                                                    "completed")
    deltas = []
    async with client.responses.stream(**kw) as s:
        async for ev in s:
            if ev.type == "response.function_call_arguments.delta":
                deltas.append(ev.delta)
        final = await s.get_final_response()
    assert len(deltas) > 10 and "".join(deltas) == LONG_ARGS
    (acc,) = final.output
    assert (acc.type, acc.name, acc.arguments, acc.status) == ("function_call", "get_weather", LONG_ARGS,
                                                               "completed")
