"""Issue 26 section 3: API edges found by third-party suites and a new user (ASGI app, scripted engine)."""

from __future__ import annotations

import httpx
import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine, assert_error, make_client, parse_sse

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def scripted(codec, text: str, **kw) -> FakeEngine:
    eng = FakeEngine(codec, max_model_len=4096, **kw)
    eng.script = lambda rid, ids, p: codec.encode(text, add_special_tokens=False) + [eng.eos]
    return eng


# --- Content-Type -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/messages", "/v1/responses", "/tokenize"])
async def test_non_json_content_type_is_415(client: httpx.AsyncClient, engine: FakeEngine, ctype: str,
                                            path: str) -> None:
    """As vLLM answers (Unsupported Media Type), even when the body is JSON; the error names Content-Type."""
    body = (b'{"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi", '
            b'"max_tokens": 2}')
    r = await client.post(path, content=body, headers={"content-type": ctype})
    assert r.status_code == 415, r.text
    err = r.json()["error"]   # OpenAI's or Anthropic's error shape
    assert "application/json" in err["message"] and "Content-Type" in err["message"], err
    assert err.get("param", "Content-Type") == "Content-Type"
    assert not engine.requests
    r = await client.post(path, content=body)   # no Content-Type at all: read as JSON (vLLM / FastAPI do)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                   "application/vnd.api+json"])
async def test_json_content_types_pass(client: httpx.AsyncClient, ctype: str) -> None:
    body = b'{"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    r = await client.post(CHAT, content=body, headers={"content-type": ctype})
    assert r.status_code == 200, r.text


# --- the finishing stream chunk ---------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, {"max_tokens": 3}, {"logprobs": True, "top_logprobs": 1},
                                   {"n": 2}])
async def test_stream_finish_chunk_has_empty_delta(client: httpx.AsyncClient, extra: dict) -> None:
    r = await client.post(CHAT, json={"model": SERVED, "messages": MSGS, "stream": True, **extra})
    events = parse_sse(r.text)[:-1]
    finishing = [(ch, ev) for ev in events for ch in ev["choices"] if ch["finish_reason"] is not None]
    assert len(finishing) == extra.get("n", 1)
    for ch, ev in finishing:
        assert ch["delta"] == {}, ch
        assert ch.get("logprobs") is None
        assert len(ev["choices"]) == 1
    text = "".join(ch["delta"].get("content") or "" for ev in events for ch in ev["choices"] if ch["index"] == 0)
    assert text   # the text went out before, in chunks of its own


# --- reasoning: a client prefill inside <think> ------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_inside_open_think_stays_reasoning(qwen_codec, stream: bool) -> None:
    eng = scripted(qwen_codec, " the weather is sunny.\n</think>\n\nIt is sunny.")
    msgs = MSGS + [{"role": "assistant", "content": "<think>\nLet me see:"}]
    async with make_client(create_app(eng, qwen_codec, SERVED)) as c:
        r = await c.post(CHAT, json={"model": SERVED, "messages": msgs, "stream": stream,
                                     "continue_final_message": True, "add_generation_prompt": False})
        assert r.status_code == 200, r.text
        if stream:
            events = parse_sse(r.text)[:-1]
            deltas = [ch["delta"] for ev in events for ch in ev["choices"]]
            content = "".join(d.get("content") or "" for d in deltas)
            reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        else:
            msg = r.json()["choices"][0]["message"]
            content, reasoning = msg["content"], msg["reasoning_content"]
    assert qwen_codec.decode(eng.requests[-1][1], skip_special_tokens=False).endswith("<think>\nLet me see:")
    assert "</think>" not in content
    assert content == "It is sunny."
    assert reasoning == "the weather is sunny." or reasoning == " the weather is sunny."


# --- Anthropic / Responses non-stream blocks in generation order ------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_OAI = {"type": "function", "name": "get_weather", "description": "weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_ANT = {"name": "get_weather", "description": "weather", "input_schema": WEATHER_OAI["parameters"]}


@pytest.mark.parametrize("text,order", [
    (CALL + "\nI asked for the weather.", ["tool_use", "text"]),
    ("Looking it up.\n" + CALL, ["text", "tool_use"]),
    ("First.\n" + CALL + "\nThen.", ["text", "tool_use", "text"]),
])
async def test_anthropic_non_stream_blocks_in_generation_order(codec, text: str, order: list[str]) -> None:
    eng = scripted(codec, text)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await c.post("/v1/messages", json={"model": SERVED, "max_tokens": 200, "messages": MSGS,
                                              "tools": [WEATHER_ANT]})
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == order, blocks
    assert [b["input"] for b in blocks if b["type"] == "tool_use"] == [{"city": "Paris"}]


@pytest.mark.parametrize("text,order", [
    (CALL + "\nI asked for the weather.", ["function_call", "message"]),
    ("Looking it up.\n" + CALL, ["message", "function_call"]),
])
async def test_responses_non_stream_items_in_generation_order(codec, text: str, order: list[str]) -> None:
    eng = scripted(codec, text)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await c.post("/v1/responses", json={"model": SERVED, "input": "weather?", "tools": [WEATHER_OAI]})
    assert r.status_code == 200, r.text
    assert [it["type"] for it in r.json()["output"]] == order, r.json()["output"]


# --- logprobs never past a stop string ---------------------------------------------------------------------
@pytest.mark.parametrize("stop,include", [("Stop here", False), ("here.", False), ("Stop", True), ("! S", False)])
@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_end_with_the_text_at_a_stop_string(client: httpx.AsyncClient, stop: str,
                                                                 include: bool, stream: bool) -> None:
    body = {"model": SERVED, "messages": MSGS, "stop": [stop], "logprobs": True, "stream": stream,
            "include_stop_str_in_output": include}
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    if stream:
        chs = [ch for ev in parse_sse(r.text)[:-1] for ch in ev["choices"]]
        text = "".join(ch["delta"].get("content") or "" for ch in chs)
        toks = [t["token"] for ch in chs if ch.get("logprobs") for t in ch["logprobs"]["content"]]
    else:
        ch = r.json()["choices"][0]
        text, toks = ch["message"]["content"], [t["token"] for t in ch["logprobs"]["content"]]
    assert (stop in text) == include
    joined = "".join(toks)
    # every token's text starts inside the output (the last may run into the stop string), none after it
    assert joined.startswith(text) or text.startswith(joined), (joined, text)
    assert len("".join(toks[:-1])) < len(text)


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_logprobs_end_at_a_stop_string(client: httpx.AsyncClient, stream: bool) -> None:
    r = await client.post("/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 50,
                                                   "stop": ["Stop here"], "logprobs": 1, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        chs = [ch for ev in parse_sse(r.text)[:-1] for ch in ev["choices"]]
        text = "".join(ch["text"] for ch in chs)
        toks = [t for ch in chs if ch.get("logprobs") for t in ch["logprobs"]["tokens"]]
        offs = [o for ch in chs if ch.get("logprobs") for o in ch["logprobs"]["text_offset"]]
    else:
        ch = r.json()["choices"][0]
        text, toks, offs = ch["text"], ch["logprobs"]["tokens"], ch["logprobs"]["text_offset"]
    assert text == "Hello world! "
    assert "".join(toks) == text and all(o < len(text) for o in offs)


# --- a forced call whose string argument holds </tool_call> ------------------------------------------------
NOTE_TOOL = {"type": "function", "function": {"name": "write_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
TRICKY = 'a <tool_call> tag and a </tool_call> tag, "quoted" \\\\ too'


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "auto"])
async def test_tool_call_with_close_tag_inside_a_string_argument(codec, stream: bool, tool_choice: str) -> None:
    import json

    call = '<tool_call>\n{"name": "write_note", "arguments": ' + json.dumps({"text": TRICKY}) + '}\n</tool_call>'
    eng = scripted(codec, call)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await c.post(CHAT, json={"model": SERVED, "messages": MSGS, "tools": [NOTE_TOOL],
                                     "tool_choice": tool_choice, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        chs = [ch for ev in parse_sse(r.text)[:-1] for ch in ev["choices"]]
        content = "".join(ch["delta"].get("content") or "" for ch in chs)
        args = "".join(tc["function"].get("arguments") or "" for ch in chs for tc in ch["delta"].get("tool_calls") or ())
        finish = [ch["finish_reason"] for ch in chs if ch["finish_reason"]]
    else:
        ch = r.json()["choices"][0]
        content = ch["message"]["content"] or ""
        (tc,) = ch["message"]["tool_calls"]
        args, finish = tc["function"]["arguments"], [ch["finish_reason"]]
    assert content == ""
    assert json.loads(args) == {"text": TRICKY}
    assert finish == ["tool_calls"]


def test_unclosed_string_body_still_ends_at_the_tag() -> None:
    from ferrylm.server.text.tool_parsers.hermes import HermesToolParser

    p = HermesToolParser(["f"])
    pieces = p.feed('<tool_call>{"name": "f", "arguments": {"x": "oops}}</tool_call> after') + p.finish()
    assert "".join(x.text for x in pieces if x.call is None) == "after"
    # the call (its arguments streamed) ends unfinished where its string met the tag; the tag was never released
    (call,) = [x.call for x in pieces if x.call]
    assert (call.arguments, call.complete) == ('{"x": "oops}}', False)
    assert "".join(x.args for x in pieces) == call.arguments


# --- {"$ref": "#"} -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"$ref": "#", "description": "me"},
                                    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                     "$ref": "#/$defs/a"},
                                    {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}}])
async def test_self_referential_ref_is_a_400_naming_the_field(client: httpx.AsyncClient, engine: FakeEngine,
                                                              schema: dict) -> None:
    body = {"model": SERVED, "messages": MSGS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    err = assert_error(await client.post(CHAT, json=body), 400, param="response_format.json_schema.schema")
    assert "$ref" in err["message"]
    assert not engine.requests


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"child": {"$ref": "#"}}},
                                    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#"}}]}])
async def test_recursive_ref_through_a_keyword_works(client: httpx.AsyncClient, schema: dict) -> None:
    body = {"model": SERVED, "messages": MSGS, "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text


async def test_tool_parameters_with_self_ref_is_a_400(client: httpx.AsyncClient) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    r = await client.post(CHAT, json={"model": SERVED, "messages": MSGS, "tools": [tool], "tool_choice": "required"})
    err = assert_error(r, 400)
    assert "$ref" in err["message"] and err["param"].startswith("tools")


@pytest.mark.parametrize("params", [
    {"type": "object", "$defs": {"c": {"type": "string"}}, "properties": {"city": {"$ref": "#/$defs/c"}},
     "required": ["city"]},
    {"type": "object", "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}}, "required": ["name"]},
])
@pytest.mark.parametrize("n_tools", [1, 2])
async def test_forced_call_with_local_refs_in_parameters_works(codec, params: dict, n_tools: int) -> None:
    """The parameters sit under the call's "arguments" in the forcing grammar: their "#..." refs must point
    there (they pointed at the grammar's root: a pointer that did not exist, or the wrong node)."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(n_tools)]
    eng = scripted(codec, "x")
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await c.post(CHAT, json={"model": SERVED, "messages": MSGS, "tools": tools, "tool_choice": "required",
                                     "max_tokens": 2})
    assert r.status_code == 200, r.text
    grammar = eng.requests[-1][2].grammar
    assert "#/properties/arguments" in grammar or "#/anyOf/0/properties/arguments" in grammar


# --- union-typed field errors name the field ----------------------------------------------------------------
@pytest.mark.parametrize("extra,param", [
    ({"stop": 5}, "stop"),
    ({"tool_choice": 5}, "tool_choice"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text"),
])
async def test_union_field_errors_name_the_field(client: httpx.AsyncClient, extra: dict, param: str) -> None:
    err = assert_error(await client.post(CHAT, json={"model": SERVED, "messages": MSGS, **extra}), 400, param=param)
    assert ".str" not in err["message"] and "list[" not in err["message"], err


@pytest.mark.parametrize("prompt,param", [(5, "prompt"), ([[1, "a"]], "prompt.0.1")])
async def test_completion_prompt_union_errors_name_the_field(client: httpx.AsyncClient, prompt, param) -> None:
    assert_error(await client.post("/v1/completions", json={"model": SERVED, "prompt": prompt}), 400, param=param)


# --- out-of-range values -------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,param", [
    ({"temperature": 1e308}, "temperature"),
    ({"temperature": 101}, "temperature"),
    ({"top_k": -5}, "top_k"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ({"messages": [{"role": "system", "content": []}, {"role": "user", "content": "x"}]}, "messages.0.content"),
])
async def test_out_of_range_values_are_400(client: httpx.AsyncClient, engine: FakeEngine, extra: dict,
                                           param: str) -> None:
    assert_error(await client.post(CHAT, json={"model": SERVED, "messages": MSGS, **extra}), 400, param=param)
    assert not engine.requests


@pytest.mark.parametrize("extra", [{"temperature": 2}, {"temperature": 0}, {"top_k": -1}, {"top_k": 0},
                                   {"top_k": 40}])
async def test_in_range_values_pass(client: httpx.AsyncClient, extra: dict) -> None:
    r = await client.post(CHAT, json={"model": SERVED, "messages": MSGS, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


async def test_anthropic_out_of_range_is_400(client: httpx.AsyncClient) -> None:
    for extra in ({"temperature": 1e308}, {"top_k": -5}):
        r = await client.post("/v1/messages", json={"model": SERVED, "max_tokens": 5, "messages": MSGS, **extra})
        assert r.status_code == 400, r.text


# --- /v1/responses "input": "" agrees with [] ----------------------------------------------------------------
@pytest.mark.parametrize("inp", ["", []])
async def test_responses_empty_input_is_400(client: httpx.AsyncClient, engine: FakeEngine, inp) -> None:
    assert_error(await client.post("/v1/responses", json={"model": SERVED, "input": inp}), 400, param="input")
    assert not engine.requests


async def test_responses_empty_input_after_a_previous_response_continues(client: httpx.AsyncClient,
                                                                          engine: FakeEngine) -> None:
    first = (await client.post("/v1/responses", json={"model": SERVED, "input": "hi", "max_output_tokens": 3})).json()
    outs = []
    for inp in ("", []):
        r = await client.post("/v1/responses", json={"model": SERVED, "input": inp, "max_output_tokens": 3,
                                                     "previous_response_id": first["id"]})
        assert r.status_code == 200, r.text
        outs.append(engine.requests[-1][1])
    assert outs[0] == outs[1]   # the same prompt: "" adds no empty user turn


# --- a prompt over the context is told the context, not to grow the pool --------------------------------------
@pytest.mark.parametrize("pool", [0, 200, 256])
async def test_prompt_over_the_context_names_the_context_not_the_pool(codec, pool: int) -> None:
    eng = FakeEngine(codec, max_model_len=64, kv_pool_tokens=pool)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        long = "Hello world! The quick brown fox jumps over the lazy dog. " * 30
        err = assert_error(await c.post(CHAT, json={"model": SERVED, "messages": [{"role": "user", "content": long}]}),
                           400, code="context_length_exceeded")
    assert err["message"].startswith("This model's maximum context length is 64 tokens.")
    assert "--num-tokens" not in err["message"] and "--max-model-len" in err["message"]


async def test_prompt_within_the_context_but_over_the_pool_names_the_pool(codec) -> None:
    eng = FakeEngine(codec, max_model_len=4096, kv_pool_tokens=40)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        long = "Hello world! The quick brown fox jumps over the lazy dog. " * 10
        err = assert_error(await c.post(CHAT, json={"model": SERVED, "messages": [{"role": "user", "content": long}]}),
                           400, code="context_length_exceeded")
    assert "KV cache pool holds only 40 tokens" in err["message"] and "--num-tokens" in err["message"]


def test_engine_admission_names_the_context_first() -> None:
    from ferrylm.engine.sampling_params import SamplingParams
    from tests.engine.test_structured_and_prompt_logprobs import make

    eng = make(32)   # fake model: context 512, pool 64 pages x 4 = 256 tokens
    eng.add_request("over-context", [1] * 600, SamplingParams())
    eng.add_request("over-pool", [1] * 300, SamplingParams())
    out = {o.request_id: o for o in eng.step()}
    assert {o.error_code for o in out.values()} == {"context_length_exceeded"}
    ctx, pool = out["over-context"].error_message, out["over-pool"].error_message
    assert "--num-tokens" not in ctx and "--max-model-len" in ctx
    assert "--num-tokens" in pool


# --- /v1/messages: what Anthropic's API refuses (new-user trial) ---------------------------------------------
@pytest.mark.parametrize("extra", [
    {"messages": [{"role": "user", "content": ""}]},
    {"messages": [{"role": "user", "content": []}]},
    {"tools": [{"name": "f"}]},
    {"thinking": {"type": "maybe"}},
])
async def test_anthropic_refusals_are_400(client: httpx.AsyncClient, engine: FakeEngine, extra) -> None:
    r = await client.post("/v1/messages", json={"model": SERVED, "max_tokens": 5, "messages": MSGS, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert not engine.requests
