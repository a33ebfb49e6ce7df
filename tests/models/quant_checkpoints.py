"""Quantized tiny checkpoints for the format tests, written by each format's reference tooling where a package has
it, and the reference dequantizers the tests check ferrylm against.

- FP8 block: transformers' ``Fp8Quantize`` (its FineGrainedFP8 quantizer); reference: transformers loading the
  folder (it dequantizes FP8 on a machine without a GPU).
- compressed-tensors int4 / int8 / NVFP4 / MXFP4: the ``compressed-tensors`` package's own compressors
  (``compress``), scales from its ``calculate_qparams`` / ``generate_gparam``; reference: the same compressors'
  ``decompress``.
- GPTQ: no installable reference package runs here (GPTQModel / AutoGPTQ build CUDA extensions), so
  :func:`gptq_pack` is our documented packer and :func:`gptq_reference_dequant` a separate, literal reading of
  AutoGPTQ's torch dequantization (unpack by shifts, ``scales * (q - (z + 1))``).
- MXFP4 gpt-oss blocks: :func:`mxfp4_blocks_pack` (codes and E8M0 scales from gguf-py's MXFP4 quantizer,
  re-laid in gpt-oss's order); reference: transformers' ``convert_moe_packed_tensors``.

A quantized folder holds ``config.json`` (the source's plus ``quantization_config``) and one
``model.safetensors``; :func:`dense_reference` writes the dequantized weights back as a plain folder and loads
it in transformers (the reference model on the dequantized weights).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

# Linear weights the tests quantize: attention and MLP / expert projections (not embeddings, norms or routers).
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def is_quantized_linear(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".weight") and t.dim() == 2 and name.split(".")[-2] in _LINEAR


def is_expert(name: str) -> bool:
    return ".experts." in name


def write_quantized(src: Path, dst: Path, qcfg: dict, quantize: Callable[[str, torch.Tensor], dict],
                    select: Callable[[str, torch.Tensor], bool] = is_quantized_linear) -> Path:
    """``dst``: ``src``'s tensors with every selected weight replaced by ``quantize(name, w)``'s tensors."""
    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        out.update(quantize(name, t) if select(name, t) else {name: t})
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def dense_reference(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' model (float32, eval) of ``src``'s config with ``weights`` replacing those tensors."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update({k: v.float() for k, v in weights.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


# --- FP8 block (transformers) -----------------------------------------------------------------------------------
def fp8_quantizer(block: tuple[int, int]):
    """``(quantization_config dict, quantize(name, w) -> {name: fp8, name_scale_inv: f32})`` via transformers."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = FineGrainedFP8Config(weight_block_size=list(block))

    class _Quantizer:
        quantization_config = cfg

    op = Fp8Quantize(_Quantizer())
    qcfg = json.loads(json.dumps(cfg.to_dict()))
    return qcfg, lambda name, w: op._quantize_one(name, w)


# --- compressed-tensors -----------------------------------------------------------------------------------------
def ct_scheme(kind: str, group: int | None = None, symmetric: bool = True, bits: int = 4,
              strategy: str | None = None, block: tuple[int, int] | None = None):
    """``(QuantizationScheme, format)`` for ``kind`` in ``int``, ``nvfp4``, ``mxfp4``, ``fp8`` (float-quantized
    with ``strategy`` tensor / channel / block of ``block``, dynamic per-token input activations as the
    ``*-FP8-dynamic`` checkpoints have)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if kind == "fp8":
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                                block_structure=list(block) if block else None, group_size=group)
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
        return QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts), "float-quantized"
    if kind == "int":
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                                strategy="group" if group else "channel", group_size=group)
        fmt = "pack-quantized"
    elif kind == "nvfp4":
        args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16)
        fmt = "nvfp4-pack-quantized"
    else:
        args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32,
                                scale_dtype=torch.uint8)
        fmt = "mxfp4-pack-quantized"
    return QuantizationScheme(targets=["Linear"], weights=args), fmt


def ct_compressor(fmt: str):
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(fmt)


def ct_quantizer(kind: str, **kw):
    """``(quantization_config dict, quantize, decompress)`` with the compressed-tensors package: ``quantize(name,
    w)`` computes the scheme's scales with ``calculate_qparams`` (and ``generate_gparam`` for NVFP4) and calls the
    compressor; ``decompress(prefix, tensors)`` is the package's own dequantization."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme, fmt = ct_scheme(kind, **kw)
    comp = ct_compressor(fmt)
    args = scheme.weights

    def quantize(name: str, w: torch.Tensor) -> dict:
        n, k = w.shape
        g = args.group_size or k
        w = w.to(torch.bfloat16)  # as a bf16 model is quantized: scales in bf16 (fp8 / E8M0 for the FP4 formats)
        if kind == "fp8" and args.strategy != "group":  # min / max per tensor [1], row [N, 1], block [N/bn, K/bk]
            if args.strategy == "block":
                bn, bk = args.block_structure
                blocks = w.reshape(n // bn, bn, k // bk, bk).transpose(1, 2).flatten(2)
            else:
                blocks = w.reshape(1, 1, -1) if args.strategy == "tensor" else w.reshape(n, 1, k)
            lo, hi = blocks.amin(-1), blocks.amax(-1)
            lo, hi = (lo.reshape(1), hi.reshape(1)) if args.strategy == "tensor" else (lo, hi)
        else:
            blocks = w.reshape(n, k // g, g)
            lo, hi = blocks.amin(-1), blocks.amax(-1)
        gscale = generate_gparam(w.float().amin(), w.float().amax()) if kind == "nvfp4" else None
        scale, zp = calculate_qparams(lo, hi, args, global_scale=gscale)
        sd = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
        if gscale is not None:
            sd["weight_global_scale"] = gscale
        out = comp.compress(sd, scheme)
        prefix = name[:-len(".weight")]
        return {f"{prefix}.{k2}": v for k2, v in out.items()}

    def decompress(prefix: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The package's dequantization in float32: ``decompress`` for int (its arithmetic follows the scale's
        dtype, so the stored bf16 scales are widened to float32 first, exactly); for FP4 the steps of the FP4
        compressors' ``decompress`` (``unpack_fp4_from_uint8``, ``_decompress_scale``, ``dequantize``) with a
        float32 ``dtype`` instead of their bfloat16 default."""
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        sd = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        if kind in ("int", "fp8"):
            sd["weight_scale"] = sd["weight_scale"].float()
            return comp.decompress(sd, scheme)["weight"]
        m, n = sd["weight_packed"].shape
        x = unpack_fp4_from_uint8(sd["weight_packed"], m, 2 * n, dtype=torch.float32)
        scale = comp._decompress_scale(sd["weight_scale"], torch.float32)
        return dequantize(x_q=x, scale=scale, args=args, global_scale=sd.get("weight_global_scale"),
                          dtype=torch.float32)

    qcfg = {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": json.loads(scheme.model_dump_json())}, "ignore": ["lm_head"]}
    return qcfg, quantize, decompress


# --- GPTQ (our packer; AutoGPTQ's layout) --------------------------------------------------------------------------
def gptq_pack(w: torch.Tensor, group: int, v2: bool = False, g_idx: torch.Tensor | None = None
              ) -> dict[str, torch.Tensor]:
    """Quantize ``w [N, K]`` asymmetrically per ``group`` inputs (min/max, 4 bits) and pack it the AutoGPTQ way:
    ``qweight [K/8, N]`` int32 (input ``k`` at bits ``4 (k % 8)`` of row ``k // 8``), ``qzeros [G, N/8]`` (output
    ``n`` at bits ``4 (n % 8)``, storing ``z - 1`` unless ``v2``), ``scales [G, N]`` float16, ``g_idx [K]``.
    ``g_idx`` (act-order, :func:`act_order_g_idx`): input ``k`` belongs to group ``g_idx[k]`` instead of ``k //
    group`` (AutoGPTQ's desc_act layout: the inputs stay in their order, the groups are scattered)."""
    n, k = w.shape
    g = k // group
    gi = torch.arange(k) // group if g_idx is None else g_idx.long()
    wf = w.float()
    lo = torch.stack([wf[:, gi == j].amin(-1) for j in range(g)], -1).clamp(max=0)  # [N, G]
    hi = torch.stack([wf[:, gi == j].amax(-1) for j in range(g)], -1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half()  # [N, G]
    z = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.round(wf / scale.float()[:, gi] + z[:, gi]).clamp(0, 15).to(torch.int64)  # [N, K]
    qt = q.t().reshape(k // 8, 8, n)  # [K/8, 8, N]
    qweight = sum(qt[:, j] << (4 * j) for j in range(8))
    zs = (z.to(torch.int64) - (0 if v2 else 1)).t().reshape(g, n // 8, 8)  # [G, N/8, 8]
    qzeros = sum(zs[..., j] << (4 * j) for j in range(8))
    to32 = lambda t: torch.from_numpy(t.numpy().astype(np.uint32).view(np.int32))  # noqa: E731
    return {"qweight": to32(qweight), "qzeros": to32(qzeros), "scales": scale.t().contiguous(),
            "g_idx": gi.to(torch.int32)}


def act_order_g_idx(k: int, group: int, seed: int = 0) -> torch.Tensor:
    """A desc_act ``g_idx [K]``: the inputs in a random order (GPTQ's order of decreasing Hessian diagonal), the
    ``j``-th of that order in group ``j // group``."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    return g_idx


def gptq_reference_dequant(parts: dict[str, torch.Tensor], v2: bool = False) -> torch.Tensor:
    """AutoGPTQ's torch dequantization (``TorchQuantLinear``): ``W[n, k] = scales[g_idx[k], n] * (q[k, n] -
    (qzeros_unpacked[g_idx[k], n] + 1))`` (no ``+ 1`` for ``gptq_v2``), returned as ``[N, K]`` float32."""
    qweight, qzeros, scales, g_idx = parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"].long()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = torch.bitwise_and(torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]), 15)
    zeros = zeros.reshape(qzeros.shape[0], -1) + (0 if v2 else 1)  # [G, N]
    q = torch.bitwise_and(torch.bitwise_right_shift(qweight[:, None, :], shifts[None, :, None]), 15)
    q = q.reshape(-1, qweight.shape[1])  # [K, N]
    w = scales.float()[g_idx] * (q - zeros[g_idx]).float()
    return w.t().contiguous()


# --- MXFP4 gpt-oss blocks -----------------------------------------------------------------------------------------
def mxfp4_blocks_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> gpt-oss ``(blocks [..., N, K/32, 16], scales [..., N, K/32])`` uint8: codes and E8M0
    exponents from gguf-py's MXFP4 quantizer (GGUF block: 1 scale byte, then 16 bytes whose low nibbles are
    elements 0-15 and high nibbles 16-31), re-laid so that byte ``j`` holds elements ``2j`` (low) and ``2j + 1``."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    *lead, n, k = w.shape
    raw = quantize(w.float().reshape(-1, k).numpy(), GGMLQuantizationType.MXFP4)  # [rows, K/32 * 17]
    raw = torch.from_numpy(raw.reshape(-1, k // 32, 17))
    e, qs = raw[..., 0], raw[..., 1:]
    codes = torch.cat([qs & 15, qs >> 4], -1)  # [rows, G, 32] element order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.reshape(*lead, n, k // 32, 16), e.reshape(*lead, n, k // 32)


# --- AWQ (AutoAWQ GEMM) -------------------------------------------------------------------------------------------
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_pack(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """Quantize ``w [N, K]`` asymmetrically per ``group`` inputs (min/max, 4 bits; scales float16) and pack it the
    way AutoAWQ's ``WQLinear_GEMM.from_linear`` does: ``qweight [K, N/8]`` int32 (nibble ``i`` of column ``c`` =
    output ``8c + [0,2,4,6,1,3,5,7][i]``), ``qzeros [G, N/8]`` the same along ``N``, ``scales [G, N]`` float16.
    Also returns the integer ``zeros [G, N]`` and ``scales`` for :func:`awq_autoawq_pack`."""
    n, k = w.shape
    g = k // group
    blocks = w.float().reshape(n, g, group)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-5).half()  # [N, G]
    z = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.round(blocks / scale.float()[..., None] + z[..., None]).clamp(0, 15).to(torch.int64).reshape(n, k)

    def pack(t: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8] int32, AWQ's order
        t = t.reshape(t.shape[0], -1, 8)
        words = sum(t[..., _AWQ_ORDER[i]] << (4 * i) for i in range(8))
        return torch.from_numpy(np.ascontiguousarray(words.numpy()).astype(np.uint32).view(np.int32))

    return {"qweight": pack(q.t()), "qzeros": pack(z.to(torch.int64).t()), "scales": scale.t().contiguous(),
            "_zeros": z.t().contiguous(), "_scales": scale.t().contiguous()}


def awq_reference_dequant(parts: dict[str, torch.Tensor], group: int, dtype: torch.dtype = torch.float16
                          ) -> torch.Tensor:
    """A literal reading of AutoAWQ's ``dequantize_gemm`` (unpack by shifts, undo the order, ``(q - z) * scales``),
    ``[N, K]``, computed in ``dtype`` (AutoAWQ: the scales' float16; float32 is exact)."""
    shifts = torch.arange(0, 32, 4)
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]

    def unpack(t):
        u = torch.bitwise_and(torch.bitwise_right_shift(t[:, :, None], shifts[None, None, :]), 15)
        u = u.reshape(t.shape[0], -1)
        idx = torch.arange(u.shape[-1]).view(-1, 8)[:, reverse].reshape(-1)
        return u[:, idx]

    q, z = unpack(parts["qweight"]), unpack(parts["qzeros"])
    s = parts["scales"].to(dtype).repeat_interleave(group, dim=0)
    return ((q - z.repeat_interleave(group, dim=0)) * s).t().contiguous()


def autoawq_modules():
    """AutoAWQ's ``(WQLinear_GEMM, dequantize_gemm)``, or None when the package is not installed. Loaded without
    ``awq/__init__.py`` (which imports the calibration pipeline and its ``datasets`` dependency): the two modules
    themselves need torch only."""
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        return None
    if "awq" not in sys.modules:
        pkg = types.ModuleType("awq")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["awq"] = pkg
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    return WQLinear_GEMM, dequantize_gemm
