"""gpt-oss (harmony) output under the request's constraints, through the ASGI app with a scripted engine and the
``openai`` SDK: a ``response_format`` / ``text.format`` holds for the final message (the grammar the engine gets
lets analysis through and forces the final message's JSON, checked with llguidance on the real vocabulary); a stop
string is cut inside a message's text as for other models, never matched in headers or across messages; the
reasoning tokens are counted in ``usage`` on chat completions and the Responses API (harmony's analysis channel,
and a ``<think>`` block of a chat template's model)."""

from __future__ import annotations

import functools
import json

import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine, assert_error, make_client
from .test_harmony import FINAL_OUT, USER, oai, scripted

openai = pytest.importorskip("openai")
llguidance = pytest.importorskip("llguidance")

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
          "required": ["city", "temp"]}
JSON_OUT = ("<|channel|>analysis<|message|>Need JSON.<|end|><|start|>assistant<|channel|>final<|message|>"
            '{"city": "Paris", "temp": 18}<|return|>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@functools.cache
def _ll_tokenizer(codec):
    """llguidance's view of the codec's vocabulary (~1.5 s to build for 200k tokens: once per codec)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(codec.tokenizer, n_vocab=codec.vocab_size, eos_token=200002)


def accepts(codec, grammar: str, out: str) -> bool:
    """Whether ``grammar`` lets the engine generate ``out`` (harmony markup) token by token, to its end."""
    import llguidance

    m = llguidance.LLMatcher(_ll_tokenizer(codec), grammar, log_level=0)
    return all(m.consume_token(t) for t in codec.encoding.encode(out, allowed_special="all")) and m.is_stopped()


# ---------------------------------------------------------------------------------------------------------
# response_format: the final message's JSON, analysis free
# ---------------------------------------------------------------------------------------------------------


async def test_response_format_constrains_the_final_message(harmony_codec) -> None:
    eng = scripted(harmony_codec, JSON_OUT)
    client = oai(create_app(eng, harmony_codec, SERVED))
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    resp = await client.chat.completions.create(model=SERVED, messages=USER, response_format=rf)
    msg = resp.choices[0].message
    assert json.loads(msg.content) == {"city": "Paris", "temp": 18}
    assert msg.model_extra["reasoning_content"] == "Need JSON."
    grammar = eng.requests[0][2].grammar
    assert accepts(harmony_codec, grammar, JSON_OUT)
    assert accepts(harmony_codec, grammar, '<|channel|>final<|message|>{"city": "Oslo", "temp": -2}<|return|>')
    assert accepts(harmony_codec, grammar, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>"
                                           "analysis<|message|>b<|end|><|start|>assistant<|channel|>final"
                                           ' <|constrain|>json<|message|>{"city": "x", "temp": 1}<|return|>')
    for bad in ("<|channel|>final<|message|>It is 18 degrees.<|return|>",            # not JSON
                '<|channel|>final<|message|>{"city": "Paris"}<|return|>',              # a required key missing
                '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "P"}<|call|>'):
        assert not accepts(harmony_codec, grammar, bad), bad
    # json_object on chat, with a tool offered (auto): a call is the other way the turn may end
    await client.chat.completions.create(model=SERVED, messages=USER, tools=[WEATHER],
                                         response_format={"type": "json_object"})
    grammar = eng.requests[1][2].grammar
    assert accepts(harmony_codec, grammar, '<|channel|>final<|message|>{"any": [1]}<|return|>')
    assert accepts(harmony_codec, grammar, '<|channel|>commentary to=functions.get_weather <|constrain|>json'
                                           '<|message|>{"city": "Paris"}<|call|>')
    assert not accepts(harmony_codec, grammar, "<|channel|>final<|message|>[1]<|return|>")


async def test_the_schema_is_shown_in_the_developer_message(harmony_codec) -> None:
    """A json_schema reply: harmony's ``# Response Formats`` section after the instructions (before the tools), a
    developer message of its own when there are neither."""
    import openai_harmony as oh

    from .test_harmony import PARAMS, library_prompt, user

    eng = scripted(harmony_codec, JSON_OUT)
    client = oai(create_app(eng, harmony_codec, SERVED))
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "description": "The weather", "schema": SCHEMA}}
    section = "# Response Formats\n\n## weather\n\n// The weather\n" + json.dumps(SCHEMA, separators=(",", ":"))
    await client.chat.completions.create(model=SERVED, messages=[{"role": "system", "content": "Be terse."}, *USER],
                                         tools=[{"type": "function", "function": {
                                             "name": "get_weather", "description": "Current weather",
                                             "parameters": PARAMS}}], response_format=rf)
    assert eng.requests[0][1] == library_prompt(harmony_codec, oh.ReasoningEffort.MEDIUM, "Be terse.\n\n" + section,
                                                [user("Weather in Paris?")])
    await client.chat.completions.create(model=SERVED, messages=USER, response_format=rf)
    text = harmony_codec.decode(eng.requests[1][1], skip_special_tokens=False)
    assert f"<|start|>developer<|message|>{section}<|end|><|start|>user" in text


async def test_responses_text_format_and_completions(harmony_codec) -> None:
    eng = scripted(harmony_codec, JSON_OUT)
    app = create_app(eng, harmony_codec, SERVED)
    r = await oai(app).responses.create(model=SERVED, input="Weather in Paris?", text={"format": {
        "type": "json_schema", "name": "weather", "schema": SCHEMA}})
    assert json.loads(r.output_text) == {"city": "Paris", "temp": 18}
    assert accepts(harmony_codec, eng.requests[0][2].grammar, JSON_OUT)
    enc = harmony_codec.encoding
    header = enc.encode("<|start|>user<|message|>hi<|end|><|start|>assistant", allowed_special="all")
    async with make_client(app) as c:
        # a token prompt left at a new assistant message: the turn's grammar; a text prompt: the JSON itself
        r1 = await c.post("/v1/completions", json={"model": SERVED, "prompt": header, "max_tokens": 64,
                                                    "response_format": {"type": "json_object"}})
        r2 = await c.post("/v1/completions", json={"model": SERVED, "prompt": "{", "max_tokens": 64,
                                                    "response_format": {"type": "json_object"}})
        mixed = await c.post("/v1/completions", json={"model": SERVED, "prompt": [header, [13225]],
                                                       "response_format": {"type": "json_object"}})
    assert r1.status_code == 200 and r2.status_code == 200, (r1.text, r2.text)
    assert accepts(harmony_codec, eng.requests[1][2].grammar, '<|channel|>final<|message|>{"a": 1}<|return|>')
    assert "harmony_turn" not in eng.requests[2][2].grammar
    assert_error(mixed, 400, param="prompt")


async def test_response_format_with_a_forced_call_is_400(harmony_codec) -> None:
    async with make_client(create_app(scripted(harmony_codec, JSON_OUT), harmony_codec, SERVED)) as c:
        r = await c.post("/v1/chat/completions", json={"model": SERVED, "messages": USER, "tools": [WEATHER],
                                                       "tool_choice": "required",
                                                       "response_format": {"type": "json_object"}})
    assert_error(r, 400, param="tool_choice")


# ---------------------------------------------------------------------------------------------------------
# stop strings: cut inside a message's text
# ---------------------------------------------------------------------------------------------------------


async def _chat_both(client, **kw) -> list[tuple[str, str, str | None]]:
    """(content, reasoning, finish_reason) of a non-stream and a stream request."""
    resp = await client.chat.completions.create(model=SERVED, messages=USER, **kw)
    m = resp.choices[0].message
    out = [(m.content or "", m.model_extra.get("reasoning_content") or "", resp.choices[0].finish_reason)]
    content, reasoning, finish = [], [], None
    async for chunk in await client.chat.completions.create(model=SERVED, messages=USER, stream=True, **kw):
        for ch in chunk.choices:
            content.append(ch.delta.content or "")
            reasoning.append((ch.delta.model_extra or {}).get("reasoning_content") or "")
            finish = ch.finish_reason or finish
    return out + [("".join(content), "".join(reasoning), finish)]


@pytest.mark.parametrize("stop,include,want", [
    (["18"], False, ("It is ", "Easy.")),                  # in the final message: cut before it
    (["1"], True, ("It is 1", "Easy.")),                   # ... or after it, inside a token
    (["asy"], False, ("", "E")),                           # in the analysis message
    (["final"], False, ("It is 18 °C in Paris 🙂.", "Easy.")),   # a header word is no text
    (["y.It", "°C"], False, ("It is 18 ", "Easy.")),       # never across two messages
])
async def test_stop_string_is_cut_inside_a_message(harmony_codec, stop, include, want) -> None:
    eng = scripted(harmony_codec, FINAL_OUT)
    client = oai(create_app(eng, harmony_codec, SERVED))
    got = await _chat_both(client, stop=stop, extra_body={"include_stop_str_in_output": include})
    finish = "stop"
    assert got == [(*want, finish)] * 2
    cut = want[0] != "It is 18 °C in Paris 🙂."
    assert (len(eng.aborts) == 2) == cut   # a stop string ends the engine request


# ---------------------------------------------------------------------------------------------------------
# usage: reasoning tokens
# ---------------------------------------------------------------------------------------------------------


async def test_reasoning_tokens_in_usage_harmony(harmony_codec) -> None:
    # the analysis message's tokens from its <|message|> to its <|end|>: <|message|> "Easy" "." <|end|>
    want = 2 + len(harmony_codec.encoding.encode("Easy."))
    client = oai(create_app(scripted(harmony_codec, FINAL_OUT), harmony_codec, SERVED))
    resp = await client.chat.completions.create(model=SERVED, messages=USER)
    assert resp.usage.completion_tokens_details.reasoning_tokens == want
    stream = await client.chat.completions.create(model=SERVED, messages=USER, stream=True,
                                                  stream_options={"include_usage": True})
    usage = [c.usage async for c in stream if c.usage is not None]
    assert usage[-1].completion_tokens_details.reasoning_tokens == want
    r = await client.responses.create(model=SERVED, input="hi")
    assert r.usage.output_tokens_details.reasoning_tokens == want
    async with client.responses.stream(model=SERVED, input="hi") as s:
        final = await s.get_final_response()
    assert final.usage.output_tokens_details.reasoning_tokens == want


async def test_reasoning_tokens_in_usage_think_block(qwen_codec) -> None:
    think, answer = "<think>\nThe user says hi.\n</think>", "\n\nHello!"
    ids = qwen_codec.encode(think, add_special_tokens=False, parse_special=True)
    eng = FakeEngine(qwen_codec, max_model_len=4096)
    eng.script = lambda rid, p, params: ids + qwen_codec.encode(answer, add_special_tokens=False) + [eng.eos]
    client = oai(create_app(eng, qwen_codec, SERVED))
    resp = await client.chat.completions.create(model=SERVED, messages=USER)
    assert resp.choices[0].message.content == "Hello!"
    assert resp.usage.completion_tokens_details.reasoning_tokens == len(ids)
    stream = await client.chat.completions.create(model=SERVED, messages=USER, stream=True,
                                                  stream_options={"include_usage": True})
    usage = [c.usage async for c in stream if c.usage is not None]
    assert usage[-1].completion_tokens_details.reasoning_tokens == len(ids)
    r = await client.responses.create(model=SERVED, input="hi")
    assert r.usage.output_tokens_details.reasoning_tokens == len(ids)
    # thinking off (the template closes an empty block): the answer only, no reasoning tokens
    eng.script = lambda rid, p, params: qwen_codec.encode("Hello!", add_special_tokens=False) + [eng.eos]
    resp = await client.chat.completions.create(model=SERVED, messages=USER,
                                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert resp.usage.completion_tokens_details.reasoning_tokens == 0
