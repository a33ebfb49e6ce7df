"""GPTQ checkpoints (``quant_method: gptq``, AutoGPTQ / GPTQModel / optimum layout), 4-bit.

Format (AutoGPTQ's ``QuantLinear.pack`` and its torch dequantization; GPTQModel's ``gptq`` / ``gptq_v2``
checkpoint formats), for a linear ``W [N, K]`` (``N`` outputs, ``K`` inputs) and ``G = K / group_size`` groups:

* ``qweight`` int32 ``[K / 8, N]``: input ``k`` of output ``n`` is the 4 bits at ``4 * (k % 8)`` of
  ``qweight[k // 8, n]`` (little-endian), an unsigned code ``q``;
* ``scales`` float16 ``[G, N]``; ``qzeros`` int32 ``[G, N / 8]``: zero point of output ``n`` at bits
  ``4 * (n % 8)`` of ``qzeros[g, n // 8]``;
* ``g_idx`` int32 ``[K]`` (optional): the group of each input; ``k // group_size`` unless act-order reordered it;
* element value ``scales[g, n] * (q - z)`` where ``z`` is the stored zero point plus one in the original ``gptq``
  format (AutoGPTQ stores ``z - 1``), and the stored value itself in ``gptq_v2`` (``checkpoint_format``).

Repack: ``int4`` with mins, ``s = scales`` and ``m = z * s`` in float32 (exact: an 11-bit scale times a 5-bit
integer), the codes regrouped to one row per output (low nibble = even input).

Act-order (``desc_act``) checkpoints, whose ``g_idx`` is not ``k // group_size``: their groups are not contiguous in
``K``. Linears outside the routed experts are dequantized through ``g_idx`` as the reference does (exact in
float32, then one rounding to the model dtype), so dense models and attention load. Routed experts are refused with
a message that says why: a contiguous-group format cannot hold them, and permuting ``K`` at load would need each
expert's input (the hidden state for gate / up) permuted by its own order inside the kernels.
"""

from __future__ import annotations

import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import QuantFormat, QuantTensor
from ferrylm.checkpoints.quant.base import QuantReader, expect_shape, int32_bytes, need, nibbles, same


class GptqReader(QuantReader):
    """See the module docstring."""

    method = "gptq"
    parts = (".qweight", ".qzeros", ".scales", ".g_idx")
    marker = ".qweight"

    def __init__(self, qcfg: dict):
        self.bits = int(qcfg.get("bits", 4))
        if self.bits != 4:
            raise ModelLoadError(f"GPTQ with {self.bits} bits is not supported (4)")
        self.group_size = int(qcfg.get("group_size", 128))
        fmt = qcfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        self.zero_offset = 1 if fmt == "gptq" else 0

    def planned(self):
        return same(QuantFormat("int4", self.group_size if self.group_size > 0 else 128, torch.float32, mins=True))

    def _checked(self, prefix: str, parts: dict[str, torch.Tensor]):
        """``(qweight, scales, qzeros, g_idx or None, k, n, group)`` with every shape checked (names the tensor)."""
        qw = need(parts, prefix, ".qweight", (torch.int32,))
        k, n = qw.shape[0] * 8, qw.shape[1]
        group = k if self.group_size <= 0 else self.group_size
        if k % group:
            raise ModelLoadError(f"{prefix}: K = {k} is not a multiple of the group size {group}")
        g = k // group
        scales = need(parts, prefix, ".scales", (torch.float16, torch.bfloat16, torch.float32))
        expect_shape(scales, (g, n), prefix + ".scales", f"qweight {list(qw.shape)} ([{k}, {n}] in groups of "
                                                        f"{group})")
        qz = need(parts, prefix, ".qzeros", (torch.int32,))
        expect_shape(qz, (g, -(-n // 8)), prefix + ".qzeros", f"{n} outputs, 8 zero points per int32, {g} groups")
        g_idx = parts.get(".g_idx")
        if g_idx is not None:
            expect_shape(g_idx, (k,), prefix + ".g_idx", f"K = {k}")
            if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= g):
                raise ModelLoadError(f"checkpoint tensor {prefix + '.g_idx'!r}: groups outside 0..{g - 1}")
        return qw, scales, qz, g_idx, k, n, group

    def _zeros(self, qz: torch.Tensor, n: int) -> torch.Tensor:
        """``[G, N]`` float32 zero points (the stored value plus the format's offset)."""
        return nibbles(int32_bytes(qz))[:, :n].float() + self.zero_offset

    def decode(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        qw, scales, qz, g_idx, k, n, group = self._checked(prefix, parts)
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
            raise ModelLoadError(f"{prefix}.g_idx: act-order (desc_act) GPTQ routed experts are not supported: their "
                                 f"groups are not contiguous in K, and reordering K at load would need each "
                                 f"expert's input permuted inside the kernels (linears outside the routed experts "
                                 f"load, dequantized)")
        # qweight bytes [K/8, N, 4] -> per output n the K/2 bytes (byte 4i+b of row n = byte b of qweight[i, n])
        data = int32_bytes(qw).view(k // 8, n, 4).permute(1, 0, 2).reshape(n, k // 2).contiguous()
        z = self._zeros(qz, n)  # [G, N]
        s = scales.float()
        return QuantTensor(QuantFormat("int4", group, torch.float32, mins=True), data, s.t().contiguous(),
                           (z * s).t().contiguous(), dtype=dtype)

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """As the base class, and act-order modules too: ``W[n, k] = s[g_idx[k], n] * (q[k, n] - z[g_idx[k],
        n])`` in float32 (exact), ``[N, K]`` in ``dtype``."""
        qw, scales, qz, g_idx, k, n, group = self._checked(prefix, parts)
        if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // group):
            return self.decode(prefix, parts, dtype).dequantize(dtype)
        q = nibbles(int32_bytes(qw)).view(k // 8, n, 8).permute(0, 2, 1).reshape(k, n).float()  # [K, N]
        gi = g_idx.long()
        w = scales.float()[gi] * (q - self._zeros(qz, n)[gi])
        return w.t().contiguous().to(dtype)
