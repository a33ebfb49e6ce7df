"""A tool whose schema is no valid JSON schema is a 400 naming that tool's schema field, short, for every
``tool_choice`` (chat, Responses, Anthropic, through the real SDKs); a valid schema a forced call cannot enforce
names the field too, without the server's grammar."""

from __future__ import annotations

import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED
from .test_fresh_user_api import anth, oai, scripted

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.anyio

GOOD = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BAD = [
    {"type": "object", "properties": {"city": {"type": "nonsense"}}},
    {"type": "object", "properties": ["city"]},
    {"type": "object", "required": "city"},
    {"type": "object", "properties": {"city": {"type": "string", "pattern": "("}}},
]
IDS = ["nested-type", "properties-list", "required-string", "bad-regex"]
#: refused before by chat and Responses with their field named; Anthropic named the wrong field
NOT_OBJECTS = [{"type": "nonsense"}, ["not", "an", "object"]]
MSGS = [{"role": "user", "content": "Weather?"}]


def check_message(message: str, field: str) -> None:
    assert f"'{field}'" in message and len(message) < 300, message
    assert "%json" not in message and "start:" not in message, message   # no grammar dump


def chat_tools(bad) -> list[dict]:
    return [{"type": "function", "function": {"name": "get_weather", "parameters": GOOD}},
            {"type": "function", "function": {"name": "lookup", "parameters": bad}}]


@pytest.mark.parametrize("bad", BAD, ids=IDS)
@pytest.mark.parametrize("tool_choice", ["auto", "none", "required", "named"])
async def test_chat_and_responses_name_the_bad_schema(codec, bad, tool_choice) -> None:
    client = oai(create_app(scripted(codec, "Hello world!"), codec, SERVED))
    chat_choice = {"type": "function", "function": {"name": "lookup"}} if tool_choice == "named" else tool_choice
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=SERVED, messages=MSGS, max_tokens=4, tools=chat_tools(bad),
                                             tool_choice=chat_choice)
    assert e.value.status_code == 400 and e.value.body["param"] == "tools.1.function.parameters"
    check_message(e.value.body["message"], "tools.1.function.parameters")
    resp_tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                  for t in chat_tools(bad)]
    resp_choice = {"type": "function", "name": "lookup"} if tool_choice == "named" else tool_choice
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model=SERVED, input="Weather?", max_output_tokens=4, tools=resp_tools,
                                      tool_choice=resp_choice)
    assert e.value.body["param"] == "tools.1.parameters"
    check_message(e.value.body["message"], "tools.1.parameters")


@pytest.mark.parametrize("bad", BAD + NOT_OBJECTS, ids=IDS + ["type", "list"])
@pytest.mark.parametrize("tool_choice", [{"type": "auto"}, {"type": "none"}, {"type": "any"},
                                         {"type": "tool", "name": "lookup"}])
async def test_anthropic_names_the_bad_input_schema(codec, bad, tool_choice) -> None:
    client = anth(create_app(scripted(codec, "Hello world!"), codec, SERVED))
    tools = [{"name": "get_weather", "input_schema": GOOD}, {"name": "lookup", "input_schema": bad}]
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.create(model=SERVED, max_tokens=4, messages=MSGS, tools=tools, tool_choice=tool_choice)
    assert e.value.status_code == 400
    check_message(e.value.body["error"]["message"], "tools.1.input_schema")


UNENFORCEABLE = {"type": "object", "properties": {"city": {"$ref": "#/$defs/missing"}}}   # a valid schema


async def test_a_schema_a_forced_call_cannot_enforce_names_its_field(codec) -> None:
    client = oai(create_app(scripted(codec, "Hello world!"), codec, SERVED))
    tools = chat_tools(UNENFORCEABLE)
    ok = await client.chat.completions.create(model=SERVED, messages=MSGS, max_tokens=4, tools=tools)
    assert ok.choices[0].message.content   # auto: the schema is only shown to the model
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=SERVED, messages=MSGS, max_tokens=4, tools=tools,
                                             tool_choice="required")
    assert e.value.body["param"] == "tools.1.function.parameters"
    check_message(e.value.body["message"], "tools.1.function.parameters")
    assert "missing" in e.value.body["message"]
