"""NVIDIA ModelOpt checkpoints (NVFP4, FP8) of the tiny test models, and their reference dequantization.

Two writers, one reference each:

- :func:`modelopt_export` (when ``nvidia-modelopt`` imports: it installs and runs on a CPU, with no GPU): the real
  thing, ``mtq.quantize(model, NVFP4_DEFAULT_CFG | FP8_DEFAULT_CFG, calibration)`` then ``export_hf_checkpoint``
  (hf_quant_config.json + config.json ``quantization_config``, per-expert ``weight`` / ``weight_scale`` /
  ``weight_scale_2`` / ``input_scale`` tensors; ``kv_cache=True`` adds the FP8 KV-cache quantizers and their
  ``k_scale`` / ``v_scale``). Reference: :func:`modelopt_dequant`, ModelOpt's own ``NVFP4QTensor`` /
  ``FP8QTensor`` ``dequantize`` of the exported tensors.
- :func:`layout_export` (always): our packer of ModelOpt's documented export layout (``quant_utils.
  to_quantized_weight``, ``NVFP4QTensor.quantize``: ``weight_scale_2 = amax / (6 * 448)``, block scales
  ``amax16 / (6 * weight_scale_2)`` in fp8 clamped to ``[2^-9, 448]``, codes packed low nibble first; FP8
  ``weight_scale = amax / 448``), written with hf_quant_config.json only (the older exports' shape). Reference:
  :func:`layout_dequant`, a literal reading of the documented formula ``e2m1 * float(weight_scale) *
  weight_scale_2`` (``float(weight) * weight_scale`` for FP8). Used where ModelOpt is not installed and to write
  malformed files.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.models.quant_checkpoints import is_quantized_linear

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def modelopt_available() -> bool:
    return importlib.util.find_spec("modelopt") is not None


# --- the real exporter ------------------------------------------------------------------------------------------
def modelopt_export(src: Path, dst: Path, cfg_name: str, kv_cache: bool = False, vocab_size: int = 128) -> Path:
    """``src`` (a plain tiny HF folder) quantized by ModelOpt with its recipe ``cfg_name`` (``NVFP4_DEFAULT_CFG``,
    ``NVFP4_EXPERTS_ONLY_CFG``, ``W4A16_NVFP4_CFG``, ``FP8_DEFAULT_CFG``, ``FP8_PER_CHANNEL_PER_TOKEN_CFG``) and
    exported to ``dst`` with ``export_hf_checkpoint`` (unquantized tensors in float32, as the source)."""
    import transformers
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    cfg = copy.deepcopy(getattr(mtq, cfg_name))
    if kv_cache:
        kv = mtq.FP8_KV_CFG["quant_cfg"]
        if isinstance(cfg["quant_cfg"], dict):
            cfg["quant_cfg"].update(kv)
        else:
            cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(kv)
    gen = torch.Generator().manual_seed(0)
    calib = torch.randint(0, vocab_size, (4, 24), generator=gen)

    def forward_loop(m):
        with torch.no_grad():
            m(input_ids=calib)

    model = mtq.quantize(model, cfg, forward_loop)
    export_hf_checkpoint(model, dtype=torch.float32, export_dir=dst)
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    return dst


def modelopt_dequant(qdir: Path) -> dict[str, torch.Tensor]:
    """ModelOpt's own dequantization (float32) of every quantized linear in ``qdir``: ``prefix.weight`` -> ``[N,
    K]``."""
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    sd = load_file(str(qdir / "model.safetensors"))
    algo = json.loads((qdir / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
    out = {}
    for name, s in sd.items():
        if not name.endswith(".weight_scale"):
            continue
        prefix = name[:-len(".weight_scale")]
        w = sd[prefix + ".weight"]
        if w.dtype == torch.uint8:
            n, kp = w.shape
            qt = NVFP4QTensor(torch.Size((n, 2 * kp)), torch.float32, w)
            out[prefix + ".weight"] = qt.dequantize(dtype=torch.float32, scale=s, block_sizes={-1: 16},
                                                    double_scale=sd[prefix + ".weight_scale_2"])
        elif algo.upper() == "FP8_PB_WO":  # 128x128 blocks; the stored [N/128, 1, K/128, 1] as [N/128, K/128]
            n, k = w.shape
            scale = s.reshape(-(-n // 128), -(-k // 128))
            out[prefix + ".weight"] = FP8QTensor(w.shape, torch.float32, w).dequantize(
                dtype=torch.float32, scale=scale, block_sizes={-1: 128, -2: 128})
        else:  # a per-channel scale [N] is applied per row (ModelOpt's export divides by scale[:, None])
            scale = s[:, None] if s.dim() == 1 else s
            out[prefix + ".weight"] = FP8QTensor(w.shape, torch.float32, w).dequantize(dtype=torch.float32,
                                                                                        scale=scale)
    return out


# --- the documented layout (our packer) -------------------------------------------------------------------------
def nvfp4_pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``w [N, K]`` -> ``weight`` (uint8 ``[N, K/2]``), ``weight_scale`` (fp8 ``[N, K/16]``), ``weight_scale_2``
    (float32 ``[]``), ``input_scale`` (float32 ``[]``), by ModelOpt's documented formulas (module docstring);
    codes by nearest e2m1 magnitude."""
    w = w.float()
    n, k = w.shape
    ws2 = w.abs().amax() / (6.0 * 448.0)
    blocks = w.reshape(n, k // 16, 16)
    s = (blocks.abs().amax(-1) / (6.0 * ws2))
    s[s == 0] = 1.0
    s = s.clamp(min=2 ** -9, max=448.0).to(torch.float8_e4m3fn)
    scaled = blocks / (s.float() * ws2)[..., None]
    mags = E2M1[:8]
    code = (scaled.abs()[..., None] - mags).abs().argmin(-1).to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
    code = code.reshape(n, k)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return {"weight": packed.contiguous(), "weight_scale": s.contiguous(), "weight_scale_2": ws2.reshape(()),
            "input_scale": torch.tensor(0.01, dtype=torch.float32)}


def fp8_pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``w [N, K]`` -> ``weight`` (fp8 e4m3), ``weight_scale`` (float32 ``[]`` = amax / 448), ``input_scale``."""
    s = w.float().abs().amax() / 448.0
    return {"weight": (w.float() / s).to(torch.float8_e4m3fn), "weight_scale": s.reshape(()),
            "input_scale": torch.tensor(0.01, dtype=torch.float32)}


def layout_dequant(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The documented value of a ModelOpt linear (module docstring), float32 ``[N, K]``."""
    w = parts["weight"]
    if w.dtype == torch.uint8:
        codes = torch.stack((w & 15, w >> 4), -1).flatten(-2).long()
        n, k = codes.shape
        scale = parts["weight_scale"].float() * parts["weight_scale_2"].float()
        return (E2M1[codes].reshape(n, k // 16, 16) * scale[..., None]).reshape(n, k)
    return w.float() * parts["weight_scale"].float()


def layout_export(src: Path, dst: Path, algo: str, mutate=None) -> tuple[Path, dict[str, torch.Tensor]]:
    """``src`` packed in ModelOpt's layout for ``algo`` (``NVFP4``, ``FP8``) with hf_quant_config.json (config.json
    left without a ``quantization_config``). ``mutate(prefix, parts)`` may change a module's tensors (malformed
    files). Returns the folder and :func:`layout_dequant` of every quantized linear (``prefix.weight`` -> value)."""
    dst.mkdir(parents=True, exist_ok=True)
    pack = nvfp4_pack if algo == "NVFP4" else fp8_pack
    out, reference = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not is_quantized_linear(name, t):
            out[name] = t
            continue
        prefix = name[:-len(".weight")]
        parts = pack(t)
        reference[name] = layout_dequant(parts)
        if mutate is not None:
            parts = mutate(prefix, parts)
        out.update({f"{prefix}.{k}": v for k, v in parts.items()})
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    if algo == "NVFP4":
        quant["group_size"] = 16
    (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.47.0"},
                                                          "quantization": quant}))
    return dst, reference


def block_checkpoint(path: Path):
    """A Qwen3-MoE of 128-multiples (``H = 256``, ``I = 384``, 4 experts, 2 layers) for ModelOpt's FP8 128x128
    blocks, as :class:`tests.models.hf_checkpoints.Checkpoint` (built like the tiny cases)."""
    import transformers

    from tests.models.hf_checkpoints import _COMMON, Checkpoint, _randomize_

    cfg = transformers.Qwen3MoeConfig(**{**_COMMON, **dict(
        vocab_size=160, hidden_size=256, intermediate_size=384, moe_intermediate_size=384, num_hidden_layers=2,
        head_dim=64, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    _randomize_(model, 5)
    model.eval()
    model.save_pretrained(path)
    return Checkpoint(path=path, reference=model, vocab_size=cfg.vocab_size)
