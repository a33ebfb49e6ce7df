"""GLM-4.5 and MiniMax-M2 / M2.5 tool calls through the ASGI app with a scripted engine and the real ``openai`` SDK: the
format chosen by ``--tool-call-parser`` or from the architecture, stream equal to non-stream, reasoning into
``reasoning_content``, and forced calls enforced by the format's own grammar."""

from __future__ import annotations

import json

import httpx
import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
TEXT = {
    "glm45": "Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
    "minimax_m2": 'Let me look.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                  '</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>',
}


def scripted(codec, text: str) -> FakeEngine:
    eng = FakeEngine(codec, max_model_len=4096)
    eng.script = lambda rid, ids, p: codec.encode(text, add_special_tokens=False) + [eng.eos]
    return eng


def oai(app) -> "openai.AsyncOpenAI":
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False))
    return openai.AsyncOpenAI(http_client=http, base_url="http://test/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("fmt,how", [("glm45", {"tool_call_parser": "glm45"}),
                                     ("glm45", {"architecture": "Glm4MoeForCausalLM"}),
                                     ("minimax_m2", {"tool_call_parser": "minimax_m2"}),
                                     ("minimax_m2", {"architecture": "MiniMaxM2ForCausalLM"})])
async def test_calls_stream_equals_non_stream(codec, fmt: str, how: dict) -> None:
    eng = scripted(codec, TEXT[fmt])
    client = oai(create_app(eng, codec, SERVED, **how))
    resp = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER])
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    # the tiny template has no tools section: the fallback teaches the served format, not Hermes
    prompt = codec.decode(eng.requests[0][1], skip_special_tokens=False)
    assert ("<arg_key>" if fmt == "glm45" else "<minimax:tool_call>") in prompt and '<tool_call>\n{"name"' not in prompt
    stream = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER], stream=True)
    text, args, finish = [], "", None
    async for chunk in stream:
        for ch in chunk.choices:
            text.append(ch.delta.content or "")
            for tc in ch.delta.tool_calls or ():
                args += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert "".join(text) == "Let me look." and finish == "tool_calls"
    assert json.loads(args) == {"city": "Paris", "days": 2}


async def test_the_default_format_stays_hermes(codec) -> None:
    """Without a flag or a known architecture, GLM markup is text (Hermes parses only <tool_call>{json})."""
    eng = scripted(codec, TEXT["glm45"])
    resp = await oai(create_app(eng, codec, SERVED)).chat.completions.create(model=SERVED, messages=MSGS,
                                                                             tools=[WEATHER])
    assert resp.choices[0].message.tool_calls is None and "<arg_key>" in resp.choices[0].message.content


@pytest.mark.parametrize("fmt,markup", [("glm45", "<arg_key>"), ("minimax_m2", "<invoke name")])
async def test_forced_calls_use_the_formats_grammar(codec, fmt: str, markup: str) -> None:
    eng = scripted(codec, TEXT[fmt].split("\n", 1)[1])
    client = oai(create_app(eng, codec, SERVED, tool_call_parser=fmt))
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER], tool_choice="required")
    grammar = eng.requests[-1][2].grammar
    assert markup in grammar and "get_weather" in grammar
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content


def test_an_unknown_parser_is_refused(codec) -> None:
    with pytest.raises(ValueError, match="minimax_m2"):
        create_app(FakeEngine(codec), codec, SERVED, tool_call_parser="glm4")


@pytest.fixture(scope="module")
def glm_codec(tmp_path_factory):
    """A GLM-4.5-like vocabulary and template (tests/server/glm_like.py)."""
    from ferrylm.server.text.tokenizer import TextCodec

    from .glm_like import build_glm_like_tokenizer

    return TextCodec.from_pretrained(build_glm_like_tokenizer(tmp_path_factory.mktemp("glm-like-tokenizer")))


async def test_glm_like_vocabulary_keeps_special_markup_for_the_parsers(glm_codec) -> None:
    """auto picks glm45 from the template; the output's special-token tags survive detokenization (the request
    runs with skip_special_tokens off), reasoning goes to reasoning_content, the call is parsed; a forced call's
    grammar writes the special tags as their token ids."""
    codec = glm_codec
    text = "<think>Weather, so call the tool.</think>Let me look.\n" + TEXT["glm45"].split("\n", 1)[1]
    ids = codec.encode(text, add_special_tokens=False, parse_special=True)
    assert codec.encode("<arg_key>", add_special_tokens=False, parse_special=True)[0] in ids  # really special ids
    eng = FakeEngine(codec, max_model_len=4096)
    eng.script = lambda rid, prompt, p: ids + [eng.eos]
    client = oai(create_app(eng, codec, SERVED))
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER])
    msg = r.choices[0].message
    assert eng.requests[-1][2].skip_special_tokens is False
    assert msg.content == "Let me look." and msg.model_extra.get("reasoning_content") == "Weather, so call the tool."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER], tool_choice="required")
    grammar = eng.requests[-1][2].grammar
    key_id = codec.encode("<arg_key>", add_special_tokens=False, parse_special=True)[0]
    assert f"<[{key_id}]>" in grammar and '"<arg_key>"' not in grammar


@pytest.mark.parametrize("fmt", ["glm45", "minimax_m2"])
async def test_anthropic_messages_tool_use_in_either_format(codec, fmt: str) -> None:
    from .conftest import make_client

    eng = scripted(codec, TEXT[fmt])
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER["function"]["parameters"]}
    async with make_client(create_app(eng, codec, SERVED, tool_call_parser=fmt)) as c:
        r = await c.post("/v1/messages", json={"model": SERVED, "max_tokens": 256, "tools": [tool],
                                               "messages": [{"role": "user", "content": "Weather in Paris?"}]})
    body = r.json()
    assert r.status_code == 200 and body["stop_reason"] == "tool_use"
    text, use = body["content"]
    assert text == {"type": "text", "text": "Let me look."}
    assert (use["type"], use["name"], use["input"]) == ("tool_use", "get_weather", {"city": "Paris", "days": 2})


@pytest.fixture(scope="module")
def minimax_codec(tmp_path_factory):
    """A MiniMax-M2 / M2.5-like vocabulary and template (tests/server/minimax_like.py)."""
    from ferrylm.server.text.tokenizer import TextCodec

    from .minimax_like import build_minimax_like_tokenizer

    return TextCodec.from_pretrained(build_minimax_like_tokenizer(tmp_path_factory.mktemp("minimax-like-tokenizer")))


async def test_minimax_m2_5_chat_format(minimax_codec) -> None:
    """MiniMax-M2.5 speaks M2's format: auto picks minimax_m2 from the template (and from the architecture the
    minimax-m2.5 preset names); the generation prompt opens <think>, so the output's reasoning (no opening tag)
    goes to reasoning_content up to </think>, the call after it is parsed, stream equal to non-stream; the next
    turn renders that reasoning and the call back in the family's markup."""
    from ferrylm.server.text.tool_parsers import choose_tool_parser
    from ferrylm.synthetic.spec import PRESETS

    assert choose_tool_parser(None, PRESETS["minimax-m2.5"].config["architectures"][0]) == "minimax_m2"
    codec = minimax_codec
    out = "The user wants weather.\n</think>\n\nLet me look.\n" + TEXT["minimax_m2"].split("\n", 1)[1]
    ids = codec.encode(out, add_special_tokens=False, parse_special=True)
    assert codec.encode("</think>", add_special_tokens=False, parse_special=True)[0] in ids  # really special ids
    eng = FakeEngine(codec, max_model_len=4096)
    eng.script = lambda rid, prompt, p: ids + [eng.eos]
    client = oai(create_app(eng, codec, SERVED))
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER])
    prompt = codec.decode(eng.requests[-1][1], skip_special_tokens=False)
    assert prompt.endswith("]~b]ai\n<think>\n") and "<tools>\n<tool>" in prompt
    msg = r.choices[0].message
    assert msg.content == "Let me look." and msg.model_extra.get("reasoning_content") == "The user wants weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    stream = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER], stream=True)
    reasoning, text, args = [], [], ""
    async for chunk in stream:
        for ch in chunk.choices:
            reasoning.append(ch.delta.model_extra.get("reasoning_content") or "")
            text.append(ch.delta.content or "")
            args += "".join(tc.function.arguments or "" for tc in ch.delta.tool_calls or ())
    assert ("".join(reasoning), "".join(text), json.loads(args)) == (
        "The user wants weather.", "Let me look.", {"city": "Paris", "days": 2})
    call = msg.tool_calls[0]
    history = [*MSGS, {"role": "assistant", "content": msg.content, "reasoning_content": "The user wants weather.",
                       "tool_calls": [{"id": call.id, "type": "function", "function": {
                           "name": "get_weather", "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    await client.chat.completions.create(model=SERVED, messages=history, tools=[WEATHER])
    prompt = codec.decode(eng.requests[-1][1], skip_special_tokens=False)
    assert ("]~b]ai\n<think>\nThe user wants weather.\n</think>\n\nLet me look.\n<minimax:tool_call>\n"
            "<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">2"
            "</parameter>\n</invoke>\n</minimax:tool_call>[e~[\n]~b]tool\n<response>sunny</response>") in prompt
