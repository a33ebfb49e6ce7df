"""The loader refuses what it cannot serve, with a message naming the cause."""

from __future__ import annotations

import json

import pytest
from tests.models.hf_checkpoints import copy_checkpoint, copy_config
from safetensors.torch import load_file, save_file

from ferrylm.errors import ModelLoadError, UnsupportedArchitecture
from ferrylm.checkpoints.loader import load_model
from ferrylm.models.registry import get_model_class, supported_architectures


def _edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_unsupported_architecture_lists_supported(checkpoints, tmp_path):
    folder = copy_config(checkpoints("llama").path, tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitecture) as e:
        load_model(folder)
    assert "GPT2LMHeadModel" in e.value.message
    for arch in ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        assert arch in e.value.message and arch in supported_architectures()
    assert e.value.code == "unsupported_architecture"
    with pytest.raises(UnsupportedArchitecture):
        get_model_class("Nope")


def test_missing_config_and_missing_weights(tmp_path, checkpoints):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    folder = copy_config(checkpoints("llama").path, tmp_path / "noweights")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(folder)


def test_missing_dense_tensor_is_named(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints("llama").path, tmp_path / "m")
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(folder)


def test_missing_expert_is_named(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints("mixtral").path, tmp_path / "m")
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.5.w2.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1 expert 5 down"):
        load_model(folder)


def test_unexpected_tensors_are_named(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints("mixtral").path, tmp_path / "m")

    def add(t):
        t["model.layers.0.self_attn.extra.weight"] = t["model.norm.weight"].clone()
    _edit_tensors(folder, add)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.extra\.weight"):
        load_model(folder)

    folder = copy_checkpoint(checkpoints("mixtral").path, tmp_path / "m2")

    def add_expert(t):
        t["model.layers.0.block_sparse_moe.experts.8.w1.weight"] = t[
            "model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()
    _edit_tensors(folder, add_expert)
    with pytest.raises(ModelLoadError, match="expert 8 out of range"):
        load_model(folder)


def test_shape_mismatch_is_named(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints("llama").path, tmp_path / "m")

    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:10].clone()
    _edit_tensors(folder, shrink)
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*shape"):
        load_model(folder)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                                  {"rope_type": "longrope", "rope_theta": 10000.0}])
def test_unsupported_rope_type(checkpoints, tmp_path, rope):
    folder = copy_checkpoint(checkpoints("llama").path, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = rope
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=rope["rope_type"]):
        load_model(folder)


def test_unknown_moe_backend(checkpoints):
    with pytest.raises(ValueError, match="resident"):
        load_model(checkpoints("mixtral").path, moe_backend="bogus")


def test_qwen_moe_config_errors(checkpoints, tmp_path):
    src = checkpoints("qwen3_moe").path
    with pytest.raises(ModelLoadError, match="decoder_sparse_step must be >= 1"):
        load_model(copy_config(src, tmp_path / "step0", decoder_sparse_step=0))
    with pytest.raises(ModelLoadError, match=r"layers \[0\] are dense .* intermediate_size is 0"):
        load_model(copy_config(src, tmp_path / "nodense", intermediate_size=0))
    with pytest.raises(ModelLoadError, match="num_experts >= num_experts_per_tok"):
        load_model(copy_config(src, tmp_path / "topk", num_experts_per_tok=9))


def test_dense_layer_of_a_mixed_moe_checkpoint_cannot_hold_experts(checkpoints, tmp_path):
    """Layer 0 of the qwen3_moe case is dense (mlp_only_layers): routed-expert tensors there have no place."""
    folder = copy_checkpoint(checkpoints("qwen3_moe").path, tmp_path / "m")

    def add(t):
        t["model.layers.0.mlp.experts.0.gate_proj.weight"] = t["model.layers.1.mlp.experts.0.gate_proj.weight"].clone()

    _edit_tensors(folder, add)
    with pytest.raises(ModelLoadError, match="layer 0 has no routed experts"):
        load_model(folder)
