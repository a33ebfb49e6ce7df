"""compressed-tensors checkpoints (``quant_method: compressed-tensors``): pack-quantized int, NVFP4, MXFP4.

Formats (the ``compressed-tensors`` package, v0.20: ``compressors/pack_quantized``, ``compressors/nvfp4``,
``compressors/mxfp4``; checked against its own decompressors in the tests):

* ``pack-quantized`` (W4A16 / W8A16, ``type: int``): ``weight_packed`` int32 ``[N, K * b / 32]`` holds element
  ``i`` of a row at bit ``b * i`` of the row's little-endian bit stream (``pack_to_int32``), stored as the
  unsigned ``q + 2^(b-1)``; ``weight_scale`` ``[N, K / group]`` (``[N, 1]`` for the channel strategy);
  ``weight_shape`` ``[2]``; asymmetric schemes add ``weight_zero_point`` packed the same way along ``N``
  (``[N * b / 32, K / group]``). Element value: ``(q - zp) * scale``.
* ``nvfp4-pack-quantized``: ``weight_packed`` uint8 ``[N, K / 2]`` (e2m1 pairs, low nibble first),
  ``weight_scale`` float8_e4m3fn ``[N, K / 16]``, ``weight_global_scale`` float32 ``[1]``; value
  ``e2m1 * scale / global_scale``.
* ``mxfp4-pack-quantized``: as NVFP4 with ``weight_scale`` uint8 E8M0 ``[N, K / 32]`` (value ``2^(s - 127)``) and
  no global scale.
* ``float-quantized`` (the ``*-FP8-dynamic`` / ``*-FP8`` checkpoints; ``naive-quantized`` with float weights is the
  same layout; ``compressors/naive_quantized``): ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale``
  (bfloat16 / float32) by ``strategy``: ``tensor`` ``[1]``, ``channel`` ``[N, 1]``, ``block`` ``[ceil(N / bn),
  ceil(K / bk)]`` for ``block_structure [bn, bk]``, ``group`` ``[N, K / group_size]``; value ``float(weight) * scale``. Input activations are
  quantized dynamically at run time by the kernels that read these (``input_activations.dynamic``), or have a
  static ``input_scale``: either way nothing of them changes the weights, and ferrylm computes with activations in
  the model dtype, so ``input_scale`` is not used.

Repacks (no value changes): int 4-bit -> ``int4`` (the packed bytes are already low-nibble-first unsigned codes),
8-bit -> ``int8``; symmetric keeps the file's scales, asymmetric stores ``mins = uz * s`` in float32 (exact);
NVFP4 -> ``fp4`` group 16 with fp8 scales and ``row_scale = 1 / global_scale`` (one float32 rounding: the
reference divides, we multiply, so values agree to float32 rounding; :mod:`.nvfp4`, shared with ModelOpt's NVFP4);
MXFP4 -> ``fp4`` group 32 with the E8M0 scales as bfloat16 (exact); float-quantized -> ``fp8`` (group ``K`` for
tensor and channel, ``bk`` for block, the group size for group, float32 scales:
:func:`~ferrylm.checkpoints.quant.fp8.fp8_tensor`, exact).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import ExpertQuant, QuantFormat, QuantTensor
from ferrylm.checkpoints.quant.base import QuantReader, e8m0_to_bf16, expect_shape, int32_bytes, need, nibbles, same
from ferrylm.checkpoints.quant.fp8 import FP8_STRATEGIES, fp8_block_dense, fp8_tensor
from ferrylm.checkpoints.quant.nvfp4 import FORMAT as NVFP4_FORMAT, nvfp4_tensor

FORMATS = ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized", "float-quantized", "naive-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
#: the parts of a float-quantized module (its weight keeps the name ``weight``; the scale marks it quantized)
FLOAT_PARTS = (".weight", ".weight_scale", ".weight_zero_point", ".input_scale", ".input_zero_point")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class CompressedTensorsReader(QuantReader):
    """See the module docstring. One weight scheme for the whole checkpoint (every config group alike)."""

    method = "compressed-tensors"
    parts = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_global_scale",
             ".input_global_scale", ".input_scale", ".weight_g_idx")
    marker = ".weight_packed"

    def __init__(self, qcfg: dict):
        groups = qcfg.get("config_groups") or {}
        schemes = []
        for name, g in groups.items():
            w = (g or {}).get("weights")
            if w:
                schemes.append((name, g.get("format") or qcfg.get("format"), w))
        if not schemes:
            raise ModelLoadError("compressed-tensors quantization_config has no config group with weights")
        first = schemes[0]
        for name, fmt, w in schemes[1:]:
            if (fmt, w) != first[1:]:
                raise ModelLoadError(f"compressed-tensors config groups {first[0]!r} and {name!r} quantize weights "
                                     f"differently; one weight scheme per checkpoint is supported")
        self.format, w = first[1], first[2]
        if self.format not in FORMATS:
            raise ModelLoadError(f"compressed-tensors format {self.format!r} is not supported; supported: "
                                 f"{', '.join(FORMATS)}")
        self.bits = int(w.get("num_bits", 0))
        self.type = w.get("type", "int")
        self.symmetric = bool(w.get("symmetric", True))
        self.strategy = w.get("strategy")
        self.group_size = w.get("group_size")
        if w.get("actorder") not in (None, False, "static", "weight"):
            raise ModelLoadError(f"compressed-tensors activation ordering {w.get('actorder')!r} is not supported")
        self.block = None
        if self.format in FLOAT_FORMATS:
            self._init_float(w)
        elif self.format == "pack-quantized":
            if self.type != "int" or self.bits not in (4, 8) or self.strategy not in ("group", "channel"):
                raise ModelLoadError(f"compressed-tensors pack-quantized {self.type} {self.bits}-bit "
                                     f"{self.strategy} is not supported (int, 4 or 8 bits, group or channel)")
        elif not (self.type == "float" and self.bits == 4 and self.symmetric):
            raise ModelLoadError(f"compressed-tensors {self.format} with {self.type} {self.bits}-bit weights is "
                                 f"not supported")

    def _init_float(self, w: dict) -> None:
        """Checks of a float-quantized scheme; sets :attr:`block` and the module parts of this format."""
        if not (self.type == "float" and self.bits == 8 and self.symmetric):
            raise ModelLoadError(f"compressed-tensors {self.format} with {self.type} {self.bits}-bit "
                                 f"{'symmetric' if self.symmetric else 'asymmetric'} weights is not supported "
                                 f"(float 8-bit symmetric: FP8 e4m3)")
        if self.strategy not in FP8_STRATEGIES:
            raise ModelLoadError(f"compressed-tensors {self.format} weight strategy {self.strategy!r} is not "
                                 f"supported; supported: {', '.join(FP8_STRATEGIES)}")
        if self.strategy == "group" and not self.group_size:
            raise ModelLoadError(f"compressed-tensors {self.format} group strategy without a group_size")
        if self.strategy == "block":
            b = w.get("block_structure")
            if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(int(x) > 0 for x in b)):
                raise ModelLoadError(f"compressed-tensors {self.format} block strategy without a block_structure "
                                     f"[bn, bk] (got {b!r})")
            self.block = (int(b[0]), int(b[1]))
        self.parts, self.marker = FLOAT_PARTS, ".weight_scale"

    def planned(self):
        if self.format in FLOAT_FORMATS:  # tensor / channel: group K, unknown here (the scales are a few bytes)
            group = self.block[1] if self.block else int(self.group_size or 128)
            return same(QuantFormat("fp8", group, torch.float32))
        if self.format.startswith("nvfp4"):
            return same(NVFP4_FORMAT)
        if self.format.startswith("mxfp4"):
            return same(QuantFormat("fp4", 32, torch.bfloat16))
        group = int(self.group_size or 128)  # channel strategy: one group per row, K unknown here
        kind = "int4" if self.bits == 4 else "int8"
        if self.symmetric:
            return same(QuantFormat(kind, group, torch.bfloat16))
        return same(QuantFormat(kind, group, torch.float32, mins=True))

    def planned_for(self, hidden: int, inter: int):
        planned = self.planned()
        if self.strategy not in ("tensor", "channel"):
            return planned
        return ExpertQuant(replace(planned.gate_up, group=hidden), replace(planned.down, group=inter))

    def decode(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        if self.format == "pack-quantized":
            return self._decode_int(prefix, parts, dtype)
        if self.format in FLOAT_FORMATS:
            w, s, block, what = self._float_parts(prefix, parts)
            return fp8_tensor(prefix, w, s, ".weight_scale", self.strategy, block, dtype, what)
        packed = need(parts, prefix, ".weight_packed", (torch.uint8,))
        n, k = packed.shape[0], packed.shape[1] * 2
        group = 16 if self.format.startswith("nvfp4") else 32
        if self.group_size not in (None, group):
            raise ModelLoadError(f"{self.format} with group size {self.group_size} is not supported ({group})")
        if self.format.startswith("nvfp4"):
            return nvfp4_tensor(prefix, parts, data=".weight_packed", scale=".weight_scale",
                                global_scale=".weight_global_scale", divide=True, dtype=dtype,
                                what="compressed-tensors nvfp4-pack-quantized")
        s = need(parts, prefix, ".weight_scale", (torch.uint8,))
        expect_shape(s, (n, k // group), prefix + ".weight_scale", f"its weight [{n}, {k}] in groups of 32")
        return QuantTensor(QuantFormat("fp4", 32, torch.bfloat16), packed.contiguous(), e8m0_to_bf16(s),
                           dtype=dtype)

    def _float_parts(self, prefix: str, parts: dict[str, torch.Tensor]):
        """``(weight, scale, block or None, format name)`` of a float-quantized module, dtypes checked."""
        if ".weight_zero_point" in parts and bool(parts[".weight_zero_point"].ne(0).any()):
            raise ModelLoadError(f"checkpoint tensor {prefix + '.weight_zero_point'!r}: non-zero FP8 zero points "
                                 f"are not supported (compressed-tensors {self.format})")
        what = f"compressed-tensors {self.format} {self.strategy}"
        w = need(parts, prefix, ".weight", (torch.float8_e4m3fn,), what)
        s = need(parts, prefix, ".weight_scale", _FLOATS, what)
        block = self.block or ((1, int(self.group_size)) if self.strategy == "group" else None)
        return w, s, block, what

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """As the base class; a block-scaled FP8 linear whose ``K`` is not a multiple of the block is cut at its
        edge blocks (it is never a routed expert's format, so any ``K`` is fine)."""
        if self.format in FLOAT_FORMATS and self.strategy == "block":
            w, s, block, what = self._float_parts(prefix, parts)
            *lead, n, k = w.shape
            expect_shape(s, (*lead, -(-n // block[0]), -(-k // block[1])), prefix + ".weight_scale",
                         f"its {what} weight {list(w.shape)} in {block[0]}x{block[1]} blocks")
            return fp8_block_dense(w, s, block, dtype)
        return super().dequantize(prefix, parts, dtype)

    def _decode_int(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> QuantTensor:
        b = self.bits
        packed = need(parts, prefix, ".weight_packed", (torch.int32,))
        shape = parts.get(".weight_shape")
        n = packed.shape[0]
        k = int(shape.reshape(-1)[1]) if shape is not None else packed.shape[1] * 32 // b
        if k % 8 or packed.shape[1] * 32 != k * b or (shape is not None and int(shape.reshape(-1)[0]) != n):
            raise ModelLoadError(f"checkpoint tensor {prefix + '.weight_packed'!r}: shape {list(packed.shape)} "
                                 f"does not hold a [{n}, {k}] weight of {b}-bit values (K must be a multiple of 8)")
        group = k if self.strategy == "channel" else int(self.group_size)
        if k % group:
            raise ModelLoadError(f"{prefix}: K = {k} is not a multiple of the group size {group}")
        s = need(parts, prefix, ".weight_scale", _FLOATS)
        expect_shape(s, (n, k // group), prefix + ".weight_scale", f"its weight [{n}, {k}] in groups of {group}")
        data = int32_bytes(packed)  # [N, K * b / 8]: unsigned codes, low nibble first
        kind = "int4" if b == 4 else "int8"
        if self.symmetric:
            return QuantTensor(QuantFormat(kind, group, s.dtype), data, s.contiguous(), dtype=dtype)
        zp = need(parts, prefix, ".weight_zero_point", (torch.int32,))
        expect_shape(zp, (-(-n * b // 32), k // group), prefix + ".weight_zero_point",
                     f"{n} rows of {b}-bit zero points packed along the rows, {k // group} groups")
        zb = int32_bytes(zp.t())  # [G, ceil(N b / 32) * 4]: unsigned zero points along N
        uz = (nibbles(zb) if b == 4 else zb)[:, :n].t().float()  # [N, G]
        sf = s.float()
        return QuantTensor(QuantFormat(kind, group, torch.float32, mins=True), data, sf.contiguous(),
                           (uz * sf).contiguous(), dtype=dtype)
