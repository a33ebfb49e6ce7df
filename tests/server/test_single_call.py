"""``parallel_tool_calls: false`` (Anthropic: ``disable_parallel_tool_use: true``) with a forced call allows exactly
one call, on every route, streaming or not, in every call format's grammar (issue 43: a weak model repeated its
forced call until ``max_tokens``). With parallel calls on, how many calls is the model's choice (as vLLM has it):
the grammar admits several. Checked on the grammar the engine receives, with llguidance's matcher over bytes. With
``tool_choice`` auto and parallel calls off, a model's calls after its first are dropped (at most one call)."""

from __future__ import annotations

import json

import pytest

from ferrylm.server.api.app import create_app
from ferrylm.server.text.tool_parsers.grammars import forced_call_grammar
from ferrylm.server.text.tools import ToolChoice, ToolSpec

from .conftest import SERVED, FakeEngine, make_client
from .test_tool_grammars import FORMAT, accepts

llguidance = pytest.importorskip("llguidance")
pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
USER = [{"role": "user", "content": "Weather in Oslo?"}]
FORMATS = ["hermes", *sorted(FORMAT)]


def calls(fmt: str, n: int) -> str:
    """``n`` calls of get_weather in format ``fmt``."""
    if fmt == "hermes":
        one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        return "\n".join([one] * n)
    return FORMAT[fmt](*[("get_weather", [("city", "Oslo")])] * n)


def request(route: str, parallel: bool | None, stream: bool) -> tuple[str, dict]:
    """A forced call to the one tool; ``parallel`` False: one call asked for, None: the field left out."""
    if route == "chat":
        body = {"messages": USER, "max_tokens": 8, "tool_choice": "required", "stream": stream,
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]}
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        return "/v1/chat/completions", body
    if route == "responses":
        body = {"input": "Weather in Oslo?", "max_output_tokens": 8, "tool_choice": "required", "stream": stream,
                "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]}
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        return "/v1/responses", body
    choice = {"type": "any"} if parallel is None else {"type": "any", "disable_parallel_tool_use": not parallel}
    return "/v1/messages", {"messages": USER, "max_tokens": 8, "tool_choice": choice, "stream": stream,
                            "tools": [{"name": "get_weather", "input_schema": SCHEMA}]}


async def grammar_of(codec, fmt: str, route: str, parallel: bool | None, stream: bool) -> str:
    engine = FakeEngine(codec, max_model_len=4096)
    async with make_client(create_app(engine, codec, SERVED, tool_call_parser=fmt)) as c:
        path, body = request(route, parallel, stream)
        r = await c.post(path, json={"model": SERVED, **body})
        assert r.status_code == 200, r.text
    (_, _, params), = engine.requests
    assert params.grammar, "a forced call must reach the engine as a grammar"
    return params.grammar


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_parallel_off_allows_exactly_one_forced_call(codec, fmt: str, route: str, stream: bool) -> None:
    one = await grammar_of(codec, fmt, route, False, stream)
    assert accepts(one, calls(fmt, 1))
    assert not accepts(one, calls(fmt, 2)) and not accepts(one, calls(fmt, 3))
    default = await grammar_of(codec, fmt, route, None, stream)   # parallel calls on: the model decides
    assert accepts(default, calls(fmt, 1)) and accepts(default, calls(fmt, 2))
    assert default == await grammar_of(codec, fmt, route, True, stream)


def test_harmony_forces_one_call_whatever_parallel_says() -> None:
    """gpt-oss: the call message ends the turn (``<|call|>``), so a forced reply is one call either way."""
    tools = [ToolSpec("get_weather", "", SCHEMA)]
    one = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
    for parallel in (False, True):
        g = forced_call_grammar("harmony", tools, ToolChoice("required", parallel=parallel))
        assert accepts(g, one) and not accepts(g, one + one[len("<|channel|>"):])
        assert json.loads(one.split("<|message|>")[1].removesuffix("<|call|>")) == {"city": "Oslo"}


def two_calls_engine(codec) -> FakeEngine:
    """A model that makes two calls of its own accord (``tool_choice`` auto), in the Hermes format."""
    engine = FakeEngine(codec, max_model_len=4096)
    text = calls("hermes", 2)
    engine.script = lambda rid, ids, p: codec.encode(text, add_special_tokens=False) + [engine.eos]
    return engine


def calls_in(route: str, r) -> list[str]:
    """The names of the calls in a reply (stream or not) of ``route``."""
    if "text/event-stream" in r.headers.get("content-type", ""):
        events = [json.loads(b.split("data: ", 1)[1]) for b in r.text.split("\n\n")
                  if "data: " in b and "[DONE]" not in b]
        if route == "chat":
            return [tc["function"]["name"] for e in events for ch in e["choices"]
                    for tc in ch["delta"].get("tool_calls") or () if "name" in tc.get("function", {})]
        if route == "responses":
            return [e["item"]["name"] for e in events if e["type"] == "response.output_item.done"
                    and e["item"]["type"] == "function_call"]
        return [e["content_block"]["name"] for e in events if e["type"] == "content_block_start"
                and e["content_block"]["type"] == "tool_use"]
    body = r.json()
    if route == "chat":
        return [tc["function"]["name"] for tc in body["choices"][0]["message"]["tool_calls"] or ()]
    if route == "responses":
        return [it["name"] for it in body["output"] if it["type"] == "function_call"]
    return [b["name"] for b in body["content"] if b["type"] == "tool_use"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
async def test_parallel_off_keeps_one_call_of_a_free_choice(codec, route: str, stream: bool) -> None:
    """``tool_choice`` auto: a model that makes two calls anyway has its first kept when parallel calls are off."""
    async with make_client(create_app(two_calls_engine(codec), codec, SERVED)) as c:
        for parallel, want in ((False, 1), (None, 2)):
            path, body = request(route, parallel, stream)
            body["tool_choice"] = {"type": "auto"} if route == "messages" else "auto"
            if route == "messages" and parallel is False:
                body["tool_choice"]["disable_parallel_tool_use"] = True
            body["max_tokens" if route != "responses" else "max_output_tokens"] = 200
            r = await c.post(path, json={"model": SERVED, **body})
            assert r.status_code == 200, r.text
            assert calls_in(route, r) == ["get_weather"] * want, (parallel, r.text[-500:])
