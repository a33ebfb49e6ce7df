"""A tiny random gpt-oss checkpoint (``GptOssForCausalLM``, the published 201,088-id vocabulary) saved with a
harmony tokenizer serves chat end to end: ``ferry serve`` as a subprocess, the real ``openai`` and ``anthropic``
clients. The prompt is openai-harmony's rendering (its length is the usage); a forced call, made by harmony's
call grammar from random weights, comes back as a tool call on chat completions and as a ``tool_use`` block on
Anthropic Messages; free random output still gets an answer; a ``response_format`` runs the harmony turn's grammar in
the engine."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import openai_harmony as oh
import pytest
import torch
import transformers

from tests.e2e.conftest import start_server, stop_server
from tests.server.harmony_vocab import build_harmony_tokenizer, o200k_file

pytestmark = pytest.mark.slow

PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": PARAMS}}
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory) -> Path:
    if o200k_file() is None:
        pytest.skip("o200k_base.tiktoken not found in the litellm package (the dev extras install it)")
    folder = build_harmony_tokenizer(tmp_path_factory.mktemp("models") / "tiny-gpt-oss")
    cfg = transformers.GptOssConfig(
        vocab_size=201088, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
        eos_token_id=200002, pad_token_id=199999,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 1024})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def test_gpt_oss_chat_through_harmony_end_to_end(gpt_oss_folder, tmp_path, monkeypatch):
    import anthropic

    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))   # the vocabulary file is written there
    srv = start_server(tmp_path, "--model", str(gpt_oss_folder), "--device", "cpu", "--num-tokens", "2048")
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        forced = client.chat.completions.create(model="tiny-gpt-oss", messages=MESSAGES, tools=[TOOL],
                                                tool_choice="required", reasoning_effort="low", temperature=0,
                                                max_tokens=64)
        assert forced.choices[0].finish_reason == "tool_calls", forced.choices[0]
        (call,) = forced.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / "cache" / "harmony"))   # the server wrote it
        enc = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
        assert forced.usage.prompt_tokens == len(_library_prompt(enc))
        free = client.chat.completions.create(model="tiny-gpt-oss", messages=MESSAGES, temperature=0, max_tokens=6)
        assert free.choices[0].finish_reason in ("length", "stop") and 1 <= free.usage.completion_tokens <= 6
        # a JSON reply: the engine runs the harmony turn's grammar (analysis free, then the final message's JSON)
        rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": PARAMS}}
        shaped = client.chat.completions.create(model="tiny-gpt-oss", messages=MESSAGES, response_format=rf,
                                                temperature=0, max_tokens=48)
        (choice,) = shaped.choices
        assert choice.finish_reason in ("length", "stop"), choice
        if choice.finish_reason == "stop":
            assert json.loads(choice.message.content)["city"] in ("Paris", "Rome")
        assert 0 <= shaped.usage.completion_tokens_details.reasoning_tokens <= shaped.usage.completion_tokens
        claude = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        msg = claude.messages.create(model="tiny-gpt-oss", max_tokens=64, messages=MESSAGES[1:], system="Be terse.",
                                     tools=[{"name": "get_weather", "input_schema": PARAMS}],
                                     tool_choice={"type": "tool", "name": "get_weather"})
        assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
        assert msg.content[0].input["city"] in ("Paris", "Rome")
    finally:
        assert stop_server(srv) == 0, srv.log()[-3000:]


def _library_prompt(enc: oh.HarmonyEncoding) -> list[int]:
    import datetime

    system = oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort.LOW).with_conversation_start_date(
        datetime.date.today().isoformat())
    dev = oh.DeveloperContent.new().with_instructions("Be terse.").with_function_tools(
        [oh.ToolDescription.new("get_weather", "Current weather", PARAMS)])
    conv = oh.Conversation.from_messages([oh.Message.from_role_and_content(oh.Role.SYSTEM, system),
                                          oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev),
                                          oh.Message.from_role_and_content(oh.Role.USER, "Weather in Paris?")])
    return enc.render_conversation_for_completion(conv, oh.Role.ASSISTANT)
