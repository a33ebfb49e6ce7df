"""MXFP4 checkpoints in gpt-oss's layout (``quant_method: mxfp4``): fused expert stacks as e2m1 blocks.

Format (OCP Microscaling Formats v1.0 MXFP4: e2m1 elements, one E8M0 scale per 32; the tensor layout of
openai/gpt-oss checkpoints as transformers' ``integrations/mxfp4.py`` ``convert_moe_packed_tensors`` reads it,
the reference the tests check against):

* ``<experts>.gate_up_proj_blocks`` uint8 ``[E, 2I, H / 32, 16]`` and ``..._scales`` uint8 ``[E, 2I, H / 32]``;
  ``<experts>.down_proj_blocks`` ``[E, H, I / 32, 16]`` and ``..._scales`` ``[E, H, I / 32]``. Row ``r`` of a
  block stack is output ``r``; its 16 bytes per group hold 32 e2m1 codes, the low nibble first; value
  ``e2m1 * 2^(scale - 127)``.
* gate_up rows are interleaved: output ``2j`` is gate row ``j``, ``2j + 1`` up row ``j`` (gpt-oss).

Repack: ``fp4`` group 32, the E8M0 scales as bfloat16 (exact), the blocks' bytes unchanged; gate_up split into
its gate and up rows. Only routed experts are read in this layout (other quantized linears are not part of it).
gpt-oss itself (attention sinks, clamped SwiGLU with biases) is not an architecture ferrylm serves; the layout is
read for the architectures it does.
"""

from __future__ import annotations

import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import QuantFormat, QuantTensor
from ferrylm.checkpoints.quant.base import QuantReader, e8m0_to_bf16, expect_shape, need, same


class Mxfp4BlocksReader(QuantReader):
    """See the module docstring."""

    method = "mxfp4"
    parts = ("_blocks", "_scales")
    marker = "_blocks"

    def __init__(self, qcfg: dict):
        pass

    def planned(self):
        return same(QuantFormat("fp4", 32, torch.bfloat16))

    def gate_up_rows(self, prefix: str) -> str:
        return "interleaved"

    def decode(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        blocks = need(parts, prefix, "_blocks", (torch.uint8,))
        if blocks.dim() < 3 or blocks.shape[-1] != 16:
            raise ModelLoadError(f"checkpoint tensor {prefix + '_blocks'!r}: shape {list(blocks.shape)} is not "
                                 f"[..., N, K / 32, 16]")
        scales = need(parts, prefix, "_scales", (torch.uint8,))
        expect_shape(scales, tuple(blocks.shape[:-1]), prefix + "_scales", f"{prefix}_blocks' groups")
        *lead, n, g, _ = blocks.shape
        return QuantTensor(QuantFormat("fp4", 32, torch.bfloat16), blocks.reshape(*lead, n, g * 16).contiguous(),
                           e8m0_to_bf16(scales).contiguous(), dtype=dtype)
