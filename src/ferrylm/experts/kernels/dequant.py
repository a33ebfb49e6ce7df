"""Dequantization inside the fused MoE kernels' inner loop: one ``[BLOCK_K, BLOCK_N]`` weight tile of expert ``e``,
read from plain weights or from a :class:`~ferrylm.experts.quantized.QuantTensor`'s fields, as float32 values.

The formats and their values are those of :mod:`ferrylm.experts.quantized` (its ``dequantize`` is the reference the
kernel tests compare against): codes in registers -> ``code * s - m`` / ``(code - zero) * s`` / ``e2m1 * s`` /
``fp8 * s``, ``s`` the group's scale times the row scale. The kernels then round the tile to the activation dtype
before ``tl.dot`` (float32 accumulation), as the reference rounds the dequantized weight to it.

:func:`weight_args` turns a projection (plain tensor or QuantTensor view, any strides) into the kernel arguments;
``QKIND`` and the group size are compile-time constants of a launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrylm.experts.quantized import QuantTensor

QKIND = {None: 0, "int4": 1, "int8": 2, "fp4": 3, "fp8": 4}


def weight_args(w: torch.Tensor | QuantTensor) -> tuple[tuple, dict]:
    """``(tensor and stride arguments, constexpr keywords)`` for one projection ``[X, N, K]``.

    Positional: ``data, scales, mins, row_scale, data strides (e, n, k), scale strides (e, n, g), row-scale strides
    (e, n)``; for a plain tensor the field pointers repeat ``data`` and their strides are 0. Keywords: ``QKIND``,
    ``GROUP``, ``HAS_MINS``, ``HAS_ROW``.
    """
    if not isinstance(w, QuantTensor):
        return (w, w, w, w, *w.stride(), 0, 0, 0, 0, 0), dict(QKIND=0, GROUP=1, HAS_MINS=False, HAS_ROW=False)
    f = w.fmt
    mins = w.mins if w.mins is not None else w.scales
    row = w.row_scale if w.row_scale is not None else w.scales
    rs = w.row_scale.stride() if w.row_scale is not None else (0, 0)
    data = w.data.view(torch.uint8) if f.kind == "fp8" else w.data  # e4m3 decoded from its bits (_e4m3)
    return ((data, w.scales, mins, row, *w.data.stride(), *w.scales.stride(), *rs),
            dict(QKIND=QKIND[f.kind], GROUP=f.group, HAS_MINS=f.mins, HAS_ROW=f.row_scale))


@triton.jit
def _e2m1(c):
    """e2m1 codes (uint8, 0..15) -> float32 values (OCP MX v1.0 §5.3.3: sign bit 3, exponent bits 2-1, mantissa
    bit 0)."""
    mag = c & 7
    ex = mag >> 1
    mt = (mag & 1).to(tl.float32)
    pow2 = tl.where(ex == 3, 4.0, tl.where(ex == 2, 2.0, 1.0))
    v = tl.where(ex == 0, 0.5 * mt, pow2 * (1.0 + 0.5 * mt))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _e4m3(c):
    """float8 e4m3fn bytes (uint8) -> float32, from the bits (exact; NaN codes not expected in weights): sign bit 7,
    exponent bits 6-3 (bias 7), mantissa bits 2-0; exponent 0 is subnormal ``m * 2^-9``."""
    ci = c.to(tl.int32)
    sign = (ci >> 7) << 31
    ex = (ci >> 3) & 15
    man = ci & 7
    normal = (sign | ((ex + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125
    return tl.where(ex == 0, tl.where(sign != 0, -sub, sub), normal)


@triton.jit
def weight_tile(w_ptr, s_ptr, m_ptr, r_ptr, e, n, k0, kk, n_ok, k_ok,
                swe, swn, swk, sse, ssn, ssg, sre, srn,
                QKIND: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_ROW: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """``W[e, n, kk]`` as a ``[BLOCK_K, len(n)]`` tile, ``kk = k0 + arange(BLOCK_K)``: the weight dtype for plain
    weights (``QKIND == 0``), float32 dequantized values otherwise; masked elements are 0. ``e`` int64 scalar. When
    the tile lies in one scale group (``GROUP % BLOCK_K == 0``) one scale per column is loaded, else one per
    element."""
    mask = k_ok[:, None] & n_ok[None, :]
    nn = n[None, :].to(tl.int64)
    kc = kk[:, None].to(tl.int64)
    if QKIND == 0:
        w = tl.load(w_ptr + e * swe + nn * swn + kc * swk, mask=mask, other=0.0)
    else:
        if QKIND == 1 or QKIND == 3:  # two 4-bit codes per byte, element 2j in the low nibble
            b = tl.load(w_ptr + e * swe + nn * swn + (kc // 2) * swk, mask=mask, other=0)
            c = (b >> ((kc % 2) * 4).to(tl.uint8)) & 15
        else:
            c = tl.load(w_ptr + e * swe + nn * swn + kc * swk, mask=mask, other=0)
        if GROUP % BLOCK_K == 0:
            g_idx = k0 // GROUP
            s_off = e * sse + nn * ssn + g_idx * ssg  # [1, BLOCK_N]
            s_mask = n_ok[None, :]
        else:
            s_off = e * sse + nn * ssn + (kc // GROUP) * ssg  # [BLOCK_K, BLOCK_N]
            s_mask = mask
        s = tl.load(s_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
        if HAS_ROW:
            s = s * tl.load(r_ptr + e * sre + nn * srn, mask=n_ok[None, :], other=0.0).to(tl.float32)
        if QKIND == 4:
            w = _e4m3(c) * s
        elif QKIND == 3:
            w = _e2m1(c) * s
        else:
            cf = c.to(tl.float32)
            if HAS_MINS:
                m = tl.load(m_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
                w = cf * s - m
            else:
                w = (cf - (8.0 if QKIND == 1 else 128.0)) * s
    return w
