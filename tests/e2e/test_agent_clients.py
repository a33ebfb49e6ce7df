"""Agents' and SDKs' requests against ``ferry serve`` with the built-in model: tool calls, structured output,
Anthropic Messages and the Responses API through the real ``openai`` and ``anthropic`` SDKs, LiteLLM and
LangChain's ChatOpenAI.

The model is tiny: what is checked is structure that constrained decoding guarantees (a forced call names a
tool and its arguments are valid against the schema; structured output parses and validates), well-formed event
sequences, and stream == non-stream under greedy decoding. Schemas use enums and small integers so the outputs
stay a few tokens long (the whole module is a few dozen generated tokens per request).
"""

from __future__ import annotations

import json
import os
from typing import Literal

import pytest
from pydantic import BaseModel

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # LiteLLM: no network fetch at import

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

MODEL = "smollm2-moe"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": CITY}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Answer(BaseModel):
    city: Literal["Paris", "London", "Rome"]
    sunny: bool


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(name: str, arguments: str | dict) -> None:
    assert name == "get_weather"
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, CITY)


def test_openai_forced_tool_call_stream_equals_non_stream(client) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=48)
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check_call(call.function.name, call.function.arguments)
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=48, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream_options={"include_usage": True})
    calls, finish, usage = {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                calls.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and usage is not None and usage.completion_tokens == resp.usage.completion_tokens
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(call.function.name, json.loads(call.function.arguments))]


def test_openai_parse_with_pydantic_schema(client) -> None:
    done = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                         response_format=Answer, temperature=0, max_tokens=32)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Answer), done.choices[0].message.content


def test_openai_responses_stream_and_previous_response_id(client) -> None:
    """(The SDK's ``responses.stream`` against every event kind, and stream == non-stream, are in
    tests/server/test_agent_apis.py with a scripted engine.)"""
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=6, temperature=0) as s:
        events = list(s)
    deltas = [ev.delta for ev in events if ev.type == "response.output_text.delta"]
    last = events[-1]   # response.incomplete when max_output_tokens cut it (as OpenAI's API does)
    assert last.type in ("response.completed", "response.incomplete")
    r = last.response
    assert "".join(deltas) == r.output_text and r.output_text
    follow = client.responses.create(model=MODEL, input="Weather in Paris?", previous_response_id=r.id,
                                     max_output_tokens=48, temperature=0, tool_choice="required",
                                     parallel_tool_calls=False,
                                     tools=[{"type": "function", "name": "get_weather", "parameters": CITY}])
    (call,) = [it for it in follow.output if it.type == "function_call"]
    _check_call(call.name, call.arguments)
    assert follow.usage.input_tokens > r.usage.input_tokens   # the earlier turn is in the prompt


def test_anthropic_messages_tool_use_round_trip(default_server) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=default_server.base_url, api_key="unused", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": "Current weather of a city", "input_schema": CITY}
    GREEDY = {"temperature": 0}   # the 2.x SDK has no temperature argument; the API field still exists
    msg = client.messages.create(model=MODEL, max_tokens=48, extra_body=GREEDY, tools=[tool],
                                 tool_choice={"type": "tool", "name": "get_weather"}, messages=ASK)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    _check_call(use.name, use.input)
    with client.messages.stream(model=MODEL, max_tokens=6, extra_body=GREEDY, tools=[tool], messages=ASK + [
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}
    ]) as s:
        text = "".join(s.text_stream)
        answer = s.get_final_message()
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    assert text == "".join(b.text for b in answer.content if b.type == "text")
    n = client.messages.count_tokens(model=MODEL, messages=ASK)
    # the tools' system turn is not in this one (Anthropic's prompt: input tokens + those read from the cache)
    assert 0 < n.input_tokens < msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_litellm_tools_and_stream(default_server) -> None:
    litellm = pytest.importorskip("litellm")
    kw = {"model": f"openai/{MODEL}", "api_base": f"{default_server.base_url}/v1", "api_key": "unused",
          "temperature": 0}
    resp = litellm.completion(messages=ASK, tools=[WEATHER], tool_choice="required",
                              parallel_tool_calls=False, max_tokens=48, **kw)
    (call,) = resp.choices[0].message.tool_calls
    _check_call(call.function.name, call.function.arguments)
    chunks = list(litellm.completion(messages=ASK, max_tokens=4, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_langchain_bind_tools_and_structured_output(default_server) -> None:
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=MODEL, base_url=f"{default_server.base_url}/v1", api_key="unused", temperature=0,
                        max_tokens=48, max_retries=0)
    forced = llm.bind_tools([WEATHER], tool_choice="required", parallel_tool_calls=False)
    msg = forced.invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    _check_call(call["name"], call["args"])
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Answer, method=method).invoke("Weather in Rome?")
        assert isinstance(out, Answer), method
    chunks = list(llm.bind(max_tokens=4).stream("Say hi."))
    assert "".join(c.content for c in chunks)
    assert [c.response_metadata["finish_reason"] for c in chunks if c.response_metadata.get("finish_reason")] == \
        ["length"]


def test_echo_prompt_logprobs_equal_generation_logprobs(client) -> None:
    """Scoring a text (echo + logprobs + max_tokens 0, as lm-evaluation-harness does) gives the logprobs the model
    gave the same tokens while generating them: the prompt logprobs are exact against our own forward."""
    gen = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                    logprobs=1, extra_body={"return_token_ids": True, "ignore_eos": True})
    ch = gen.choices[0]
    prompt_ids, out_ids = ch.model_extra["prompt_token_ids"], ch.model_extra["token_ids"]
    scored = client.completions.create(model=MODEL, prompt=prompt_ids + out_ids, echo=True, logprobs=1,
                                       max_tokens=0)
    sc = scored.choices[0]
    assert sc.finish_reason == "length" and scored.usage.completion_tokens == 0
    lps = sc.logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(prompt_ids) + len(out_ids)
    # measured: 5e-6 (one prefill vs token-by-token decode, float32 on the CPU)
    assert lps[len(prompt_ids):] == pytest.approx(ch.logprobs.token_logprobs, abs=1e-4)
