"""NVIDIA ModelOpt checkpoints (``quant_method: modelopt`` / ``hf_quant_config.json``), NVFP4 and FP8, through the
real reader (tests/models/modelopt_checkpoints.py says who writes them):

- written by nvidia-modelopt's own ``mtq.quantize`` + ``export_hf_checkpoint`` and dequantized by its own
  ``NVFP4QTensor`` / ``FP8QTensor``, when the package imports (it runs on a CPU: ``pip install nvidia-modelopt``);
  skipped otherwise;
- written by our packer of ModelOpt's documented layout and dequantized by the documented formula: always (and
  the malformed files).

Checks (``check_format``): the repacked experts dequantize to the reference's values bit for bit, our logits are
within 1e-4 of transformers' model on the reference-dequantized weights, every expert backend agrees.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tests.models.modelopt_checkpoints import (block_checkpoint, layout_export, modelopt_available, modelopt_dequant,
                                               modelopt_export)
from tests.models.test_quant_formats import check_format

from ferrylm.errors import ModelLoadError
from ferrylm.checkpoints.loader import load_model

needs_modelopt = pytest.mark.skipif(not modelopt_available(),
                                    reason="nvidia-modelopt is not installed (it installs and runs on a CPU)")
EXPERT = "model.layers.1.mlp.experts.2.up_proj"


@needs_modelopt
@pytest.mark.parametrize("recipe,algo", [
    ("NVFP4_DEFAULT_CFG", "NVFP4"),
    ("NVFP4_EXPERTS_ONLY_CFG", "NVFP4"),  # attention and dense layers left in the model dtype
    ("W4A16_NVFP4_CFG", "W4A16_NVFP4"),  # weight-only: no input_scale
    ("FP8_DEFAULT_CFG", "FP8"),  # with the FP8 KV-cache quantizers: k_scale / v_scale, skipped
    ("FP8_PER_CHANNEL_PER_TOKEN_CFG", "FP8_PER_CHANNEL_PER_TOKEN"),  # weight_scale [N]
], ids=["nvfp4", "nvfp4-experts-only", "w4a16-nvfp4", "fp8-kv", "fp8-per-channel"])
def test_modelopt_export(checkpoints, tmp_path, recipe, algo):
    """ModelOpt's exporter writes it, ModelOpt's qtensors dequantize it; for the two default recipes our
    documented-layout packer writes the same tensor names, dtypes and shapes."""
    ckpt = checkpoints("qwen3_moe")
    qdir = modelopt_export(ckpt.path, tmp_path / "modelopt", recipe, kv_cache=recipe == "FP8_DEFAULT_CFG",
                           vocab_size=ckpt.vocab_size)
    qcfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert (qcfg["quant_method"], qcfg["quant_algo"]) == ("modelopt", algo)
    assert json.loads((qdir / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == algo
    exported = load_file(str(qdir / "model.safetensors"))
    assert exported[EXPERT + ".weight"].dtype == (torch.uint8 if "NVFP4" in algo else torch.float8_e4m3fn)
    if recipe == "FP8_DEFAULT_CFG":
        assert any(n.endswith(".k_scale") for n in exported)
    if recipe in ("NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"):
        ours = load_file(str(layout_export(ckpt.path, tmp_path / "layout", algo)[0] / "model.safetensors"))
        kept = {n: (t.dtype, tuple(t.shape)) for n, t in exported.items() if not n.endswith((".k_scale", ".v_scale"))}
        assert kept == {n: (t.dtype, tuple(t.shape)) for n, t in ours.items()}
    check_format(ckpt, qdir, modelopt_dequant(qdir), tmp_path)


@needs_modelopt
@pytest.mark.parametrize("recipe", ["NVFP4_EXPERTS_ONLY_CFG", "NVFP4_DEFAULT_CFG"],
                         ids=["experts-only-fp8-kv", "all-linears"])
def test_modelopt_nvfp4_minimax_m2(checkpoints, tmp_path, recipe):
    """MiniMax-M2 / M2.5 exported by ModelOpt in NVFP4. nvidia/MiniMax-M2.5-NVFP4's recipe (``nvfp4_experts_only``
    with an FP8 KV cache): only the experts in NVFP4, under their published names ``block_sparse_moe.experts.E.w1 /
    w2 / w3`` (uint8 codes, fp8 scales per 16 inputs, a float32 ``weight_scale_2``, an ``input_scale``), attention
    (``self_attn*``), router ``gate`` and ``lm_head`` excluded, ``k_proj.k_scale`` / ``v_proj.v_scale`` beside the
    attention; ModelOpt's default recipe also puts the attention in NVFP4. Experts equal ModelOpt's
    dequantization bit for bit, logits within 1e-4 of transformers' MiniMaxM2 on those weights, greedy tokens
    equal on every backend."""
    ckpt = checkpoints("minimax_m2")
    experts_only = recipe == "NVFP4_EXPERTS_ONLY_CFG"
    qdir = modelopt_export(ckpt.path, tmp_path / "modelopt", recipe, kv_cache=experts_only,
                           vocab_size=ckpt.vocab_size)
    quant = json.loads((qdir / "hf_quant_config.json").read_text())["quantization"]
    assert (quant["quant_algo"], quant["group_size"]) == ("NVFP4", 16)
    excluded = {"lm_head", "model.layers.0.block_sparse_moe.gate"} | ({"model.layers.0.self_attn*"} if experts_only
                                                                      else set())
    assert excluded <= set(quant["exclude_modules"])
    sd = load_file(str(qdir / "model.safetensors"))
    w1 = "model.layers.1.block_sparse_moe.experts.3.w1"
    h, i = ckpt.reference.config.hidden_size, ckpt.reference.config.intermediate_size
    assert [(sd[w1 + s].dtype, tuple(sd[w1 + s].shape)) for s in (".weight", ".weight_scale", ".weight_scale_2",
                                                                   ".input_scale")] == [
        (torch.uint8, (i, h // 2)), (torch.float8_e4m3fn, (i, h // 16)), (torch.float32, ()), (torch.float32, ())]
    assert sd["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32
    assert sd["model.layers.1.self_attn.q_proj.weight"].dtype == (torch.float32 if experts_only else torch.uint8)
    assert ("model.layers.1.self_attn.k_proj.k_scale" in sd) == experts_only
    fmt = load_model(qdir).executor.layers[1].down.fmt
    assert (fmt.kind, fmt.group, fmt.row_scale) == ("fp4", 16, True)
    check_format(ckpt, qdir, modelopt_dequant(qdir), tmp_path)


@needs_modelopt
def test_synthetic_minimax_m2_5_nvfp4_experts_are_modelopt_nvfp4():
    """``synthetic:minimax-m2.5:quant=nvfp4``'s routed experts at the published shapes (w1 / w3 [1536, 3072], w2
    [3072, 1536]) are ModelOpt NVFP4 export tensors: codes as ``weight``, block scales as ``weight_scale``, one
    per-tensor scale as ``weight_scale_2``. ModelOpt's NVFP4QTensor dequantizes them to our values bit for bit, and
    our ModelOpt reader reads them back to the same bytes."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from ferrylm.checkpoints.quant.modelopt import ModelOptReader
    from ferrylm.synthetic.quant import SYNTHETIC_FORMATS, CodePool, random_stack
    from ferrylm.synthetic.presets import PRESETS

    c = PRESETS["minimax-m2.5"].config
    h, i = c["hidden_size"], c["intermediate_size"]
    reader = ModelOptReader({"quant_algo": "NVFP4", "group_size": 16})
    fmts = SYNTHETIC_FORMATS["nvfp4"]
    for proj, fmt, n, k in (("w1", fmts.gate_up, i, h), ("w2", fmts.down, h, i)):
        stack = random_stack(CodePool(0), fmt, 2, n, k, k ** -0.5, proj, device="cpu", dtype=torch.float32)
        for e in range(2):
            ours = stack[e]
            assert torch.unique(ours.row_scale).numel() == 1  # one per-tensor scale, as ModelOpt stores it
            parts = {".weight": ours.data, ".weight_scale": ours.scales,
                     ".weight_scale_2": ours.row_scale[:1].reshape(()), ".input_scale": torch.tensor(1.0)}
            oracle = NVFP4QTensor(torch.Size((n, k)), torch.float32, parts[".weight"]).dequantize(
                dtype=torch.float32, scale=parts[".weight_scale"], block_sizes={-1: 16},
                double_scale=parts[".weight_scale_2"])
            assert torch.equal(ours.dequantize(torch.float32), oracle), (proj, e)
            read = reader.decode(f"model.layers.0.block_sparse_moe.experts.{e}.{proj}", parts, torch.float32)
            assert read.fmt == fmt and torch.equal(read.data, ours.data) and torch.equal(read.row_scale, ours.row_scale)
            assert torch.equal(read.scales.view(torch.uint8), ours.scales.view(torch.uint8))


@needs_modelopt
def test_modelopt_export_fp8_128x128_blocks(tmp_path):
    """FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG (quant_algo fp8_pb_wo) on a model of 128-multiples: block scales stored as
    [N/128, 1, K/128, 1]."""
    ckpt = block_checkpoint(tmp_path / "src")
    qdir = modelopt_export(ckpt.path, tmp_path / "modelopt", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",
                           vocab_size=ckpt.vocab_size)
    assert json.loads((qdir / "config.json").read_text())["quantization_config"]["quant_algo"] == "fp8_pb_wo"
    scale = load_file(str(qdir / "model.safetensors"))["model.layers.1.mlp.experts.2.down_proj.weight_scale"]
    assert tuple(scale.shape) == (2, 1, 3, 1)
    fmt = load_model(qdir).executor.layers[1].down.fmt
    assert (fmt.kind, fmt.group) == ("fp8", 128)
    check_format(ckpt, qdir, modelopt_dequant(qdir), tmp_path)


@pytest.mark.parametrize("algo", ["NVFP4", "FP8"])
def test_modelopt_layout(checkpoints, tmp_path, algo):
    """The documented layout with hf_quant_config.json only (config.json without quantization_config)."""
    ckpt = checkpoints("qwen3_moe")
    qdir, reference = layout_export(ckpt.path, tmp_path / "layout", algo)
    assert "quantization_config" not in json.loads((qdir / "config.json").read_text())
    loaded = load_model(qdir)
    fmt = loaded.executor.layers[1].up.fmt
    assert (fmt.kind, fmt.group) == (("fp4", 16) if algo == "NVFP4" else ("fp8", 64))
    check_format(ckpt, qdir, reference, tmp_path)


# --- malformed files ------------------------------------------------------------------------------------------
def _broken(checkpoints, tmp_path, algo, change):
    ckpt = checkpoints("qwen3_moe")

    def mutate(prefix, parts):
        return change(dict(parts)) if prefix == EXPERT else parts

    return layout_export(ckpt.path, tmp_path / "broken", algo, mutate)[0]


def test_missing_weight_scale_2_names_tensor_and_format(checkpoints, tmp_path):
    qdir = _broken(checkpoints, tmp_path, "NVFP4", lambda p: {k: v for k, v in p.items() if k != "weight_scale_2"})
    with pytest.raises(ModelLoadError, match=r"ModelOpt NVFP4.*lacks its tensor "
                                             r"'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight_scale_2'"):
        load_model(qdir)


def test_wrong_block_scale_shape_names_tensor_and_format(checkpoints, tmp_path):
    def cut(p):
        p["weight_scale"] = p["weight_scale"][:, :-1]
        return p

    qdir = _broken(checkpoints, tmp_path, "NVFP4", cut)
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj\.weight_scale'.*shape \[48, 3\] does not match "
                                             r"its ModelOpt NVFP4 weight \[48, 64\] in groups of 16"):
        load_model(qdir)


def test_weight_scale_2_of_many_values(checkpoints, tmp_path):
    def widen(p):
        p["weight_scale_2"] = p["weight_scale_2"].repeat(2)
        return p

    qdir = _broken(checkpoints, tmp_path, "NVFP4", widen)
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj\.weight_scale_2' \(ModelOpt NVFP4 per-tensor "
                                             r"scale\): 2 values"):
        load_model(qdir)


def test_fp8_per_tensor_scale_of_many_values(checkpoints, tmp_path):
    def widen(p):
        p["weight_scale"] = p["weight_scale"].repeat(3)
        return p

    qdir = _broken(checkpoints, tmp_path, "FP8", widen)
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj\.weight_scale' \(ModelOpt FP8 per-tensor "
                                             r"scale\): 3 values"):
        load_model(qdir)


def test_fp8_weight_of_the_wrong_dtype(checkpoints, tmp_path):
    def widen(p):
        p["weight"] = p["weight"].float()
        return p

    qdir = _broken(checkpoints, tmp_path, "FP8", widen)
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj\.weight' \(ModelOpt FP8\) has dtype "
                                             r"torch\.float32; expected torch\.float8_e4m3fn"):
        load_model(qdir)


@pytest.mark.parametrize("algo", ["W4A16_AWQ", "MIXED_PRECISION"])
def test_unsupported_quant_algo(checkpoints, tmp_path, algo):
    qdir, _ = layout_export(checkpoints("qwen3_moe").path, tmp_path / "q", "FP8")
    hf = json.loads((qdir / "hf_quant_config.json").read_text())
    hf["quantization"]["quant_algo"] = algo
    (qdir / "hf_quant_config.json").write_text(json.dumps(hf))
    with pytest.raises(ModelLoadError, match=rf"ModelOpt quant_algo '{algo}' is not supported; supported: NVFP4, "
                                             rf"W4A16_NVFP4, FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO"):
        load_model(qdir)


def test_config_json_modelopt_without_quant_algo(checkpoints, tmp_path):
    """config.json says modelopt, names no quant_algo, and there is no hf_quant_config.json."""
    qdir, _ = layout_export(checkpoints("qwen3_moe").path, tmp_path / "q", "FP8")
    (qdir / "hf_quant_config.json").unlink()
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt"}
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"ModelOpt quantization_config .*has no quant_algo"):
        load_model(qdir)


def test_hf_quant_config_fills_a_modelopt_quantization_config(checkpoints, tmp_path):
    """config.json's quantization_config (quant_method modelopt, no quant_algo) + hf_quant_config.json: merged."""
    from ferrylm.config import ModelConfig

    qdir, _ = layout_export(checkpoints("qwen3_moe").path, tmp_path / "q", "NVFP4")
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "ignore": ["lm_head"]}
    (qdir / "config.json").write_text(json.dumps(cfg))
    q = ModelConfig.from_folder(qdir).raw["quantization_config"]
    assert (q["quant_method"], q["quant_algo"], q["group_size"], q["ignore"]) == ("modelopt", "NVFP4", 16,
                                                                                    ["lm_head"])


@pytest.mark.parametrize("algo", ["NVFP4", "FP8"])
def test_planned_quant_matches_the_loaded(checkpoints, tmp_path, algo):
    """`--moe-backend auto` sizes experts from the config before loading (hf_quant_config.json included); FP8 per
    tensor has group K: H for gate / up, I for down."""
    from ferrylm.config import ModelConfig
    from ferrylm.checkpoints.quant import planned_expert_quant

    qdir, _ = layout_export(checkpoints("qwen3_moe").path, tmp_path / "q", algo)
    planned = planned_expert_quant(ModelConfig.from_folder(qdir).raw)
    le = load_model(qdir).executor.layers[1]
    assert (planned.gate_up, planned.down) == (le.gate.fmt, le.down.fmt)


def test_ferry_models_lists_the_formats():
    from ferrylm.checkpoints.catalog import CHECKPOINT_FORMATS, describe_models
    from ferrylm.checkpoints.quant import SUPPORTED_METHODS

    text = describe_models()
    assert "modelopt NVFP4" in text and "modelopt FP8" in text and "compressed-tensors float-quantized" in text
    for method in SUPPORTED_METHODS:
        assert method == "ferrylm" or any(line.startswith(method) for line in CHECKPOINT_FORMATS), method


def test_hf_quant_config_without_quantization_names_the_file(checkpoints, tmp_path):
    qdir, _ = layout_export(checkpoints("qwen3_moe").path, tmp_path / "q", "FP8")
    (qdir / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}}))
    with pytest.raises(ModelLoadError, match=r"hf_quant_config\.json has no 'quantization' object"):
        load_model(qdir)


def test_hf_quant_config_beside_another_method_is_not_read(tmp_path):
    from ferrylm.config import _with_hf_quant_config

    (tmp_path / "hf_quant_config.json").write_text("not json")
    d = {"quantization_config": {"quant_method": "compressed-tensors"}}
    assert _with_hf_quant_config(d, tmp_path) is d


def test_non_finite_weight_scale_2_names_tensor(checkpoints, tmp_path):
    def inf(p):
        p["weight_scale_2"] = torch.tensor(float("inf"))
        return p

    qdir = _broken(checkpoints, tmp_path, "NVFP4", inf)
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj\.weight_scale_2' \(ModelOpt NVFP4 per-tensor "
                                             r"scale\) is inf; expected a finite value"):
        load_model(qdir)
