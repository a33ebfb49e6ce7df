"""DeepSeek-V3, Kimi-K2, Qwen3-Coder and DeepSeek-V3.2 (DSML) tool calls through the ASGI app with a scripted engine and the real
``openai`` SDK: the format chosen by ``--tool-call-parser``, the architecture or the config's ``model_type``,
stream equal to non-stream, ``tool_choice: "required"`` and a named tool enforced by the format's own grammar,
and vocabularies whose tags are special tokens (DeepSeek-like with an R1-style template that opens ``<think>`` in
the prompt, Kimi-like)."""

from __future__ import annotations

import json

import httpx
import pytest

from ferrylm.server.api.app import create_app
from ferrylm.server.text.tool_parsers import deepseek_v3 as ds
from ferrylm.server.text.tool_parsers import deepseek_v32 as ds32
from ferrylm.server.text.tool_parsers import kimi_k2 as kimi
from ferrylm.server.text.tool_parsers.deepseek_v4 import DSML

from .conftest import SERVED, FakeEngine

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}, "required": ["q"]}}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {
    "deepseek_v3": f'{ds.CALLS_BEGIN}{ds.CALL_BEGIN}get_weather{ds.SEP}{{"city": "Paris", "days": 2}}{ds.CALL_END}'
                   f'{ds.CALLS_END}',
    "kimi_k2": f'{kimi.SECTION_BEGIN}{kimi.CALL_BEGIN}functions.get_weather:0{kimi.ARGS_BEGIN}'
               f'{{"city": "Paris", "days": 2}}{kimi.CALL_END}{kimi.SECTION_END}',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                   "</parameter>\n</function>\n</tool_call>",
    "deepseek_v32": f'{ds32.CALLS_BEGIN}\n<{DSML}invoke name="get_weather">\n'
                    f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
                    f'<{DSML}parameter name="days" string="false">2</{DSML}parameter>\n</{DSML}invoke>\n{ds32.CALLS_END}',
}
SEARCH_CALL = {
    "deepseek_v3": f'{ds.CALLS_BEGIN}{ds.CALL_BEGIN}function{ds.SEP}search\n```json\n{{"q": "Paris"}}\n```'
                   f'{ds.CALL_END}{ds.CALLS_END}',
    "kimi_k2": f'{kimi.SECTION_BEGIN}{kimi.CALL_BEGIN}functions.search:1{kimi.ARGS_BEGIN}{{"q": "Paris"}}'
               f'{kimi.CALL_END}{kimi.SECTION_END}',
    "qwen3_coder": "<tool_call>\n<function=search>\n<parameter=q>\nParis\n</parameter>\n</function>\n</tool_call>",
    "deepseek_v32": f'{ds32.CALLS_BEGIN}\n<{DSML}invoke name="search">\n<{DSML}parameter name="q" string="true">Paris'
                    f'</{DSML}parameter>\n</{DSML}invoke>\n{ds32.CALLS_END}',
}
TAUGHT = {"deepseek_v3": ds.CALLS_BEGIN, "kimi_k2": kimi.SECTION_BEGIN, "qwen3_coder": "<function=",
          "deepseek_v32": ds32.CALLS_BEGIN}
MARK = {"deepseek_v3": json.dumps(ds.SEP)[1:-1], "kimi_k2": "functions.get_weather:",
        "qwen3_coder": "<function=get_weather>", "deepseek_v32": "function_calls>"}   # how each grammar writes the call (non-ASCII escaped)


def scripted(codec, text: str) -> FakeEngine:
    eng = FakeEngine(codec, max_model_len=4096)
    eng.script = lambda rid, ids, p: codec.encode(text, add_special_tokens=False, parse_special=True) + [eng.eos]
    return eng


def oai(app) -> "openai.AsyncOpenAI":
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False))
    return openai.AsyncOpenAI(http_client=http, base_url="http://test/v1", api_key="x", max_retries=0)


async def _stream(client, **kw) -> tuple[str, list[tuple[str | None, str | None, str]], str | None]:
    """Content, the calls as (id, name, arguments) put together from their deltas, and the finish reason."""
    stream = await client.chat.completions.create(model=SERVED, messages=MSGS, stream=True, **kw)
    text, calls, finish = [], {}, None
    async for chunk in stream:
        for ch in chunk.choices:
            text.append(ch.delta.content or "")
            for tc in ch.delta.tool_calls or ():
                cid, name, args = calls.get(tc.index, (None, None, ""))
                calls[tc.index] = (tc.id or cid, (tc.function.name or name), args + (tc.function.arguments or ""))
            finish = ch.finish_reason or finish
    return "".join(text), [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("fmt,how", [
    ("deepseek_v3", {"tool_call_parser": "deepseek_v3"}),
    ("deepseek_v3", {"architecture": "DeepseekV3ForCausalLM"}),
    ("kimi_k2", {"tool_call_parser": "kimi_k2"}),
    ("kimi_k2", {"architecture": "DeepseekV3ForCausalLM", "model_type": "kimi_k2"}),
    ("qwen3_coder", {"tool_call_parser": "qwen3_coder"}),
    ("qwen3_coder", {"architecture": "Qwen3NextForCausalLM"}),
    ("qwen3_coder", {"architecture": "Qwen3_5MoeForCausalLM"}),
    ("qwen3_coder", {"architecture": "Qwen4ExpForCausalLM", "model_type": "qwen4_exp_text"}),
    ("deepseek_v32", {"tool_call_parser": "deepseek_v32"}),
    ("deepseek_v32", {"architecture": "DeepseekV32ForCausalLM", "model_type": "deepseek_v32"}),
])
async def test_calls_stream_equals_non_stream(codec, fmt: str, how: dict) -> None:
    eng = scripted(codec, "Let me look.\n" + CALL[fmt])
    client = oai(create_app(eng, codec, SERVED, **how))
    resp = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER, SEARCH])
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    if fmt == "kimi_k2":
        assert call.id == "functions.get_weather:0"   # the model's own id, as the template writes it back
    # the tiny template has no tools section: the fallback teaches the served format, not Hermes
    prompt = codec.decode(eng.requests[0][1], skip_special_tokens=False)
    assert TAUGHT[fmt] in prompt and '<tool_call>\n{"name"' not in prompt
    text, calls, finish = await _stream(client, tools=[WEATHER, SEARCH])
    assert text == "Let me look." and finish == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert calls[0][0] == call.id if fmt == "kimi_k2" else calls[0][0].startswith("call_")


@pytest.mark.parametrize("fmt", sorted(CALL))
async def test_required_and_named_tool_choice_use_the_formats_grammar(codec, fmt: str) -> None:
    eng = scripted(codec, CALL[fmt])
    client = oai(create_app(eng, codec, SERVED, tool_call_parser=fmt))
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER, SEARCH],
                                             tool_choice="required")
    grammar = eng.requests[-1][2].grammar
    assert MARK[fmt] in grammar and "search" in grammar   # the format's markup, every tool
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    eng.script = lambda rid, ids, p: codec.encode(SEARCH_CALL[fmt], add_special_tokens=False) + [eng.eos]
    named = {"type": "function", "function": {"name": "search"}}
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER, SEARCH], tool_choice=named)
    grammar = eng.requests[-1][2].grammar
    assert "search" in grammar and "get_weather" not in grammar   # only the named tool
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("search", {"q": "Paris"})
    text, calls, finish = await _stream(client, tools=[WEATHER, SEARCH], tool_choice=named)
    assert finish == "tool_calls" and [n for _, n, _ in calls] == ["search"] and text == ""


@pytest.fixture(scope="module")
def deepseek_codec(tmp_path_factory):
    from ferrylm.server.text.tokenizer import TextCodec

    from .family_like import build_deepseek_like

    return TextCodec.from_pretrained(build_deepseek_like(tmp_path_factory.mktemp("deepseek-like")))


@pytest.fixture(scope="module")
def kimi_codec(tmp_path_factory):
    from ferrylm.server.text.tokenizer import TextCodec

    from .family_like import build_kimi_like

    return TextCodec.from_pretrained(build_kimi_like(tmp_path_factory.mktemp("kimi-like")))


def _special_ids(codec, text: str) -> list[int]:
    ids = codec.encode(text, add_special_tokens=False, parse_special=True)
    assert codec.encode(ds.SEP if ds.SEP in text else kimi.ARGS_BEGIN, add_special_tokens=False,
                        parse_special=True)[0] in ids   # really special ids
    return ids


async def test_deepseek_like_vocabulary_thinks_in_the_prompt_then_calls(deepseek_codec) -> None:
    """An R1-style template opens <think> in the prompt: the output starts in reasoning; auto picks deepseek_v3
    from the template (on any architecture); the special tags survive detokenization."""
    codec = deepseek_codec
    ids = _special_ids(codec, "The user wants weather.\n</think>\n\nLet me look." + CALL["deepseek_v3"])
    eng = FakeEngine(codec, max_model_len=4096)
    eng.script = lambda rid, prompt, p: ids + [eng.eos]
    client = oai(create_app(eng, codec, SERVED, architecture="LlamaForCausalLM"))
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER])
    msg = r.choices[0].message
    assert codec.decode(eng.requests[-1][1], skip_special_tokens=False).endswith("<think>\n")
    assert eng.requests[-1][2].skip_special_tokens is False
    assert msg.model_extra.get("reasoning_content") == "The user wants weather." and msg.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]


async def test_forced_call_after_a_prompt_that_opens_thinking_is_a_call(deepseek_codec) -> None:
    """tool_choice required with a thinking template: a V3.1-style ``thinking`` switch is turned off for the forced
    call (the prompt closes an empty block); where the prompt still opens <think> (the client turned thinking on,
    or an R1 template that always opens it), the grammar makes the output a call from its first token, so it must
    not be read as reasoning."""
    codec = deepseek_codec
    ids = _special_ids(codec, CALL["deepseek_v3"])
    eng = FakeEngine(codec, max_model_len=4096)
    eng.script = lambda rid, prompt, p: ids + [eng.eos]
    client = oai(create_app(eng, codec, SERVED))
    for kwargs, prompt_end in (({}, "</think>"), ({"thinking": True}, "<think>")):
        r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER], tool_choice="required",
                                                 extra_body={"chat_template_kwargs": kwargs})
        assert codec.decode(eng.requests[-1][1], skip_special_tokens=False).endswith(prompt_end)
        msg = r.choices[0].message
        assert not msg.model_extra.get("reasoning_content") and not msg.content
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
        assert r.choices[0].finish_reason == "tool_calls"
        text, calls, finish = await _stream(client, tools=[WEATHER], tool_choice="required",
                                            extra_body={"chat_template_kwargs": kwargs})
        assert finish == "tool_calls" and [n for _, n, _ in calls] == ["get_weather"] and text == ""
    sep_id = codec.encode(ds.SEP, add_special_tokens=False, parse_special=True)[0]
    assert f"<[{sep_id}]>" in eng.requests[-1][2].grammar   # the tags as the vocabulary's tokens


async def test_kimi_like_vocabulary_native_template(kimi_codec) -> None:
    """auto picks kimi_k2 from the template (the architecture is DeepSeek-V3's); the model's id comes back and the
    template writes it into the next turn's history."""
    codec = kimi_codec
    ids = _special_ids(codec, "Let me look." + CALL["kimi_k2"])
    eng = FakeEngine(codec, max_model_len=4096)
    eng.script = lambda rid, prompt, p: ids + [eng.eos]
    client = oai(create_app(eng, codec, SERVED, architecture="DeepseekV3ForCausalLM"))
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER])
    msg = r.choices[0].message
    assert msg.content == "Let me look." and eng.requests[-1][2].skip_special_tokens is False
    (call,) = msg.tool_calls
    assert call.id == "functions.get_weather:0"
    history = MSGS + [{"role": "assistant", "content": msg.content, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    await client.chat.completions.create(model=SERVED, messages=history, tools=[WEATHER])
    prompt = codec.decode(eng.requests[-1][1], skip_special_tokens=False)
    assert f"{kimi.CALL_BEGIN}functions.get_weather:0{kimi.ARGS_BEGIN}" in prompt
    # a forced call's grammar writes the section's tags as the vocabulary's special tokens
    eng.script = lambda rid, prompt, p: _special_ids(codec, CALL["kimi_k2"]) + [eng.eos]
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER], tool_choice="required")
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    args_id = codec.encode(kimi.ARGS_BEGIN, add_special_tokens=False, parse_special=True)[0]
    assert f"<[{args_id}]>" in eng.requests[-1][2].grammar


@pytest.mark.parametrize("fmt", sorted(CALL))
async def test_anthropic_messages_tool_use_in_each_format(codec, fmt: str) -> None:
    from .conftest import make_client

    eng = scripted(codec, "Let me look.\n" + CALL[fmt])
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER["function"]["parameters"]}
    async with make_client(create_app(eng, codec, SERVED, tool_call_parser=fmt)) as c:
        r = await c.post("/v1/messages", json={"model": SERVED, "max_tokens": 1024, "tools": [tool],
                                               "messages": [{"role": "user", "content": "Weather in Paris?"}]})
    body = r.json()
    assert r.status_code == 200 and body["stop_reason"] == "tool_use"
    text, use = body["content"]
    assert text == {"type": "text", "text": "Let me look."}
    assert (use["type"], use["name"], use["input"]) == ("tool_use", "get_weather", {"city": "Paris", "days": 2})


QWEN35_LIKE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def qwen35_like_codec(tmp_path_factory):
    from ferrylm.server.text.tokenizer import TextCodec

    from .conftest import build_tiny_tokenizer

    return TextCodec.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("qwen35-like"),
                                                          QWEN35_LIKE_TEMPLATE))


@pytest.mark.parametrize("family,kwargs,out,want", [
    # R1: the generation prompt always opens <think>; the output starts inside it
    ("deepseek", {}, "Weather, so a tool.\n</think>\n\nHello.", ("Weather, so a tool.", "Hello.")),
    ("deepseek", {}, "Still thinking when it stopped", ("Still thinking when it stopped", "")),
    # V3.1: thinking on opens the block; off closes an empty one, so a later </think> is just text
    ("deepseek", {"thinking": True}, "Hmm.</think>Hello.", ("Hmm.", "Hello.")),
    ("deepseek", {"thinking": False}, "Hello.</think>", ("", "Hello.</think>")),
    # Qwen3.5 / Qwen3-Next thinking: <think>\n in the prompt unless enable_thinking is false
    ("qwen35", {}, "Let me see.\n</think>\n\nHello.", ("Let me see.", "Hello.")),
    ("qwen35", {"enable_thinking": False}, "Hello.", ("", "Hello.")),
    # Kimi-K2 (non-thinking): no reasoning at all
    ("kimi", {}, "<think>not a block</think>Hello.", ("", "<think>not a block</think>Hello.")),
])
async def test_output_that_starts_in_reasoning_per_family(request, family: str, kwargs: dict, out: str,
                                                          want: tuple[str, str]) -> None:
    codec = request.getfixturevalue(f"{family}_codec" if family != "qwen35" else "qwen35_like_codec")
    eng = FakeEngine(codec, max_model_len=4096)
    eng.script = lambda rid, prompt, p: codec.encode(out, add_special_tokens=False, parse_special=True) + [eng.eos]
    client = oai(create_app(eng, codec, SERVED))
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, extra_body={"chat_template_kwargs": kwargs})
    msg = r.choices[0].message
    assert ((msg.model_extra or {}).get("reasoning_content") or "", msg.content or "") == want
    stream = await client.chat.completions.create(model=SERVED, messages=MSGS, stream=True,
                                                  extra_body={"chat_template_kwargs": kwargs})
    reasoning, content = "", ""
    async for chunk in stream:
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
    assert (reasoning, content) == want


async def test_qwen4_exp_thinks_in_the_prompt_then_calls_in_qwen3_coder_form(qwen35_like_codec) -> None:
    """Qwen3.8-Flash-Next (qwen4_exp) speaks Qwen3.5's format (transformers' reference points at Qwen3.5's
    processor): with auto, its architecture picks qwen3_coder; the template opens <think>, so the output starts in
    reasoning, then the XML call; stream equal to non-stream; the reasoning tokens are counted."""
    codec = qwen35_like_codec
    out = "The user wants weather.\n</think>\n\n" + CALL["qwen3_coder"]
    eng = scripted(codec, out)
    client = oai(create_app(eng, codec, SERVED, architecture="Qwen4ExpForCausalLM", model_type="qwen4_exp_text"))
    r = await client.chat.completions.create(model=SERVED, messages=MSGS, tools=[WEATHER])
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "The user wants weather." and not msg.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    assert r.usage.completion_tokens_details.reasoning_tokens == \
        len(codec.encode("The user wants weather.\n</think>", add_special_tokens=False))
    text, calls, finish = await _stream(client, tools=[WEATHER])
    assert text == "" and finish == "tool_calls" and [n for _, n, _ in calls] == ["get_weather"]
