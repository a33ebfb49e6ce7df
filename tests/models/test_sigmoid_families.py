"""GLM-4.5 (Glm4MoeForCausalLM) and MiniMax-M2 (MiniMaxM2ForCausalLM) against transformers' own implementation
(5.x) on tiny random checkpoints written by ``save_pretrained``: float32 logits within 1e-4, greedy tokens equal to
transformers' ``generate``, on the resident backend and the offloading ones (offload, cpu, hybrid) on the CPU;
plus the config forms the published checkpoints use, their multi-token-prediction tensors, float32 routing biases
and the typed errors for bad routing / rotary fields."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.experts.helpers import greedy_trace, options
from tests.models.hf_checkpoints import copy_config, hf_greedy, reference_logits, token_ids
from tests.models.test_parity import full_logits

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.models.reference_attention import SequenceCacheAttention
from ferrylm.checkpoints.loader import load_model
from ferrylm.models.sigmoid_moe import SigmoidMoeBlock, SigmoidRouting, sigmoid_topk

TOL = 1e-4
NEW_TOKENS = 12
CASES = ["glm4_moe", "glm4_moe_air", "minimax_m2"]


@pytest.mark.parametrize("case", CASES)
def test_logits_and_chunked_decode_match_transformers(checkpoints, case):
    ckpt = checkpoints(case)
    model = load_model(ckpt.path).model
    ids = token_ids(30, ckpt.vocab_size, seed=11)
    ref = reference_logits(ckpt, ids)
    assert (full_logits(model, ids) - ref).abs().max().item() <= TOL
    cache, pieces = SequenceCacheAttention(), []
    with torch.no_grad():
        for lo, hi in [(0, 9), (9, 14)] + [(t, t + 1) for t in range(14, 30)]:
            pieces.append(model.compute_logits(model(ids[lo:hi], torch.arange(lo, hi), cache)))
    assert (torch.cat(pieces) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", ["resident", "offload", "cpu", "hybrid"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers_generate(checkpoints, case, backend):
    """A cache smaller than one token's experts (top_k - 1 slots) for the offloading backends: waves, eviction."""
    ckpt = checkpoints(case)
    k = int(json.loads((ckpt.path / "config.json").read_text())["num_experts_per_tok"])
    moe = "resident" if backend == "resident" else options(backend, max(1, k - 1), stream_prefill=False)
    loaded = load_model(ckpt.path, moe_backend=moe)
    prompt = token_ids(13, ckpt.vocab_size, seed=5).tolist()
    tokens, logits = greedy_trace(loaded.model, prompt, NEW_TOKENS)
    assert tokens == hf_greedy(ckpt.reference, prompt, NEW_TOKENS), f"{case}/{backend}"
    ref = reference_logits(ckpt, torch.tensor(prompt + tokens))[len(prompt) - 1:-1]
    assert (torch.stack(logits) - ref).abs().max().item() <= TOL
    if backend != "resident":
        assert loaded.executor.stats().totals.needed > 0
        loaded.executor.close()


def test_layers_follow_the_config(checkpoints):
    """first_k_dense_replace = 1: layer 0 dense, 1-2 sigmoid-routed with a shared expert; MiniMax-M2 all MoE, no
    shared expert; the routing bias is the checkpoint's (not zeros)."""
    glm = load_model(checkpoints("glm4_moe").path)
    assert sorted(glm.executor.layers) == [1, 2]
    layers = glm.model.model.layers
    assert not isinstance(layers[0].mlp, SigmoidMoeBlock)
    assert all(isinstance(layer.mlp, SigmoidMoeBlock) and layer.mlp.shared_experts is not None
               for layer in layers[1:])
    assert layers[1].mlp.rule == SigmoidRouting(top_k=3, n_group=4, topk_group=2, renormalize=True, scale=2.5,
                                                eps=1e-20)
    mm = load_model(checkpoints("minimax_m2").path)
    assert sorted(mm.executor.layers) == [0, 1]
    for layer in mm.model.model.layers:
        assert layer.mlp.shared_experts is None
        assert layer.mlp.gate.e_score_correction_bias.abs().sum() > 0
        assert layer.self_attn.qk_norm == "proj"
    assert mm.model.model.rotary.rotary_dim == 16 and mm.model.model.rotary.head_dim == 32


def test_the_routing_bias_changes_the_output(checkpoints):
    """Zeroing e_score_correction_bias moves the logits away from transformers' (the bias is really used)."""
    ckpt = checkpoints("glm4_moe")
    model = load_model(ckpt.path).model
    ids = token_ids(24, ckpt.vocab_size, seed=2)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.data.zero_()
    assert (full_logits(model, ids) - reference_logits(ckpt, ids)).abs().max().item() > 1e-2


def test_published_config_form_loads(checkpoints, tmp_path):
    """The published config.json keeps rope_theta / partial_rotary_factor at the top level (transformers 4.5x);
    the extra multi-token-prediction layer (model.layers.<num_hidden_layers>.*) is skipped."""
    ckpt = checkpoints("glm4_moe")
    cfg = json.loads((ckpt.path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    dst = copy_config(ckpt.path, tmp_path / "published")
    cfg.update(rope_theta=rope["rope_theta"], partial_rotary_factor=0.5, rope_scaling=None,
               num_nextn_predict_layers=1)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(ckpt.path / "model.safetensors"))
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, str(dst / "model.safetensors"))
    ids = token_ids(20, ckpt.vocab_size, seed=4)
    got = full_logits(load_model(dst).model, ids)
    assert (got - reference_logits(ckpt, ids)).abs().max().item() <= TOL


def test_bfloat16_load_keeps_routing_bias_in_float32(checkpoints):
    ckpt = checkpoints("minimax_m2")
    loaded = load_model(ckpt.path, dtype=torch.bfloat16)
    gate = loaded.model.model.layers[0].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and gate.e_score_correction_bias.dtype == torch.float32
    ids = token_ids(16, ckpt.vocab_size)
    assert (full_logits(loaded.model, ids) - reference_logits(ckpt, ids)).abs().max().item() < 0.25


def test_group_limited_topk_only_picks_from_the_best_groups():
    """4 groups of 2; group scores are the sums of their two best s + b; only the best 2 groups may be chosen."""
    logits = torch.tensor([[4.0, 4.0, -4.0, -4.0, 3.0, -9.0, 0.0, 0.5]])
    bias = torch.zeros(8)
    ids, w = sigmoid_topk(logits, bias, SigmoidRouting(top_k=3, n_group=4, topk_group=2, renormalize=False))
    assert sorted(ids[0].tolist()) == [0, 1, 7]  # expert 4 (score 3) sits in a weak group (3 with -9)
    torch.testing.assert_close(w[0], torch.sigmoid(logits[0, ids[0]]))
    # the bias picks (expert 6 lifted above 0 and 1), the plain sigmoid weighs, renormalised to 1
    ids, w = sigmoid_topk(logits, torch.tensor([0, -0.1, 0, 0, 0, 0, 1.0, 0]), SigmoidRouting(top_k=2))
    assert ids[0].tolist() == [6, 0]
    s = torch.sigmoid(torch.tensor([0.0, 4.0]))
    torch.testing.assert_close(w[0], s / s.sum())


def _config(arch: str, **raw) -> ModelConfig:
    base = dict(architectures=[arch], hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                num_hidden_layers=2, vocab_size=100, intermediate_size=48, moe_intermediate_size=16,
                n_routed_experts=8, num_local_experts=8, num_experts_per_tok=2)
    return ModelConfig.from_dict({**base, **raw})


@pytest.mark.parametrize("arch,raw,field", [
    ("Glm4MoeForCausalLM", {"n_group": 3}, "n_group"),
    ("Glm4MoeForCausalLM", {"n_group": 2, "topk_group": 3}, "topk_group"),
    ("Glm4MoeForCausalLM", {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ("Glm4MoeForCausalLM", {"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ("Glm4MoeForCausalLM", {"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
    ("MiniMaxM2ForCausalLM", {"rotary_dim": 48}, "rotary_dim"),
    ("MiniMaxM2ForCausalLM", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("MiniMaxM2ForCausalLM", {"scoring_func": "softmax"}, "scoring_func"),
    ("MiniMaxM2ForCausalLM", {"use_routing_bias": False}, "use_routing_bias"),
    ("MiniMaxM2ForCausalLM", {"shared_intermediate_size": 512}, "shared_intermediate_size"),
    ("LlamaForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_bad_configs_raise_model_load_error_naming_the_field(arch, raw, field):
    from ferrylm.models.registry import get_model_class

    config = _config(arch, **raw)
    with pytest.raises(ModelLoadError, match=field):
        get_model_class(arch).check_config(config)


def test_ferry_models_lists_the_families():
    from ferrylm.checkpoints.catalog import ARCHITECTURE_NOTES, describe_models
    from ferrylm.models.registry import supported_architectures

    assert set(ARCHITECTURE_NOTES) == set(supported_architectures())
    text = describe_models()
    assert "Glm4MoeForCausalLM" in text and "GLM-4.5-Air" in text and "tools: glm45" in text
    assert "MiniMaxM2ForCausalLM" in text and "tools: minimax_m2" in text
    assert "synthetic:glm-4.5-air" in text or "glm-4.5-air" in text
    assert "tools: hermes" in text  # Qwen and the others


@pytest.mark.parametrize("case", ["minimax_m2", "glm4_moe"])
def test_fp8_block_checkpoint_matches_transformers(checkpoints, tmp_path, case):
    """FP8 e4m3 with 128x128-style block scales (16x16 here; MiniMax-M2 ships its weights so), quantized by
    transformers' own FP8 quantizer; reference: transformers loading the FP8 folder (it dequantizes on a machine
    without a GPU). The offloading backend moves the quantized bytes and gives the resident greedy tokens."""
    import transformers
    from tests.models.quant_checkpoints import fp8_quantizer, write_quantized

    ckpt = checkpoints(case)
    qcfg, quantize = fp8_quantizer((16, 16))
    qdir = write_quantized(ckpt.path, tmp_path / "fp8", qcfg, quantize)
    ref = transformers.AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32).eval()
    ids = token_ids(24, ckpt.vocab_size, seed=2)
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0].float()
    loaded = load_model(qdir)
    assert (full_logits(loaded.model, ids) - want).abs().max().item() <= TOL
    assert (want - reference_logits(ckpt, ids)).abs().max().item() > 1e-2  # really quantized
    prompt = token_ids(10, ckpt.vocab_size, seed=7).tolist()
    k = int(json.loads((ckpt.path / "config.json").read_text())["num_experts_per_tok"])
    offload = load_model(qdir, moe_backend=options("offload", max(1, k - 1)))
    assert greedy_trace(offload.model, prompt, 6)[0] == greedy_trace(loaded.model, prompt, 6)[0]
    offload.executor.close()
