"""DeepSeek-V4's chat format: the checkpoint ships no chat template (its format is Python beside the weights,
``encoding/encoding_dsv4.py``), so a tokenizer folder of ``model_type`` ``deepseek_v4`` gets the built-in
template; the prompt is checked character for character against that format's rules (tools in the first system
message, tool results folded into user turns as ``<tool_result>`` in call order, ``<think>`` / ``</think>`` after
``<｜Assistant｜>``, earlier reasoning dropped unless tools are offered, the maximum-effort preamble). Its DSML tool
calls and ``<think>`` reasoning come back through the ASGI app with a scripted engine and the ``openai`` SDK,
stream equal to non-stream; a forced call is enforced by the DSML grammar; the synthetic preset's folder serves
the same."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from ferrylm.server.api.app import create_app
from ferrylm.server.text.tokenizer import TextCodec
from ferrylm.server.text.tool_parsers import choose_tool_parser
from ferrylm.server.text.tool_parsers.deepseek_v4 import DSML

from .conftest import SERVED, FakeEngine
from .family_like import ASSISTANT, BOS, EOS, USER, build_family_tokenizer

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio

ARCH = {"architecture": "DeepseekV4ForCausalLM", "model_type": "deepseek_v4"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}
SCHEMA_LINE = json.dumps(WEATHER["function"], ensure_ascii=False)
USER_MSG = [{"role": "user", "content": "Weather in Paris?"}]
CALL = (f'<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
        f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
        f'<{DSML}parameter name="days" string="false">2</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>')


def v4_folder(folder: Path) -> Path:
    """A DeepSeek-like tokenizer without a chat template, beside a config.json of model_type deepseek_v4."""
    build_family_tokenizer(folder, [BOS, EOS, USER, ASSISTANT, "<think>", "</think>"], None, EOS, BOS)
    (folder / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"],
                                                    "model_type": "deepseek_v4"}))
    return folder


@pytest.fixture(scope="module")
def v4_codec(tmp_path_factory: pytest.TempPathFactory) -> TextCodec:
    return TextCodec.from_pretrained(v4_folder(tmp_path_factory.mktemp("dsv4-tokenizer")))


def scripted(codec: TextCodec, text: str) -> FakeEngine:
    eng = FakeEngine(codec, max_model_len=4096)
    eng.script = lambda rid, ids, p: codec.encode(text, add_special_tokens=False, parse_special=True) + [eng.eos]
    return eng


def oai(app) -> "openai.AsyncOpenAI":
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False))
    return openai.AsyncOpenAI(http_client=http, base_url="http://test/v1", api_key="x", max_retries=0)


# ---------------------------------------------------------------------------------------------------------
# the prompt
# ---------------------------------------------------------------------------------------------------------


def test_prompt_with_tools_thinking_and_tool_results(v4_codec) -> None:
    msgs = [{"role": "system", "content": "Be terse."}, *USER_MSG,
            {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris", "days": 2}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            {"role": "tool", "tool_call_id": "c2", "content": "sunny"}]
    text = v4_codec.render_chat(msgs, True, [WEATHER], thinking=True)
    head, tail = text.split("### Available Tool Schemas\n\n")
    assert head.startswith(f"{BOS}Be terse.\n\n## Tools\n\nYou have access to a set of tools")
    assert f'writing a "<{DSML}tool_calls>" block' in head and 'string="true|false">$PARAMETER_VALUE' in head
    assert tail == (f"{SCHEMA_LINE}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to "
                    f"invoke tool calls.\n{USER}Weather in Paris?{ASSISTANT}<think>Need the tool.</think>\n\n{CALL}"
                    f"{EOS}{USER}<tool_result>18C</tool_result>\n\n<tool_result>sunny</tool_result>{ASSISTANT}<think>")


def weather_calls(*cities: str) -> str:
    """The DSML block of ``get_weather`` calls, one per city, as encoding_dsv4 writes a turn's calls."""
    invokes = [f'<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city" string="true">{c}</{DSML}parameter>'
               f'\n</{DSML}invoke>' for c in cities]
    return f"<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def calls(*pairs: tuple[str, str]) -> list[dict]:
    return [{"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
            for cid, city in pairs]


def test_tool_results_follow_the_call_order_across_turns(v4_codec) -> None:
    """encoding_dsv4 sorts the tool results of a user turn by the place of their call in the latest assistant tool
    calls (stable; a result whose id names no call counts as the first call), and a user message after tool results
    joins their turn."""
    msgs = [{"role": "user", "content": "Paris and Rome?"},
            {"role": "assistant", "content": "", "reasoning_content": "Two cities.",
             "tool_calls": calls(("c1", "Paris"), ("c2", "Rome"))},
            {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            {"role": "user", "content": "Now Oslo and Bern."},
            {"role": "assistant", "content": "Checking.", "tool_calls": calls(("s1", "Oslo"), ("s2", "Bern"))},
            {"role": "tool", "tool_call_id": "s2", "content": "rain"},
            {"role": "tool", "tool_call_id": "x9", "content": "orphan"},
            {"role": "tool", "tool_call_id": "s1", "content": "snow"}]
    text = v4_codec.render_chat(msgs, True, [WEATHER], thinking=True)
    assert text.split("invoke tool calls.\n", 1)[1] == (
        f"{USER}Paris and Rome?{ASSISTANT}<think>Two cities.</think>\n\n{weather_calls('Paris', 'Rome')}{EOS}"
        f"{USER}<tool_result>18C</tool_result>\n\n<tool_result>sunny</tool_result>\n\nNow Oslo and Bern."
        f"{ASSISTANT}<think></think>Checking.\n\n{weather_calls('Oslo', 'Bern')}{EOS}"
        f"{USER}<tool_result>orphan</tool_result>\n\n<tool_result>snow</tool_result>\n\n<tool_result>rain</tool_result>"
        f"{ASSISTANT}<think>")
    # user text between the results keeps its place; the results around it are put in call order
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                               "tool_calls": calls(("c1", "Paris"), ("c2", "Rome"))},
            {"role": "tool", "tool_call_id": "c2", "content": "B"}, {"role": "user", "content": "note"},
            {"role": "tool", "tool_call_id": "c1", "content": "A"}]
    assert v4_codec.render_chat(msgs) == (
        f"{BOS}{USER}q{ASSISTANT}</think>\n\n{weather_calls('Paris', 'Rome')}{EOS}"
        f"{USER}<tool_result>A</tool_result>\n\nnote\n\n<tool_result>B</tool_result>{ASSISTANT}</think>")


def test_prompt_history_chat_mode_and_max_effort(v4_codec) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "r"},
            {"role": "user", "content": "again"}]
    # chat mode (the default): every turn closes the block; earlier reasoning is not shown
    assert v4_codec.render_chat(msgs) == (f"{BOS}{USER}hi{ASSISTANT}</think>Hello{EOS}{USER}again{ASSISTANT}"
                                          "</think>")
    # thinking: only the last turn opens <think>; "max" puts the maximum-effort preamble first
    text = v4_codec.render_chat(msgs, thinking=True, reasoning_effort="max")
    assert text.startswith(f"{BOS}Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert text.endswith(f"unchecked.\n\n{USER}hi{ASSISTANT}</think>Hello{EOS}{USER}again{ASSISTANT}<think>")
    assert v4_codec.render_chat(msgs, enable_thinking=True).endswith(f"{ASSISTANT}<think>")
    # no tools, no system: nothing before the first user turn; no generation prompt when not asked
    assert v4_codec.render_chat(msgs[:1], add_generation_prompt=False) == f"{BOS}{USER}hi"


async def test_response_format_schema_in_the_system_turn(v4_codec) -> None:
    eng = scripted(v4_codec, '{"city": "Paris"}')
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    await oai(create_app(eng, v4_codec, SERVED, **ARCH)).chat.completions.create(
        model=SERVED, messages=USER_MSG, response_format=rf)
    prompt = v4_codec.decode(eng.requests[0][1], skip_special_tokens=False)
    assert prompt == (f"{BOS}\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                      f"{json.dumps(schema)}{USER}Weather in Paris?{ASSISTANT}</think>")


def test_template_only_for_a_folder_without_one(tmp_path) -> None:
    plain = build_family_tokenizer(tmp_path / "plain", [BOS, EOS, USER, ASSISTANT], None, EOS, BOS)
    assert not TextCodec.from_pretrained(plain).has_chat_template   # no config.json: no model type
    (plain / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    assert "｜DSML｜" in TextCodec.from_pretrained(plain).chat_template
    own = build_family_tokenizer(tmp_path / "own", [BOS, EOS, USER, ASSISTANT], "{{ messages[0].content }}", EOS, BOS)
    (own / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    assert TextCodec.from_pretrained(own).chat_template == "{{ messages[0].content }}"   # its own wins


# ---------------------------------------------------------------------------------------------------------
# the output: reasoning and DSML calls
# ---------------------------------------------------------------------------------------------------------


async def test_reasoning_and_tool_call_stream_equals_non_stream(v4_codec) -> None:
    out = "The user wants the weather.</think>\n\n" + CALL
    eng = scripted(v4_codec, out)
    app = create_app(eng, v4_codec, SERVED, **ARCH)
    assert app.state.server.chat_format.tool_parser == "deepseek_v4"
    client = oai(app)
    kw = dict(model=SERVED, messages=USER_MSG, tools=[WEATHER], extra_body={"chat_template_kwargs": {"thinking": True}})
    resp = await client.chat.completions.create(**kw)
    assert v4_codec.decode(eng.requests[0][1], skip_special_tokens=False).endswith(f"{ASSISTANT}<think>")
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    reasoning, args, finish = [], [], None
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasoning.append((ch.delta.model_extra or {}).get("reasoning_content") or "")
            args += [tc.function.arguments or "" for tc in ch.delta.tool_calls or ()]
            finish = ch.finish_reason or finish
    assert "".join(reasoning) == "The user wants the weather." and finish == "tool_calls"
    assert json.loads("".join(args)) == {"city": "Paris", "days": 2}
    # thinking off (the default): content, and a string="true" value stays a string whatever it looks like
    text_call = CALL.replace('string="false">2<', 'string="true">2<')
    resp = await oai(create_app(scripted(v4_codec, "Checking." + "\n\n" + text_call), v4_codec, SERVED, **ARCH)
                     ).chat.completions.create(model=SERVED, messages=USER_MSG, tools=[WEATHER])
    msg = resp.choices[0].message
    assert msg.content == "Checking." and json.loads(msg.tool_calls[0].function.arguments)["days"] == "2"


async def test_dsml_marker_as_special_tokens_survives_detokenization(tmp_path) -> None:
    """A vocabulary holding ``<｜DSML｜`` / ``</｜DSML｜`` as special tokens (and ``<think>`` as text): a turn with
    tools keeps them in its text (``skip_special_tokens`` off), so the calls are read."""
    folder = tmp_path / "tok"
    build_family_tokenizer(folder, [BOS, EOS, USER, ASSISTANT, f"<{DSML}", f"</{DSML}"], None, EOS, BOS)
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    codec = TextCodec.from_pretrained(folder)
    eng = scripted(codec, CALL)
    resp = await oai(create_app(eng, codec, SERVED, **ARCH)).chat.completions.create(
        model=SERVED, messages=USER_MSG, tools=[WEATHER])
    assert eng.requests[0][2].skip_special_tokens is False
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["get_weather"]


async def test_forced_call_uses_the_dsml_grammar(v4_codec) -> None:
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf

    eng = scripted(v4_codec, CALL)
    client = oai(create_app(eng, v4_codec, SERVED, **ARCH))
    resp = await client.chat.completions.create(model=SERVED, messages=USER_MSG, tools=[WEATHER],
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert resp.choices[0].message.tool_calls[0].function.name == "get_weather"
    rid, prompt, params = eng.requests[0]
    assert v4_codec.decode(prompt, skip_special_tokens=False).endswith(f"{ASSISTANT}</think>")
    lt = llguidance.hf.from_tokenizer(v4_codec.tokenizer, n_vocab=v4_codec.vocab_size, eos_token=eng.eos)

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(lt, params.grammar, log_level=0)
        ids = v4_codec.encode(text, add_special_tokens=False, parse_special=True)
        return all(m.consume_token(t) for t in ids) and m.is_accepting()

    assert accepts(CALL)
    assert accepts(CALL.replace(f'\n<{DSML}parameter name="days" string="false">2</{DSML}parameter>', ""))
    assert not accepts(CALL.replace('string="false">2<', 'string="false">"two"<'))   # days is an integer
    assert not accepts(CALL.replace("get_weather", "search"))


async def test_synthetic_preset_folder_serves_the_format(tmp_path) -> None:
    from ferrylm.synthetic.spec import materialize, parse_synthetic_spec

    tok = v4_folder(tmp_path / "tok")
    (tok / "config.json").unlink()   # the tokenizer alone; the synthetic folder brings the config
    folder = materialize(parse_synthetic_spec(f"synthetic:deepseek-v4-flash:layers=1:tokenizer={tok}"),
                         tmp_path / "cache")
    codec = TextCodec.from_pretrained(folder)
    assert choose_tool_parser("auto", "DeepseekV4ForCausalLM", codec.chat_template, "deepseek_v4") == "deepseek_v4"
    eng = scripted(codec, "Paris it is.</think>\n\nSunny.")
    resp = await oai(create_app(eng, codec, SERVED, **ARCH)).chat.completions.create(
        model=SERVED, messages=USER_MSG, extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = resp.choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"]) == ("Sunny.", "Paris it is.")
    assert resp.usage.completion_tokens_details.reasoning_tokens > 0
