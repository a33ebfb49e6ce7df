"""What agents and SDKs send, against the ASGI app with a scripted engine: tool calls and structured output on
chat completions, Anthropic Messages and the Responses API through the real ``openai`` / ``anthropic`` SDKs, bad
input as 400s naming the field, SSE keep-alive pings."""

from __future__ import annotations

import json

import httpx
import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine, assert_error, make_client, parse_sse

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def scripted(codec, text: str) -> FakeEngine:
    eng = FakeEngine(codec, max_model_len=4096)   # the tiny tokenizer spells tool schemas out byte by byte
    eng.script = lambda rid, ids, p: codec.encode(text, add_special_tokens=False) + [eng.eos]
    return eng


def oai(app) -> "openai.AsyncOpenAI":
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False))
    return openai.AsyncOpenAI(http_client=http, base_url="http://test/v1", api_key="x", max_retries=0)


def anth(app) -> "anthropic.AsyncAnthropic":
    # the anthropic SDK (2.x) runs on httpx2, a fork of httpx with the same ASGI transport
    hx = pytest.importorskip("httpx2") if "httpx2" in anthropic._base_client.__dict__ else httpx
    http = hx.AsyncClient(transport=hx.ASGITransport(app=app, raise_app_exceptions=False))
    return anthropic.AsyncAnthropic(http_client=http, base_url="http://test", api_key="x", max_retries=0)


# ---------------------------------------------------------------------------------------------------------
# chat completions
# ---------------------------------------------------------------------------------------------------------


async def test_chat_tool_call_stream_equals_non_stream(codec) -> None:
    eng = scripted(codec, CALL_TEXT)
    client = oai(create_app(eng, codec, SERVED))
    resp = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER])
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == \
        ("function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")
    # the prompt carries the tools (the tiny template has no tools section: the documented fallback)
    prompt = codec.decode(eng.requests[0][1], skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert eng.requests[0][2].grammar is None   # auto: parsed, not forced

    stream = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER], stream=True)
    text, calls, finish, first_call_delta = [], {}, None, None
    async for chunk in stream:
        for ch in chunk.choices:
            text.append(ch.delta.content or "")
            for tc in ch.delta.tool_calls or ():
                if tc.index not in calls:
                    first_call_delta = first_call_delta or tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert "".join(text) == "Let me look." and finish == "tool_calls"
    assert first_call_delta.id and first_call_delta.type == "function" and first_call_delta.function.name
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]


async def test_chat_tool_history_round_trip_and_forcing(codec) -> None:
    eng = scripted(codec, CALL_TEXT)
    client = oai(create_app(eng, codec, SERVED))
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    await client.chat.completions.create(model=SERVED, messages=history, tools=[WEATHER], tool_choice="required")
    prompt = codec.decode(eng.requests[-1][1], skip_special_tokens=False)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "get_weather" in eng.requests[-1][2].grammar   # required: enforced by a grammar
    await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER],
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "get_weather" in eng.requests[-1][2].grammar
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER], tool_choice="none")
    assert eng.requests[-1][2].grammar is None and r.choices[0].message.tool_calls is None
    assert "<tools>" not in codec.decode(eng.requests[-1][1], skip_special_tokens=False)


async def test_chat_structured_output_fields_reach_the_engine(codec) -> None:
    eng = scripted(codec, '{"a": 1}')
    client = oai(create_app(eng, codec, SERVED))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    for kwargs in ({"response_format": {"type": "json_object"}},
                   {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                              "strict": True}}},
                   {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}},
                   {"extra_body": {"guided_regex": "[0-9]+"}},
                   {"extra_body": {"json_schema": schema}}):
        r = await client.chat.completions.create(model=SERVED, messages=MSGS, **kwargs)
        assert r.choices[0].message.content == '{"a": 1}'
        assert eng.requests[-1][2].grammar, kwargs
    await client.completions.create(model=SERVED, prompt="x", extra_body={"structured_outputs": {"regex": "a+"}})
    assert eng.requests[-1][2].grammar


BAD = [
    # chat completions
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "bogus"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools.0.function.name"),
    ("/v1/chat/completions", {"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frob"}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"seed": 2**63}, "seed"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("so,needle", [
    ({"choices": ["red", "blue"]}, "unknown key 'choices'"), ({}, "no constraint"), ({"json": None}, "no constraint"),
    ({"json_object": False}, "no constraint"), ({"regex": "a+", "whitespace_patern": " "}, "'whitespace_patern'"),
])
async def test_structured_outputs_without_a_known_constraint_is_400(client: httpx.AsyncClient, path, so,
                                                                    needle) -> None:
    """A typo or an empty object used to be served unconstrained (200)."""
    body = {"model": SERVED, "messages": MSGS, "prompt": "x", "max_tokens": 2, "structured_outputs": so}
    err = assert_error(await client.post(path, json=body), 400, param="structured_outputs")
    assert needle in err["message"] and "choice" in err["message"], err


async def test_structured_outputs_options_of_vllm_are_accepted(client: httpx.AsyncClient) -> None:
    body = {"model": SERVED, "messages": MSGS, "max_tokens": 2,
            "structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True, "disable_fallback": True}}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200


@pytest.mark.parametrize("path,extra,param", BAD, ids=[p for _, _, p in BAD])
async def test_bad_new_fields_are_400_naming_the_field(client: httpx.AsyncClient, path, extra, param) -> None:
    body = {"model": SERVED, "messages": MSGS, "max_tokens": 2, **extra}
    assert_error(await client.post(path, json=body), 400, param=param)


# ---------------------------------------------------------------------------------------------------------
# Anthropic Messages
# ---------------------------------------------------------------------------------------------------------

ANTH_TOOL = {"name": "get_weather", "description": "Current weather",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def test_anthropic_text_and_stream(codec) -> None:
    eng = scripted(codec, "Hello world! done.")
    client = anth(create_app(eng, codec, SERVED))
    msg = await client.messages.create(model=SERVED, max_tokens=64, system="Be brief.",
                                       messages=[{"role": "user", "content": "hi"}])
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "end_turn"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello world! done."
    assert msg.usage.input_tokens == len(eng.requests[0][1]) and msg.usage.output_tokens > 0
    async with client.messages.stream(model=SERVED, max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert text == msg.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == msg.usage.output_tokens
    # stop sequence and max_tokens
    msg = await client.messages.create(model=SERVED, max_tokens=64, stop_sequences=["world"],
                                       messages=[{"role": "user", "content": "hi"}])
    assert (msg.stop_reason, msg.stop_sequence, msg.content[0].text) == ("stop_sequence", "world", "Hello ")
    msg = await client.messages.create(model=SERVED, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert msg.stop_reason == "max_tokens"
    n = await client.messages.count_tokens(model=SERVED, messages=[{"role": "user", "content": "hi"}])
    system_turn = codec.encode("<|im_start|>system\nBe brief.<|im_end|>\n", add_special_tokens=False,
                               parse_special=True)  # template markup: its special tokens
    assert n.input_tokens == len(eng.requests[0][1]) - len(system_turn)


async def test_anthropic_tool_use_round_trip(codec) -> None:
    eng = scripted(codec, CALL_TEXT)
    client = anth(create_app(eng, codec, SERVED))
    msg = await client.messages.create(model=SERVED, max_tokens=128, tools=[ANTH_TOOL],
                                       messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert msg.stop_reason == "tool_use"
    text, use = msg.content
    assert text.text == "Let me look." and use.type == "tool_use"
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"}) and use.id.startswith("toolu_")
    async with client.messages.stream(model=SERVED, max_tokens=128, tools=[ANTH_TOOL],
                                      messages=[{"role": "user", "content": "Weather in Paris?"}]) as s:
        final = await s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[1].input == {"city": "Paris"}
    # the result goes back; "any" forces a call with a grammar
    await client.messages.create(model=SERVED, max_tokens=64, tools=[ANTH_TOOL], tool_choice={"type": "any"},
                                 messages=[{"role": "user", "content": "Weather in Paris?"},
                                           {"role": "assistant", "content": [use.model_dump()]},
                                           {"role": "user", "content": [{"type": "tool_result",
                                                                         "tool_use_id": use.id,
                                                                         "content": "18 C"}]}])
    prompt = codec.decode(eng.requests[-1][1], skip_special_tokens=False)
    assert "<tool_response>\n18 C\n</tool_response>" in prompt and "get_weather" in eng.requests[-1][2].grammar


async def test_anthropic_stream_event_sequence(codec) -> None:
    eng = scripted(codec, CALL_TEXT)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await c.post("/v1/messages", json={"model": SERVED, "max_tokens": 512, "stream": True, "tools": [ANTH_TOOL],
                                               "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [(b.split("\n")[0].removeprefix("event: "), json.loads(b.split("\n")[1].removeprefix("data: ")))
              for b in r.text.strip().split("\n\n") if not b.startswith(":")]   # keep-alive comments aside
    kinds = [k for i, (k, _) in enumerate(events) if i == 0 or k != events[i - 1][0] or k != "content_block_delta"]
    assert all(k == d["type"] for k, d in events)
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",  # noqa
                     "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    assert sorted({d["index"] for k, d in events if k.startswith("content_block")}) == [0, 1]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("body,status,kind", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),             # no max_tokens
    ({"max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                                  "name": "web_search"}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, 400,
     "invalid_request_error"),
    ({"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 404, "not_found_error"),
])
async def test_anthropic_errors_in_anthropic_shape(client: httpx.AsyncClient, body, status, kind) -> None:
    r = await client.post("/v1/messages", json={"model": SERVED, **body})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------------------
# Responses API
# ---------------------------------------------------------------------------------------------------------

RESP_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def test_responses_create_stream_and_previous_id(codec) -> None:
    eng = scripted(codec, "Hello world! done.")
    app = create_app(eng, codec, SERVED)
    client = oai(app)
    r = await client.responses.create(model=SERVED, input="hi", instructions="Be brief.", max_output_tokens=64)
    assert r.status == "completed" and r.output_text == "Hello world! done."
    assert r.usage.input_tokens == len(eng.requests[0][1]) and r.usage.output_tokens > 0
    r2 = await client.responses.create(model=SERVED, input="and again?", previous_response_id=r.id)
    prompt = codec.decode(eng.requests[-1][1], skip_special_tokens=False)
    assert prompt.index("hi") < prompt.index("Hello world! done.") < prompt.index("and again?")
    assert "Be brief." not in prompt   # instructions do not carry over
    assert (await client.responses.retrieve(r2.id)).output_text == r2.output_text
    deltas, kinds, final = [], [], None
    async with client.responses.stream(model=SERVED, input="hi") as s:
        async for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = await s.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    short = await client.responses.create(model=SERVED, input="hi", max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert [it.status for it in short.output if it.type == "message"] == ["incomplete"]   # the cut message too
    events = [ev async for ev in await client.responses.create(model=SERVED, input="hi", max_output_tokens=2,
                                                                stream=True)]
    assert events[-1].type == "response.incomplete"
    assert [it.status for it in events[-1].response.output if it.type == "message"] == ["incomplete"]
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model=SERVED, input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"


async def test_responses_function_calls(codec) -> None:
    eng = scripted(codec, CALL_TEXT)
    client = oai(create_app(eng, codec, SERVED))
    r = await client.responses.create(model=SERVED, input="Weather in Paris?", tools=[RESP_TOOL])
    msg, call = r.output
    assert msg.type == "message" and call.type == "function_call"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    args = []
    async with client.responses.stream(model=SERVED, input="Weather in Paris?", tools=[RESP_TOOL]) as s:
        async for ev in s:
            if ev.type == "response.function_call_arguments.delta":
                args.append(ev.delta)
        final = await s.get_final_response()
    assert json.loads("".join(args)) == {"city": "Paris"} and final.output[1].name == "get_weather"
    r2 = await client.responses.create(model=SERVED, previous_response_id=r.id, tools=[RESP_TOOL], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}], tool_choice="required")
    prompt = codec.decode(eng.requests[-1][1], skip_special_tokens=False)
    assert "<tool_response>\n18 C\n</tool_response>" in prompt and eng.requests[-1][2].grammar
    assert r2.status == "completed"


async def test_responses_store_is_bounded(codec) -> None:
    eng = scripted(codec, "ok")
    client = oai(create_app(eng, codec, SERVED, responses_store_size=1))
    first = await client.responses.create(model=SERVED, input="a")
    await client.responses.create(model=SERVED, input="b")
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=SERVED, input="c", previous_response_id=first.id)
    unstored = await client.responses.create(model=SERVED, input="d", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
async def test_responses_bad_input(client: httpx.AsyncClient, extra, param) -> None:
    err = assert_error(await client.post("/v1/responses", json={"model": SERVED, "input": "x", **extra}), 400,
                       param=param)
    if param == "max_output_tokens":
        assert "'max_output_tokens'" in err["message"] and "'max_tokens'" not in err["message"], err


# ---------------------------------------------------------------------------------------------------------
# reasoning, native tool templates, pings
# ---------------------------------------------------------------------------------------------------------


async def test_reasoning_content_and_native_tools_with_qwen3_template(qwen_codec) -> None:
    eng = scripted(qwen_codec, "<think>\nThe user wants weather.\n</think>\n\n" + CALL_TEXT.split("\n", 1)[1])
    client = oai(create_app(eng, qwen_codec, SERVED))
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER])
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "The user wants weather."
    assert msg.content is None and msg.tool_calls[0].function.name == "get_weather"
    prompt = qwen_codec.decode(eng.requests[-1][1], skip_special_tokens=False)
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt    # the template's own tools section
    stream = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER], stream=True)
    reasoning = "".join([ch.delta.model_extra.get("reasoning_content") or "" async for chunk in stream
                         for ch in chunk.choices])
    assert reasoning == "The user wants weather."
    # a forced call turns thinking off in the template (the grammar starts at the first token)
    await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER], tool_choice="required")
    assert qwen_codec.decode(eng.requests[-1][1], skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    # continue_final_message (vLLM) renders the last assistant turn open
    await client.chat.completions.create(model=SERVED, messages=MSGS + [{"role": "assistant", "content": "It is"}],
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert qwen_codec.decode(eng.requests[-1][1], skip_special_tokens=False).endswith("It is")


async def test_sse_pings_while_waiting(codec) -> None:
    eng = scripted(codec, "Hello")
    eng.delay = 0.25
    app = create_app(eng, codec, SERVED, sse_ping_interval=0.05)
    async with make_client(app) as c:
        r = await c.post("/v1/chat/completions", json={"model": SERVED, "messages": MSGS, "stream": True})
        assert ": ping\n\n" in r.text
        events = parse_sse(r.text.replace(": ping\n\n", ""))
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == "Hello"
        r = await c.post("/v1/messages", json={"model": SERVED, "max_tokens": 9, "stream": True, "messages": MSGS})
        assert "event: ping" in r.text and "event: message_stop" in r.text


# ---------------------------------------------------------------------------------------------------------
# the rest of the OpenAI / vLLM surface
# ---------------------------------------------------------------------------------------------------------


async def test_echo_logprobs_and_max_tokens_zero(client: httpx.AsyncClient, codec) -> None:
    """How lm-evaluation-harness scores a prompt: echo + logprobs + max_tokens 0."""
    prompt = "Hello world! The quick brown fox"
    ids = codec.encode(prompt)
    body = {"model": SERVED, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
    r = (await client.post("/v1/completions", json=body)).json()
    (c,) = r["choices"]
    assert c["text"] == prompt and c["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    lp = c["logprobs"]
    assert lp["tokens"] == [codec.token_text(t) for t in ids]
    assert lp["token_logprobs"] == [None] + [-0.5] * (len(ids) - 1) and lp["top_logprobs"][0] is None
    assert all(len(t) >= 1 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    events = parse_sse((await client.post("/v1/completions", json={**body, "stream": True})).text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == prompt
    assert [t for e in events[:-1] for t in (e["choices"][0]["logprobs"] or {}).get("token_logprobs", [])] == \
        lp["token_logprobs"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # with generated tokens the logprobs continue after the prompt's
    r = (await client.post("/v1/completions", json={**body, "max_tokens": 3})).json()["choices"][0]
    assert len(r["logprobs"]["tokens"]) == len(ids) + 3 and r["text"].startswith(prompt)
    assert r["logprobs"]["text_offset"] == sorted(r["logprobs"]["text_offset"])


async def test_vllm_prompt_logprobs_logprobs_zero_and_token_ids(client: httpx.AsyncClient, codec) -> None:
    ids = codec.encode("Hello world")
    r = (await client.post("/v1/completions", json={"model": SERVED, "prompt": "Hello world", "max_tokens": 3,
                                                    "prompt_logprobs": 1, "logprobs": 0,
                                                    "return_token_ids": True})).json()
    (c,) = r["choices"]
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == len(ids)
    assert c["prompt_logprobs"][1][str(ids[1])] == {"logprob": -0.5, "rank": 1,
                                                    "decoded_token": codec.token_text(ids[1])}
    assert all(len(t) == 1 for t in c["logprobs"]["top_logprobs"])   # logprobs 0: just the sampled token
    assert [list(t) for t in c["logprobs"]["top_logprobs"]] == [[tok] for tok in c["logprobs"]["tokens"]]
    assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == 3
    events = parse_sse((await client.post("/v1/completions", json={
        "model": SERVED, "prompt": "Hello world", "max_tokens": 3, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})).text)
    assert [t for e in events[:-2] for t in e["choices"][0].get("token_ids") or []] == c["token_ids"]
    assert events[0]["choices"][0]["prompt_token_ids"] == ids
    usages = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert usages == sorted(usages) and usages[-1] == 3
    chat = (await client.post("/v1/chat/completions", json={"model": SERVED, "messages": MSGS, "max_tokens": 4,
                                                            "return_token_ids": True})).json()
    assert len(chat["choices"][0]["token_ids"]) == 4 and chat["prompt_token_ids"]
    events = parse_sse((await client.post("/v1/chat/completions", json={
        "model": SERVED, "messages": MSGS, "max_tokens": 4, "stream": True, "return_token_ids": True,
        "stream_options": {"continuous_usage_stats": True}})).text)
    assert [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []] == \
        chat["choices"][0]["token_ids"]
    assert all("usage" in e for e in events[:-1])


async def test_tokenize_continue_final_message_and_token_strs(client: httpx.AsyncClient, codec) -> None:
    msgs = MSGS + [{"role": "assistant", "content": "Sure, it is"}]
    r = (await client.post("/tokenize", json={"model": SERVED, "messages": msgs, "continue_final_message": True,
                                              "add_generation_prompt": False, "return_token_strs": True})).json()
    assert codec.decode(r["tokens"], skip_special_tokens=False).endswith("Sure, it is")
    assert r["token_strs"] == [codec.token_text(t) for t in r["tokens"]]
    assert_error(await client.post("/tokenize", json={"model": SERVED, "messages": msgs,
                                                      "continue_final_message": True,
                                                      "add_generation_prompt": True}), 400,
                 param="continue_final_message")


async def test_stream_whose_headers_left_before_the_first_token_loses_nothing(codec) -> None:
    """Headers at admission (no first event yet), pings off: no keep-alive at all, and no event is dropped."""
    eng = scripted(codec, "Hello world! done.")
    eng.delay = 0.05
    app = create_app(eng, codec, SERVED, sse_ping_interval=0)
    async with make_client(app) as c:
        for path, body in (("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "x"})):
            r = await c.post(path, json={"model": SERVED, "stream": True, "max_tokens": 64, **body})
            events = parse_sse(r.text)
            text = "".join((ch.get("delta") or {}).get("content") or ch.get("text") or ""
                           for e in events[:-1] for ch in e["choices"])
            assert text == "Hello world! done." and ": ping" not in r.text
