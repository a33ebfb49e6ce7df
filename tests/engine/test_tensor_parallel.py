"""Tensor parallel (``--tensor-parallel-size``): flag validation, sharded models against TP=1, the rank group."""

from __future__ import annotations

import pytest

from ferrylm.cli import build_parser, engine_config_from_args
from ferrylm.config import EngineConfig, ModelConfig


def _mcfg(**over) -> ModelConfig:
    base = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=128, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                num_experts_per_tok=2, mlp_only_layers=[0])
    return ModelConfig.from_dict({**base, **over})


def test_flag_and_alias_reach_the_engine_config():
    p = build_parser()
    for flag in ("--tensor-parallel-size", "--tp-size"):
        a = p.parse_args(["serve", "--model", "x", flag, "2"])
        assert engine_config_from_args(a).tensor_parallel_size == 2
    assert engine_config_from_args(p.parse_args(["serve", "--model", "x"])).tensor_parallel_size == 1


@pytest.mark.parametrize("n, ok", [(1, True), (2, True), (4, True), (3, False), (8, False)])
def test_heads_and_widths_must_divide(n, ok):
    cfg = EngineConfig(tensor_parallel_size=n).validate()
    if ok:
        cfg.check_model(_mcfg())   # n = 4 > 2 KV heads: replicated
    else:
        with pytest.raises(ValueError, match="--tensor-parallel-size"):
            cfg.check_model(_mcfg())


def test_each_width_is_named():
    cfg = EngineConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        cfg.check_model(_mcfg(moe_intermediate_size=47))
    with pytest.raises(ValueError, match="intermediate_size \\(95\\)"):
        cfg.check_model(_mcfg(intermediate_size=95))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        EngineConfig(tensor_parallel_size=4).check_model(_mcfg(num_attention_heads=12, num_key_value_heads=3))


def test_out_of_range_and_device_index_refused():
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        EngineConfig(tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match="cuda:r"):
        EngineConfig(tensor_parallel_size=2, device="cuda:1").validate()
