"""AWQ checkpoints (``quant_method: awq``, AutoAWQ's ``GEMM`` packing), 4-bit with zero points.

Format (AutoAWQ 0.2.9: ``WQLinear_GEMM.from_linear`` packs, ``utils/packing_utils.dequantize_gemm`` dequantizes;
the tests check against both when the package imports), for a linear ``W [N, K]`` (``N`` outputs, ``K`` inputs)
and ``G = K / group_size`` groups:

* ``qweight`` int32 ``[K, N / 8]``: the 8 nibbles of ``qweight[k, c]`` (bits ``4 i``, little-endian) hold the codes
  of outputs ``8 c + AWQ_ORDER[i]``, ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``: unsigned ``q``;
* ``qzeros`` int32 ``[G, N / 8]``: the zero points, packed the same way along ``N``;
* ``scales`` float16 ``[G, N]``;
* element value ``(q[k, n] - z[k // group_size, n]) * scales[k // group_size, n]`` (no ``+ 1``: unlike GPTQ).

Repack: ``int4`` with mins, ``s = scales`` and ``m = z * s`` in float32 (exact: an 11-bit scale times a 4-bit
integer), the codes regrouped to one row per output (low nibble = even input). Only ``version: gemm`` (the hub's
common layout) with ``zero_point: true`` is read; GEMV / exllama / marlin packings are refused by name.
"""

from __future__ import annotations

import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import QuantFormat, QuantTensor
from ferrylm.checkpoints.quant.base import QuantReader, expect_shape, int32_bytes, need, nibbles, same

#: nibble ``i`` of a packed word holds output ``8 c + AWQ_ORDER[i]``
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_WHAT = "AWQ gemm"


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, N / 8]`` (AWQ's packing along ``N``) -> uint8 ``[R, N]`` codes in output order."""
    nib = nibbles(int32_bytes(packed)).view(packed.shape[0], -1, 8)  # [R, N/8, 8]: nibble i of each word
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib
    return out.reshape(packed.shape[0], -1)


class AwqReader(QuantReader):
    """See the module docstring.

    Raises:
        ModelLoadError: bits other than 4, a version other than gemm, ``zero_point: false``.
    """

    method = "awq"
    parts = (".qweight", ".qzeros", ".scales")
    marker = ".qweight"

    def __init__(self, qcfg: dict):
        self.bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
        if self.bits != 4:
            raise ModelLoadError(f"AWQ with {self.bits} bits is not supported (4)")
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"AWQ version {version!r} is not supported (gemm)")
        if not qcfg.get("zero_point", True):
            raise ModelLoadError("AWQ with zero_point false is not supported (the gemm layout with zero points)")
        self.group_size = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))

    def planned(self):
        return same(QuantFormat("int4", self.group_size if self.group_size > 0 else 128, torch.float32, mins=True))

    def decode(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        qw = need(parts, prefix, ".qweight", (torch.int32,), _WHAT)
        if qw.dim() != 2:
            raise ModelLoadError(f"checkpoint tensor {prefix + '.qweight'!r} ({_WHAT}): shape {list(qw.shape)} is "
                                 f"not [K, N / 8]")
        k, n = qw.shape[0], qw.shape[1] * 8
        group = k if self.group_size <= 0 else self.group_size
        if k % group or k % 2:
            raise ModelLoadError(f"{prefix} ({_WHAT}): K = {k} is not a multiple of the group size {group}")
        g = k // group
        scales = need(parts, prefix, ".scales", (torch.float16, torch.bfloat16, torch.float32), _WHAT)
        expect_shape(scales, (g, n), prefix + ".scales", f"{_WHAT} qweight {list(qw.shape)} ([{n}, {k}] in groups "
                                                        f"of {group})")
        qz = need(parts, prefix, ".qzeros", (torch.int32,), _WHAT)
        expect_shape(qz, (g, n // 8), prefix + ".qzeros", f"{_WHAT}: {n} outputs, 8 zero points per int32, {g} "
                                                         f"groups")
        codes = awq_unpack(qw).t()  # [N, K]
        data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        z = awq_unpack(qz).float()  # [G, N]
        s = scales.float()
        return QuantTensor(QuantFormat("int4", group, torch.float32, mins=True), data, s.t().contiguous(),
                           (z * s).t().contiguous(), dtype=dtype)
