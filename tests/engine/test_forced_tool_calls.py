"""Forced tool calls from a tiny random GLM-4.5 model (Glm4MoeForCausalLM, loaded through ferrylm's loader) through
the real engine, in each call format (Hermes, GLM-4.5, MiniMax-M2): the format's grammar with the vocabulary's
special-token tags constrains decoding, greedy and sampled, and the output always ends by itself (``stop``, so the
reply's finish_reason is ``tool_calls``) and parses into strict calls with no text left over; a ``required`` reply
with parallel calls allowed holds at most MAX_FORCED_CALLS (a greedy model repeating its call still ends).

The tool's parameters are bounded (enums, booleans, a small integer range), so every walk through the grammar ends
well inside ``max_tokens``; free-text values are unbounded in the grammar (a random model can ramble in one until
``max_tokens``)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.checkpoints.loader import load_model
from ferrylm.server.api.assistant import TurnConfig, whole_turn
from ferrylm.server.text.tool_parsers.grammars import forced_call_grammar
from ferrylm.server.text.tools import MAX_FORCED_CALLS, ToolChoice, ToolSpec, lark_term, tag_terms, tool_call_grammar
from tests.models.hf_checkpoints import _randomize_
from tests.server.glm_like import build_glm_like_tokenizer

pytest.importorskip("llguidance")

TOOLS = [ToolSpec("set_mode", "", {"type": "object", "required": ["mode", "loud"], "additionalProperties": False,
                                   "properties": {"mode": {"type": "string", "enum": ["eco", "fast", "quiet"]},
                                                  "loud": {"type": "boolean"},
                                                  "level": {"type": "integer", "enum": [1, 2, 3]}}}),
         ToolSpec("reset", "", {"type": "object", "properties": {"hard": {"type": "boolean"}}})]


@pytest.fixture(scope="module")
def glm_codec(tmp_path_factory):
    """A GLM-4.5-like vocabulary (its tool tags special tokens) and template (tests/server/glm_like.py)."""
    from ferrylm.server.text.tokenizer import TextCodec

    return TextCodec.from_pretrained(build_glm_like_tokenizer(tmp_path_factory.mktemp("glm-like-tokenizer")))


@pytest.fixture(scope="module")
def glm_model(glm_codec, tmp_path_factory):
    cfg = transformers.Glm4MoeConfig(vocab_size=glm_codec.vocab_size, hidden_size=64, intermediate_size=96,
                                     moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                     first_k_dense_replace=1, max_position_embeddings=1024,
                                     eos_token_id=glm_codec.eos_token_ids[0])
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    _randomize_(ref, 3)
    path = tmp_path_factory.mktemp("glm-tiny")
    ref.save_pretrained(path)
    return load_model(path)


def _generate(loaded, codec, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    tok_dir = codec.tokenizer.name_or_path
    ec = EngineConfig(device="cpu", num_pages=128, page_size=8, max_running_requests=4, max_prefill_length=256)
    engine = engine_for_model(loaded.model, loaded.config, ec, device=torch.device("cpu"), dtype=torch.float32,
                    tokenizer_path=tok_dir)
    engine.add_request("r", prompt, params)
    ids, reason = [], None
    for _ in range(1000):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error_code is None, o.error_message
            ids += o.new_token_ids
            reason = o.finish_reason or reason
    return ids, reason


@pytest.mark.parametrize("fmt", ["hermes", "glm45", "minimax_m2"])
@pytest.mark.parametrize("mode", ["required", "parallel", "named"])
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.5, 3)])
def test_forced_call_always_closes_and_parses(glm_model, glm_codec, fmt, mode, temperature, seed):
    codec = glm_codec
    choice = {"required": ToolChoice("required", parallel=False), "parallel": ToolChoice("required"),
              "named": ToolChoice("named", "set_mode", parallel=False)}[mode]
    grammar = tool_call_grammar(TOOLS, choice, tags=tag_terms(codec)) if fmt == "hermes" else \
        forced_call_grammar(fmt, TOOLS, choice, lark_term(codec))
    prompt = codec.encode("Hello world! Set the mode.")
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=900, grammar=grammar)
    ids, reason = _generate(glm_model, codec, prompt, params)
    assert reason == "stop"  # the grammar completed and allowed only EOS
    eos = set(codec.eos_token_ids)
    text = codec.decode([t for t in ids if t not in eos], skip_special_tokens=False)
    cfg = TurnConfig(tool_names=tuple(t.name for t in TOOLS), tool_parser=fmt,
                     tool_schemas={t.name: t.parameters for t in TOOLS})
    res = whole_turn(cfg, text, reason)
    assert res.content == "" and res.finish_reason == "tool_calls", text  # no markup left as content
    assert 1 <= len(res.calls) <= (MAX_FORCED_CALLS if mode == "parallel" else 1)
    for call in res.calls:
        args = json.loads(call.arguments)
        schema = next(t.parameters for t in TOOLS if t.name == call.name)
        assert set(schema.get("required", [])) <= set(args) <= set(schema["properties"])
        if mode == "named":
            assert call.name == "set_mode"
        if call.name == "set_mode":
            assert args["mode"] in ("eco", "fast", "quiet") and isinstance(args["loud"], bool)
            assert args.get("level", 1) in (1, 2, 3)
