"""NVFP4 weights as the checkpoint formats store them, read into the internal ``fp4`` format: one code path for
compressed-tensors' ``nvfp4-pack-quantized`` and NVIDIA ModelOpt's NVFP4 export.

Both store, for a linear ``W [..., N, K]``:

* the codes: uint8 ``[..., N, K / 2]``, two e2m1 codes per byte, element ``2j`` in the low nibble of byte ``j``;
* the group scales: float8_e4m3fn ``[..., N, K / 16]``, one per 16 consecutive inputs of a row;
* one float32 per-tensor (global) scale, of one value (shape ``[]`` or ``[1]``), that the two formats apply in
  opposite directions: compressed-tensors' ``weight_global_scale`` divides (``e2m1 * s / gs``), ModelOpt's
  ``weight_scale_2`` multiplies (``e2m1 * s * ws2``).

Repack (no value changes): :class:`QuantFormat` ``fp4`` group 16, fp8 scales, ``row_scale`` = the per-tensor
multiplier repeated over the rows (float32). The effective scale of a group is ``float(s) * row_scale``:
ModelOpt's own dequantization computes exactly that product (bit for bit); for compressed-tensors the stored
``1 / gs`` is one float32 rounding away from its division.
"""

from __future__ import annotations

import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts.quantized import QuantFormat, QuantTensor
from ferrylm.checkpoints.quant.base import expect_shape, need

GROUP = 16
FORMAT = QuantFormat("fp4", GROUP, torch.float8_e4m3fn, row_scale=True)


def nvfp4_tensor(prefix: str, parts: dict[str, torch.Tensor], *, data: str, scale: str, global_scale: str,
                 divide: bool, dtype: torch.dtype, what: str) -> QuantTensor:
    """The module ``prefix``'s NVFP4 weight as a :class:`QuantTensor` of :data:`FORMAT`.

    Args:
        prefix: the module's name (for messages). parts: its tensors by suffix.
        data, scale, global_scale: the suffixes of the codes, the group scales and the per-tensor scale.
        divide: True when the per-tensor scale divides (compressed-tensors), False when it multiplies (ModelOpt).
        dtype: the compute dtype. what: the format's name for messages (e.g. ``"ModelOpt NVFP4"``).

    Raises:
        ModelLoadError: a part missing or of the wrong dtype, group scales whose shape is not
            ``[..., N, K / 16]``, a per-tensor scale with more than one value, one that is not finite, or a zero
            divisor (the message names the tensor and the format).
    """
    packed = need(parts, prefix, data, (torch.uint8,), what)
    if packed.dim() < 2:
        raise ModelLoadError(f"checkpoint tensor {prefix + data!r} ({what}): shape {list(packed.shape)} is not "
                             f"[N, K / 2]")
    *lead, n, kp = packed.shape
    k = kp * 2
    if k % GROUP:
        raise ModelLoadError(f"checkpoint tensor {prefix + data!r} ({what}): K = {k} is not a multiple of "
                             f"{GROUP}")
    s = need(parts, prefix, scale, (torch.float8_e4m3fn,), what)
    expect_shape(s, (*lead, n, k // GROUP), prefix + scale,
                 f"its {what} weight {[*lead, n, k]} in groups of {GROUP}")
    gs = need(parts, prefix, global_scale, (torch.float32,), what)
    if gs.numel() != 1:
        raise ModelLoadError(f"checkpoint tensor {prefix + global_scale!r} ({what} per-tensor scale): "
                             f"{gs.numel()} values (shape {list(gs.shape)}); expected 1")
    g = gs.reshape(1).float()
    if not bool(torch.isfinite(g).all()) or (divide and float(g) == 0.0):  # a zero multiplier: an all-zero weight
        raise ModelLoadError(f"checkpoint tensor {prefix + global_scale!r} ({what} per-tensor scale) is "
                             f"{float(g)}; expected a finite{' non-zero' if divide else ''} value")
    row = (1.0 / g if divide else g).expand(*lead, n).contiguous()
    return QuantTensor(FORMAT, packed.contiguous(), s.contiguous(), row_scale=row, dtype=dtype)
