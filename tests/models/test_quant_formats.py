"""Quantized checkpoints, one format at a time (tests/models/quant_checkpoints.py says who wrote each):

1. the experts ferrylm repacked dequantize to the reference dequantizer's values (float32: bit for bit, NVFP4 to
   float32 rounding of its global scale);
2. our model's logits match transformers' model on the reference-dequantized weights;
3. every expert backend (resident, offload, cpu, hybrid; a cache smaller than a layer's needs) gives the same greedy
   tokens and logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from tests.experts.helpers import assert_backend_close, greedy_trace, options
from tests.models.hf_checkpoints import token_ids
from tests.models.quant_checkpoints import (act_order_g_idx, autoawq_modules, awq_pack, awq_reference_dequant,
                                             ct_quantizer,
                                             dense_reference, fp8_quantizer, gptq_pack, gptq_reference_dequant,
                                             is_expert, is_quantized_linear, mxfp4_blocks_pack, write_quantized)
from tests.models.test_parity import full_logits
from safetensors.torch import load_file

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import QuantTensor
from ferrylm.checkpoints.loader import load_model
from ferrylm.checkpoints.quant import planned_expert_quant

LOGIT_TOL = 1e-4
BACKENDS = ("offload", "cpu", "hybrid")


def _expert_names(sd: dict) -> list[str]:
    return [n for n, t in sd.items() if is_quantized_linear(n, t) and is_expert(n)]


def _our_expert(loaded, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized ``[N, K]`` (in ``dtype``) of checkpoint expert weight ``name`` from our loaded (resident)
    model."""
    parts = name.split(".")
    layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
    le = loaded.executor.layers[layer]
    qt = {"gate_proj": le.gate, "w1": le.gate, "up_proj": le.up, "w3": le.up}.get(proj, le.down)
    assert isinstance(qt, QuantTensor)
    return qt[e].dequantize(dtype)


def check_format(ckpt, qdir, reference: dict[str, torch.Tensor], tmp_path, *, exact: bool = True) -> dict:
    """The three checks of the module docstring (``reference``: checkpoint weight name -> the reference's
    dequantized weight, in the reference's dtype); returns the measured maxima."""
    loaded = load_model(qdir)
    src = load_file(str(ckpt.path / "model.safetensors"))
    worst = 0.0
    for name in _expert_names(src):
        ref = reference[name]
        ours = _our_expert(loaded, name, ref.dtype)  # compared in the reference's dtype (one rounding each)
        if exact:
            assert torch.equal(ours, ref), f"{name}: dequantized experts differ from the reference"
        else:
            assert torch.allclose(ours, ref, rtol=2.0 ** -22, atol=0), f"{name}: beyond float32 rounding"
        worst = max(worst, (ours.float() - ref.float()).abs().max().item())
    ids = token_ids(24, ckpt.vocab_size, seed=2)
    ref_model = dense_reference(ckpt.path, tmp_path / "dequantized", reference)
    with torch.no_grad():
        ref_logits = ref_model(input_ids=ids[None]).logits[0].float()
    ours = full_logits(loaded.model, ids)
    logit_err = (ours - ref_logits).abs().max().item()
    assert logit_err <= LOGIT_TOL, f"logits differ from the reference model by {logit_err:.2e}"
    prompt = token_ids(10, ckpt.vocab_size, seed=7).tolist()
    want = greedy_trace(loaded.model, prompt, 5)
    k = json.loads((ckpt.path / "config.json").read_text())["num_experts_per_tok"]
    for backend in BACKENDS:
        got = greedy_trace(load_model(qdir, moe_backend=options(backend, max(1, k - 1))).model, prompt, 5)
        assert got[0] == want[0], f"{backend}: greedy tokens differ from resident"
        for step, (a, b) in enumerate(zip(got[1], want[1])):
            if backend in ("cpu", "hybrid"):  # native kernels read 8-bit activations (tests/experts/helpers.py)
                assert_backend_close(backend, a, b, step)
            else:
                assert (a - b).abs().max().item() <= 1e-4, (backend, step)
    print(f"{qdir.name}: expert max |ours - reference| {worst:.3g}, logits max |ours - reference| {logit_err:.3g}")
    return {"expert_max_abs_err": worst, "logit_max_abs_err": logit_err}


def test_fp8_block(checkpoints, tmp_path):
    """FP8 128x128-style blocks (16x16 here), quantized by transformers; reference: transformers' own loading,
    which dequantizes FP8 on a machine without a GPU."""
    import transformers

    ckpt = checkpoints("qwen3_moe")
    qcfg, quantize = fp8_quantizer((16, 16))
    qdir = write_quantized(ckpt.path, tmp_path / "fp8", qcfg, quantize)
    assert json.loads((qdir / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    ref = transformers.AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32)
    sd = load_file(str(qdir / "model.safetensors"))
    reference = {}
    for name in _expert_names(load_file(str(ckpt.path / "model.safetensors"))):
        layer, e, proj = int(name.split(".")[2]), int(name.split(".")[5]), name.split(".")[6]
        experts = ref.model.layers[layer].mlp.experts
        i = experts.down_proj.shape[-1]
        gu = experts.gate_up_proj[e]
        reference[name] = {"gate_proj": gu[:i], "up_proj": gu[i:], "down_proj": experts.down_proj[e]}[proj]
    for name, t in sd.items():  # attention weights: DeepSeek's formula on the stored tensors
        if name.endswith("_scale_inv") and not is_expert(name):
            w = sd[name.replace("_scale_inv", "")]
            full = t.repeat_interleave(16, 0).repeat_interleave(16, 1)[:w.shape[0], :w.shape[1]]
            reference[name.replace("_scale_inv", "")] = w.float() * full
    check_format(ckpt, qdir, reference, tmp_path)


@pytest.mark.parametrize("kind,kw,exact", [
    ("int", {"group": 16}, True),
    ("int", {"group": 16, "symmetric": False}, True),
    ("int", {"group": None, "bits": 8}, True),
    ("nvfp4", {}, False),
    ("fp8", {"strategy": "tensor"}, True),
    ("fp8", {"strategy": "channel"}, True),
    ("fp8", {"strategy": "block", "block": (16, 16)}, True),
    ("fp8", {"strategy": "group", "group": 16}, True),
], ids=["w4a16-sym", "w4a16-asym", "w8a16-channel", "nvfp4", "fp8-tensor", "fp8-channel", "fp8-block",
        "fp8-group"])
def test_compressed_tensors(checkpoints, tmp_path, kind, kw, exact):
    """compressed-tensors pack-quantized int (symmetric, zero points, 8-bit per channel), NVFP4 and
    float-quantized FP8 (per tensor, per channel, 16x16 blocks, groups of 16; dynamic input activations, as the
    ``*-FP8-dynamic`` checkpoints), written and dequantized by the compressed-tensors package itself."""
    ckpt = checkpoints("qwen3_moe")
    qcfg, quantize, decompress = ct_quantizer(kind, **kw)
    qdir = write_quantized(ckpt.path, tmp_path / "ct", qcfg, quantize)
    sd = load_file(str(qdir / "model.safetensors"))
    planned = planned_expert_quant(ModelConfig.from_folder(qdir).raw)  # what `--moe-backend auto` plans is what loads
    le = load_model(qdir).executor.layers[1]
    assert (planned.gate_up, planned.down) == (le.gate.fmt, le.down.fmt)
    marker = ".weight_scale" if kind == "fp8" else ".weight_packed"
    reference = {p[:-len(marker)] + ".weight": decompress(p[:-len(marker)], sd) for p in sd if p.endswith(marker)}
    assert reference
    check_format(ckpt, qdir, reference, tmp_path, exact=exact)


def test_compressed_tensors_mxfp4(checkpoints, tmp_path):
    ckpt = checkpoints("mixtral")  # K = 64 and 96: multiples of the MX block of 32
    qcfg, quantize, decompress = ct_quantizer("mxfp4")
    qdir = write_quantized(ckpt.path, tmp_path / "ct", qcfg, quantize)
    sd = load_file(str(qdir / "model.safetensors"))
    reference = {p[:-len(".weight_packed")] + ".weight": decompress(p[:-len(".weight_packed")], sd)
                 for p in sd if p.endswith(".weight_packed")}
    check_format(ckpt, qdir, reference, tmp_path)


@pytest.mark.parametrize("v2", [False, True], ids=["gptq", "gptq_v2"])
def test_gptq(checkpoints, tmp_path, v2):
    ckpt = checkpoints("qwen3_moe")
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": False,
            "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    packed: dict[str, dict] = {}

    def quantize(name, w):
        prefix = name[:-len(".weight")]
        packed[name] = gptq_pack(w, 16, v2=v2)
        return {f"{prefix}.{k}": v for k, v in packed[name].items()}

    qdir = write_quantized(ckpt.path, tmp_path / "gptq", qcfg, quantize)
    reference = {name: gptq_reference_dequant(p, v2=v2) for name, p in packed.items()}
    check_format(ckpt, qdir, reference, tmp_path)


def test_gptq_act_order_dense_model(checkpoints, tmp_path):
    """desc_act GPTQ (scattered groups, ``g_idx``) on a dense model: every linear dequantized through ``g_idx``;
    logits against transformers' model on the reference dequantization (AutoGPTQ's formula)."""
    ckpt = checkpoints("llama")
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False}
    packed: dict[str, dict] = {}

    def quantize(name, w):
        packed[name] = gptq_pack(w, 16, g_idx=act_order_g_idx(w.shape[1], 16, seed=len(packed)))
        return {f"{name[:-len('.weight')]}.{k}": v for k, v in packed[name].items()}

    qdir = write_quantized(ckpt.path, tmp_path / "gptq", qcfg, quantize)
    assert any(not torch.equal(p["g_idx"].long(), torch.arange(p["g_idx"].numel()) // 16) for p in packed.values())
    reference = {name: gptq_reference_dequant(p) for name, p in packed.items()}
    loaded = load_model(qdir)
    ids = token_ids(24, ckpt.vocab_size, seed=2)
    with torch.no_grad():
        want = dense_reference(ckpt.path, tmp_path / "dequantized", reference)(input_ids=ids[None]).logits[0]
    err = (full_logits(loaded.model, ids) - want.float()).abs().max().item()
    assert err <= LOGIT_TOL, f"logits differ from the reference model by {err:.2e}"


def test_gptq_act_order_experts_refused_with_the_reason(checkpoints, tmp_path):
    ckpt = checkpoints("qwen3_moe")
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False}
    qdir = write_quantized(ckpt.path, tmp_path / "gptq", qcfg,
                           lambda name, w: {f"{name[:-len('.weight')]}.{k}": v for k, v in
                                            gptq_pack(w, 16, g_idx=act_order_g_idx(w.shape[1], 16)).items()})
    with pytest.raises(ModelLoadError, match=r"experts\.\d+\.(gate|up|down)_proj\.g_idx: act-order \(desc_act\) GPTQ "
                                             r"routed experts are not supported: their groups are not contiguous"):
        load_model(qdir)


def test_awq_gemm(checkpoints, tmp_path):
    """AutoAWQ's GEMM packing by our packer; where AutoAWQ is installed, its own ``WQLinear_GEMM.from_linear`` must
    pack the same bytes and its ``dequantize_gemm`` give the reference's float16 values (ours too, in float16).
    Reference for the model: the literal reading of ``dequantize_gemm`` in float32 (exact)."""
    ckpt = checkpoints("mixtral")  # N multiple of 32 (AutoAWQ's packer), K multiple of the group
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"}
    packed: dict[str, dict] = {}

    def quantize(name, w):
        packed[name] = awq_pack(w, 16)
        return {f"{name[:-len('.weight')]}.{k}": v for k, v in packed[name].items() if not k.startswith("_")}

    qdir = write_quantized(ckpt.path, tmp_path / "awq", qcfg, quantize)
    reference = {name: awq_reference_dequant(p, 16, torch.float32) for name, p in packed.items()}
    name = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    le = load_model(qdir).executor.layers[1]
    assert torch.equal(le.gate[3].dequantize(torch.float16), awq_reference_dequant(packed[name], 16))
    awq = autoawq_modules()
    if awq is not None:
        wq_linear, dequantize_gemm = awq
        p = packed[name]
        assert torch.equal(dequantize_gemm(p["qweight"], p["qzeros"], p["scales"], 4, 16).t(),
                           awq_reference_dequant(p, 16))
        lin = torch.nn.Linear(p["qweight"].shape[0], p["scales"].shape[1], bias=False)
        lin.weight.data = reference[name].clone()
        ref_linear = wq_linear.from_linear(lin, 4, 16, scales=p["_scales"], zeros=p["_zeros"])
        assert torch.equal(ref_linear.qweight, p["qweight"]) and torch.equal(ref_linear.qzeros, p["qzeros"])
    check_format(ckpt, qdir, reference, tmp_path)


@pytest.mark.parametrize("change,message", [
    ({"version": "gemv"}, r"AWQ version 'gemv' is not supported \(gemm\)"),
    ({"bits": 8}, r"AWQ with 8 bits is not supported"),
    ({"zero_point": False}, r"AWQ with zero_point false is not supported"),
], ids=["gemv", "8-bit", "no-zero-point"])
def test_awq_variants_refused(checkpoints, tmp_path, change, message):
    ckpt = checkpoints("mixtral")
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm", **change}
    qdir = write_quantized(ckpt.path, tmp_path / "awq", qcfg, lambda n, w: {n: w})
    with pytest.raises(ModelLoadError, match=message):
        load_model(qdir)


def test_awq_scales_that_do_not_fit_name_the_tensor(checkpoints, tmp_path):
    ckpt = checkpoints("mixtral")
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"}

    def bad(name, w):
        p = {k: v for k, v in awq_pack(w, 16).items() if not k.startswith("_")}
        if name == "model.layers.0.block_sparse_moe.experts.5.w2.weight":
            p["scales"] = p["scales"][:-1].contiguous()
        return {f"{name[:-len('.weight')]}.{k}": v for k, v in p.items()}

    qdir = write_quantized(ckpt.path, tmp_path / "awq", qcfg, bad)
    with pytest.raises(ModelLoadError, match=r"experts\.5\.w2\.scales'.*does not match AWQ gemm qweight"):
        load_model(qdir)


def test_mxfp4_gpt_oss_blocks(checkpoints, tmp_path):
    """gpt-oss's fused ``*_blocks`` / ``*_scales`` expert stacks (interleaved gate / up rows) on a Mixtral-shaped
    model; reference: transformers' ``convert_moe_packed_tensors``."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ckpt = checkpoints("mixtral")
    src = load_file(str(ckpt.path / "model.safetensors"))
    cfg = json.loads((ckpt.path / "config.json").read_text())
    e_count = cfg["num_local_experts"]
    out, reference = {}, {}
    for name, t in src.items():
        if ".experts." not in name:
            out[name] = t
    for layer in range(cfg["num_hidden_layers"]):
        base = f"model.layers.{layer}.block_sparse_moe.experts"
        gate = torch.stack([src[f"{base}.{e}.w1.weight"] for e in range(e_count)])
        up = torch.stack([src[f"{base}.{e}.w3.weight"] for e in range(e_count)])
        down = torch.stack([src[f"{base}.{e}.w2.weight"] for e in range(e_count)])
        gate_up = torch.stack([gate, up], 2).flatten(1, 2)  # rows: gate 0, up 0, gate 1, up 1, ...
        for key, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            blocks, scales = mxfp4_blocks_pack(w)
            out[f"{base}.{key}_blocks"], out[f"{base}.{key}_scales"] = blocks, scales
            deq = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, N, K]
            for e in range(e_count):
                if key == "down_proj":
                    reference[f"{base}.{e}.w2.weight"] = deq[e]
                else:
                    reference[f"{base}.{e}.w1.weight"] = deq[e, 0::2]
                    reference[f"{base}.{e}.w3.weight"] = deq[e, 1::2]
    qdir = tmp_path / "mxfp4"
    qdir.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in out.items()}, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (qdir / "config.json").write_text(json.dumps(cfg))
    check_format(ckpt, qdir, reference, tmp_path)


# --- errors -----------------------------------------------------------------------------------------------------
def test_unsupported_method_names_the_supported_ones(checkpoints, tmp_path):
    ckpt = checkpoints("qwen3_moe")
    qdir = write_quantized(ckpt.path, tmp_path / "hqq", {"quant_method": "hqq", "bits": 4}, lambda n, w: {n: w})
    with pytest.raises(ModelLoadError, match=r"'hqq' is not supported; supported: fp8, compressed-tensors, modelopt, "
                                             r"gptq, awq"):
        load_model(qdir)


def test_scales_that_do_not_match_name_the_tensor(checkpoints, tmp_path):
    ckpt = checkpoints("qwen3_moe")
    qcfg, quantize = fp8_quantizer((16, 16))

    def bad(name, w):
        out = quantize(name, w)
        if name == "model.layers.1.mlp.experts.2.up_proj.weight":
            key = name.replace(".weight", ".weight_scale_inv")
            out[key] = out[key][:, :-1].contiguous()
        return out

    qdir = write_quantized(ckpt.path, tmp_path / "fp8", qcfg, bad)
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj\.weight_scale_inv.*does not match"):
        load_model(qdir)


def test_truncated_file_names_the_tensor(checkpoints, tmp_path):
    ckpt = checkpoints("qwen3_moe")
    qcfg, quantize = fp8_quantizer((16, 16))
    qdir = write_quantized(ckpt.path, tmp_path / "fp8", qcfg, quantize)
    f = qdir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=r"is truncated: tensor '.*' ends at byte"):
        load_model(qdir)


def test_float_quantized_block_scale_that_does_not_fit_names_tensor_and_format(checkpoints, tmp_path):
    ckpt = checkpoints("qwen3_moe")
    qcfg, quantize, _ = ct_quantizer("fp8", strategy="block", block=(16, 16))

    def bad(name, w):
        out = quantize(name, w)
        if name == "model.layers.1.mlp.experts.2.up_proj.weight":
            key = name.replace(".weight", ".weight_scale")
            out[key] = out[key][:-1].contiguous()
        return out

    qdir = write_quantized(ckpt.path, tmp_path / "ct", qcfg, bad)
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj\.weight_scale'.*shape \[2, 4\] does not match its "
                                             r"compressed-tensors float-quantized block weight \[48, 64\] in 16x16"):
        load_model(qdir)


@pytest.mark.parametrize("change,message", [
    ({"strategy": "token"}, r"float-quantized weight strategy 'token' is not supported; supported: tensor, channel"),
    ({"type": "int"}, r"float-quantized with int 8-bit symmetric weights is not supported"),
    ({"strategy": "block", "block_structure": None}, r"block strategy without a block_structure"),
], ids=["token", "int", "no-block"])
def test_float_quantized_schemes_refused(checkpoints, tmp_path, change, message):
    ckpt = checkpoints("qwen3_moe")
    qcfg, quantize, _ = ct_quantizer("fp8", strategy="tensor")
    qcfg["config_groups"]["group_0"]["weights"].update(change)
    qdir = write_quantized(ckpt.path, tmp_path / "ct", qcfg, quantize)
    with pytest.raises(ModelLoadError, match=message):
        load_model(qdir)


def test_float_quantized_block_linear_with_edge_blocks_dequantizes_as_compressed_tensors():
    """A block-scaled linear outside the experts whose N and K are not multiples of the block (edge blocks cut):
    our dequantization against compressed-tensors' own ``decompress``."""
    from tests.models.quant_checkpoints import ct_compressor, ct_scheme

    from ferrylm.checkpoints.quant.compressed_tensors import CompressedTensorsReader

    scheme, fmt = ct_scheme("fp8", strategy="block", block=(16, 16))
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(20, 40, generator=gen).to(torch.float8_e4m3fn)
    s = (torch.rand(2, 3, generator=gen) + 0.5).to(torch.bfloat16)
    want = ct_compressor(fmt).decompress({"weight": w, "weight_scale": s.float()}, scheme)["weight"]
    qcfg = {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": json.loads(scheme.model_dump_json())}}
    got = CompressedTensorsReader(qcfg).dequantize("lin", {".weight": w, ".weight_scale": s}, torch.float32)
    assert got.shape == (20, 40) and torch.equal(got, want)
