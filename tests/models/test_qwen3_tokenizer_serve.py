"""A tiny random Qwen3-MoE checkpoint saved with the real Qwen3 tokenizer and chat template serves a chat request
end to end: ``ferry serve`` as a subprocess, the real ``openai`` client. The text is random; the vocabulary, the
template, its special tokens and the usage counts are real."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import torch
import transformers

from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]  # the project root (holds pyproject.toml)
TOKENIZER_DIR = ROOT.parent / "shared" / "data" / "qwen3-tokenizer"
IM_START, IM_END = 151644, 151645  # <|im_start|>, <|im_end|> in the Qwen3 vocabulary
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8


def _ids(encoded) -> list[int]:
    """``apply_chat_template(tokenize=True)`` returns a list in older transformers, a BatchEncoding in v5."""
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"the real Qwen3 tokenizer is absent: {TOKENIZER_DIR} (shared test data, see "
                    f"../shared/data/qwen3-tokenizer/SOURCE.md)")
    folder = tmp_path_factory.mktemp("models") / "tiny-qwen3-moe"
    # the published vocabulary (151936 ids cover the tokenizer's 151669); everything else tiny
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512, bos_token_id=151643, eos_token_id=IM_END,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, folder / name)
    return folder


def test_chat_request_end_to_end_with_real_template(qwen3_folder, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(qwen3_folder)
    assert len(tok) <= 151936
    prompt_ids = _ids(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True))
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    # the template's special tokens are there: one <|im_start|> per message plus the generation prompt
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert prompt_ids.count(IM_START) == len(MESSAGES) + 1 and prompt_ids.count(IM_END) == len(MESSAGES)

    srv = start_server(tmp_path, "--model", str(qwen3_folder), "--device", "cpu", "--num-tokens", "2048")
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny-qwen3-moe"]
        resp = client.chat.completions.create(model="tiny-qwen3-moe", messages=MESSAGES, temperature=0,
                                              max_tokens=MAX_TOKENS)
        assert resp.object == "chat.completion" and resp.model == "tiny-qwen3-moe"
        assert len(resp.choices) == 1
        choice = resp.choices[0]
        assert choice.index == 0 and choice.message.role == "assistant"
        assert isinstance(choice.message.content, str)
        assert resp.usage.prompt_tokens == len(prompt_ids)  # the server applied the same template
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
        if choice.finish_reason == "length":
            assert resp.usage.completion_tokens == MAX_TOKENS
        else:  # a random model may hit <|im_end|>, the EOS of this config
            assert choice.finish_reason == "stop" and 1 <= resp.usage.completion_tokens <= MAX_TOKENS
        # greedy is reproducible through the server, streamed or not
        stream = client.chat.completions.create(model="tiny-qwen3-moe", messages=MESSAGES, temperature=0,
                                                max_tokens=MAX_TOKENS, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == choice.message.content
        # a forced tool call from random weights: the grammar (with Qwen's one-token <tool_call> tags) makes it
        # a valid call to the named tool; the template renders the tools itself
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
            "additionalProperties": False}}}
        forced = client.chat.completions.create(model="tiny-qwen3-moe", messages=MESSAGES, temperature=0,
                                                max_tokens=64, tools=[tool], tool_choice="required",
                                                parallel_tool_calls=False)
        assert forced.choices[0].finish_reason == "tool_calls", forced.choices[0]
        (call,) = forced.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        assert forced.usage.prompt_tokens > resp.usage.prompt_tokens   # the template's tools section
    finally:
        assert stop_server(srv) == 0, srv.log()[-3000:]


def test_synthetic_qwen3_30b_served_with_the_real_tokenizer(tmp_path, monkeypatch):
    """``ferry serve --model synthetic:qwen3-30b-a3b:layers=1 --tokenizer FOLDER``: real shapes, random weights,
    text through the real tokenizer (about 3 GB of memory in the engine process)."""
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"the real Qwen3 tokenizer is absent: {TOKENIZER_DIR}")
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))
    name = "synthetic:qwen3-30b-a3b:layers=1"
    srv = start_server(tmp_path, "--model", name, "--tokenizer", str(TOKENIZER_DIR), "--device", "cpu",
                       "--num-tokens", "1024")
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [name]
        resp = client.chat.completions.create(model=name, messages=MESSAGES, temperature=0, max_tokens=4)
        tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
        want = _ids(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True))
        assert resp.usage.prompt_tokens == len(want)
        assert resp.choices[0].finish_reason in ("length", "stop") and 1 <= resp.usage.completion_tokens <= 4
    finally:
        assert stop_server(srv) == 0, srv.log()[-3000:]
