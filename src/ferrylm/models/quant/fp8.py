"""FP8 block-quantized checkpoints (``quant_method: fp8``, as DeepSeek-V3 and Qwen3-*-FP8 ship them).

Format (DeepSeek-V3's ``inference/kernel.py`` ``weight_dequant`` and transformers' FineGrainedFP8 integration):
a quantized linear has ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` float32 ``[ceil(N / bn),
ceil(K / bk)]`` for ``weight_block_size: [bn, bk]`` (128 x 128 in every published checkpoint); element ``(n, k)``
is ``float(weight[n, k]) * weight_scale_inv[n // bn, k // bk]``. Activation scales (``activation_scheme``) do not
change the weights and are not read (ferrylm computes with bf16 activations).

Repack: the same fp8 bytes, the block scale repeated over its ``bn`` rows (:class:`QuantFormat` ``fp8``, group
``bk``, float32 scales): lossless, and the dequantized values are the reference's bit for bit.
"""

from __future__ import annotations

import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import QuantFormat, QuantTensor
from ferrylm.models.quant.base import QuantReader, expect_shape, need, same


class Fp8BlockReader(QuantReader):
    """Reads ``weight`` + ``weight_scale_inv`` modules (see the module docstring)."""

    method = "fp8"
    parts = (".weight", ".weight_scale_inv", ".input_scale", ".activation_scale")
    marker = ".weight_scale_inv"

    def __init__(self, qcfg: dict):
        block = qcfg.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ModelLoadError(f"quantization_config quant_method fp8 without a weight_block_size [bn, bk] "
                                 f"(got {block!r}): only block-wise FP8 is supported")
        fmt = qcfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ModelLoadError(f"FP8 format {fmt!r} is not supported (only e4m3)")
        self.bn, self.bk = int(block[0]), int(block[1])

    def planned(self):
        return same(QuantFormat("fp8", self.bk, torch.float32))

    def _parts(self, prefix: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        w = need(parts, prefix, ".weight", (torch.float8_e4m3fn,))
        s = need(parts, prefix, ".weight_scale_inv", (torch.float32, torch.bfloat16, torch.float16))
        *lead, n, k = w.shape
        expect_shape(s, (*lead, -(-n // self.bn), -(-k // self.bk)), prefix + ".weight_scale_inv",
                     f"its weight {list(w.shape)} in {self.bn}x{self.bk} blocks")
        return w, s

    def decode(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        w, s = self._parts(prefix, parts)
        n, k = w.shape[-2:]
        if k % self.bk:
            raise ModelLoadError(f"{prefix}.weight: K = {k} is not a multiple of the block size {self.bk}")
        scales = s.float().repeat_interleave(self.bn, dim=-2)[..., :n, :].contiguous()
        return QuantTensor(QuantFormat("fp8", self.bk, torch.float32), w.contiguous(), scales, dtype=dtype)

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        w, s = self._parts(prefix, parts)
        n, k = w.shape[-2:]
        full = s.float().repeat_interleave(self.bn, -2).repeat_interleave(self.bk, -1)[..., :n, :k]
        return (w.float() * full).to(dtype)
