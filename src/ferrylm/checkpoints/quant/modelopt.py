"""NVIDIA ModelOpt checkpoints (``quant_method: modelopt``; ``hf_quant_config.json``): NVFP4 and FP8.

Format (nvidia-modelopt's ``export_hf_checkpoint``, v0.47: ``torch/export/unified_export_hf.py``,
``quant_utils.py``, ``qtensor/nvfp4_tensor.py`` / ``fp8_tensor.py``; the tests load checkpoints written by that
exporter and dequantize them with those qtensors). The folder holds ``hf_quant_config.json``
(``{"producer": {"name": "modelopt"}, "quantization": {"quant_algo", "group_size", "exclude_modules",
"kv_cache_quant_algo"}}``) and, in newer exports, the same as config.json's ``quantization_config`` (``quant_method:
"modelopt"``, ``quant_algo``, ``config_groups``, ``ignore``); :meth:`ferrylm.config.ModelConfig.from_folder` merges
the first into the second. Each quantized linear ``W [N, K]`` (per expert for MoE layers:
``...experts.E.{gate,up,down}_proj``) stores:

* ``quant_algo: NVFP4`` (group 16; ``W4A16_NVFP4``, weight-only, the same without ``input_scale``): ``weight`` uint8 ``[N, K / 2]`` (two e2m1 codes a byte, low nibble first),
  ``weight_scale`` float8_e4m3fn ``[N, K / 16]``, ``weight_scale_2`` float32 ``[]`` (per-tensor), value
  ``e2m1 * float(weight_scale) * weight_scale_2``;
* ``quant_algo: FP8``: ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` float32 ``[]``, value
  ``float(weight) * weight_scale``; ``FP8_PER_CHANNEL_PER_TOKEN``: ``weight_scale`` ``[N]``, one per output row;
  ``FP8_PB_WO`` (2D blocks of 128 x 128, weight-only): ``weight_scale`` of ``ceil(N / 128) * ceil(K / 128)``
  values, stored with the kept block dims ``[N / 128, 1, K / 128, 1]`` (``[]`` for a single block), read as
  ``[ceil(N / 128), ceil(K / 128)]``;
* ``input_scale`` float32 ``[]``: the static activation scale of the W4A4 / W8A8 kernels. ferrylm computes
  weight-only (activations stay in the model dtype), so it is read (checked to be one float32 value) and ignored;
* with ``kv_cache_quant_algo: FP8``, ``k_scale`` / ``v_scale`` of the attention: ferrylm's KV cache stays in the
  model dtype, so they are skipped.

Repack (no value changes): NVFP4 -> ``fp4`` group 16, fp8 scales, ``row_scale = weight_scale_2`` (the code path
of compressed-tensors' NVFP4, :func:`~ferrylm.checkpoints.quant.nvfp4.nvfp4_tensor`: ModelOpt's dequantization
multiplies the same two float32 factors first, so the values are its own bit for bit); FP8 -> ``fp8`` group ``K``
with the per-tensor (or per-row) scale repeated over the rows (:func:`~ferrylm.checkpoints.quant.fp8.fp8_tensor`,
exact; FP8_PB_WO: group 128, each block scale repeated over its 128 rows). Other ``quant_algo`` values
(``MIXED_PRECISION``, ``W4A16_AWQ``, ``NVFP4_AWQ``, ``MXFP8``, ...) are refused by name.
"""

from __future__ import annotations

import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import ExpertQuant, QuantFormat, QuantTensor
from ferrylm.checkpoints.quant.base import QuantReader, need, same
from ferrylm.checkpoints.quant.fp8 import fp8_block_dense, fp8_tensor
from ferrylm.checkpoints.quant.nvfp4 import FORMAT as NVFP4_FORMAT, GROUP as NVFP4_GROUP, nvfp4_tensor

#: quant_algo -> what it is read as
ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "channel",
         "FP8_PB_WO": "block"}
#: FP8_PB_WO's block (ModelOpt's FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG: block_sizes {-1: 128, -2: 128})
PB_BLOCK = (128, 128)
#: non-weight tensors of a ModelOpt export that ferrylm does not use (FP8 KV-cache scales)
SKIPPED_SUFFIXES = (".k_scale", ".v_scale")


class ModelOptReader(QuantReader):
    """See the module docstring.

    Args:
        qcfg: config.json's ``quantization_config`` (with hf_quant_config.json's ``quantization`` merged in, or
            that alone), a dict with ``quant_algo``.

    Raises:
        ModelLoadError: no ``quant_algo``, an unsupported one (the message names it and the supported ones), or an
            NVFP4 group size other than 16.
    """

    method = "modelopt"
    parts = (".weight", ".weight_scale", ".weight_scale_2", ".input_scale")
    marker = ".weight_scale"

    def __init__(self, qcfg: dict):
        nested = qcfg.get("quantization") if isinstance(qcfg.get("quantization"), dict) else {}
        algo = qcfg.get("quant_algo") or nested.get("quant_algo")
        if not algo:
            raise ModelLoadError("ModelOpt quantization_config (or hf_quant_config.json) has no quant_algo")
        self.algo = str(algo).upper()
        if self.algo not in ALGOS:
            raise ModelLoadError(f"ModelOpt quant_algo {algo!r} is not supported; supported: {', '.join(ALGOS)}")
        self.kind = ALGOS[self.algo]
        if self.kind == "nvfp4":
            group = qcfg.get("group_size") or nested.get("group_size") or _group_of(qcfg) or NVFP4_GROUP
            if int(group) != NVFP4_GROUP:
                raise ModelLoadError(f"ModelOpt NVFP4 with group_size {group} is not supported ({NVFP4_GROUP})")

    @property
    def what(self) -> str:
        return f"ModelOpt {self.algo}"

    def planned(self):
        if self.kind == "nvfp4":
            return same(NVFP4_FORMAT)
        return same(QuantFormat("fp8", PB_BLOCK[1] if self.kind == "block" else 128, torch.float32))  # else K

    def planned_for(self, hidden: int, inter: int):
        if self.kind in ("nvfp4", "block"):
            return self.planned()
        return ExpertQuant(QuantFormat("fp8", hidden, torch.float32), QuantFormat("fp8", inter, torch.float32))

    def skip(self, name: str) -> bool:
        return name.endswith(SKIPPED_SUFFIXES)

    def decode(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        inp = parts.get(".input_scale")
        if inp is not None and (inp.dtype != torch.float32 or inp.numel() != 1):
            raise ModelLoadError(f"checkpoint tensor {prefix + '.input_scale'!r} ({self.what} activation scale): "
                                 f"{inp.dtype} of shape {list(inp.shape)}; expected one float32 value")
        if self.kind == "nvfp4":
            return nvfp4_tensor(prefix, parts, data=".weight", scale=".weight_scale", global_scale=".weight_scale_2",
                                divide=False, dtype=dtype, what=self.what)
        if ".weight_scale_2" in parts:
            raise ModelLoadError(f"checkpoint tensor {prefix + '.weight_scale_2'!r}: a second weight scale is not "
                                 f"part of {self.what} (is the checkpoint NVFP4 or a mixed one?)")
        w, s = self._fp8_parts(prefix, parts)
        return fp8_tensor(prefix, w, s, ".weight_scale", self.kind, PB_BLOCK, dtype, self.what)

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """As the base class; FP8_PB_WO linears outside the experts may end in partial blocks (cut)."""
        if self.kind != "block":
            return super().dequantize(prefix, parts, dtype)
        w, s = self._fp8_parts(prefix, parts)
        return fp8_block_dense(w, s, PB_BLOCK, dtype)

    def _fp8_parts(self, prefix: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 weight and its scale (FP8_PB_WO's block scales as ``[ceil(N / 128), ceil(K / 128)]``)."""
        w = need(parts, prefix, ".weight", (torch.float8_e4m3fn,), self.what)
        s = need(parts, prefix, ".weight_scale", (torch.float32, torch.bfloat16, torch.float16), self.what)
        if self.kind == "block":
            n, k = w.shape[-2:]
            blocks = (-(-n // PB_BLOCK[0]), -(-k // PB_BLOCK[1]))
            if w.dim() != 2 or s.numel() != blocks[0] * blocks[1]:
                raise ModelLoadError(f"checkpoint tensor {prefix + '.weight_scale'!r} ({self.what}): shape "
                                     f"{list(s.shape)} does not hold the {blocks[0]}x{blocks[1]} block scales of its "
                                     f"weight {list(w.shape)} in {PB_BLOCK[0]}x{PB_BLOCK[1]} blocks")
            s = s.reshape(blocks)
        return w, s


def _group_of(qcfg: dict) -> int | None:
    """The weights' group size of the first config group (the compressed-tensors-style copy of the config)."""
    for g in (qcfg.get("config_groups") or {}).values():
        gs = ((g or {}).get("weights") or {}).get("group_size")
        if gs:
            return int(gs)
    return None
