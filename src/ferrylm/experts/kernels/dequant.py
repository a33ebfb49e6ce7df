"""Dequantization inside the fused MoE kernels' inner loop: one ``[BLOCK_K, BLOCK_N]`` weight tile of expert ``e``,
read from plain weights or from a :class:`~ferrylm.experts.quantized.QuantTensor`'s fields, as float32 values.

The formats and their values are those of :mod:`ferrylm.experts.quantized` (its ``dequantize`` is the reference the
kernel tests compare against): codes in registers -> ``code * s - m`` / ``(code - zero) * s`` / ``e2m1 * s`` /
``fp8 * s``, ``s`` the group's scale times the row scale; GGML blocks (``q8_0`` / ``q4_k`` / ``q5_k`` / ``q6_k``, the
file's bytes, layouts in :mod:`ferrylm.experts.gguf_blocks`; ``kmix``: the kind named by the expert's tag) are
decoded from the block bytes themselves: f16 ``d`` / ``dmin`` from their bits, 6-bit K-quant scales and mins
unpacked per element, codes from their nibbles and high bits. The kernels then round the tile to the activation
dtype before ``tl.dot`` (float32 accumulation), as the reference rounds the dequantized weight to it.

:func:`weight_args` turns a projection (plain tensor or QuantTensor view, any strides) into the kernel arguments;
``QKIND`` and the group size are compile-time constants of a launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ferrylm.experts.quantized import QuantTensor

QKIND = {None: 0, "int4": 1, "int8": 2, "fp4": 3, "fp8": 4, "q8_0": 5, "q4_k": 6, "q5_k": 7, "q6_k": 8, "kmix": 9}


def weight_args(w: torch.Tensor | QuantTensor) -> tuple[tuple, dict]:
    """``(tensor and stride arguments, constexpr keywords)`` for one projection ``[X, N, K]``.

    Positional: ``data, scales, mins, row_scale, data strides (e, n, k), scale strides (e, n, g), row-scale strides
    (e, n)``; for a plain tensor the field pointers repeat ``data`` and their strides are 0. Keywords: ``QKIND``,
    ``GROUP``, ``HAS_MINS``, ``HAS_ROW``.
    """
    if not isinstance(w, QuantTensor):
        return (w, w, w, w, *w.stride(), 0, 0, 0, 0, 0), dict(QKIND=0, GROUP=1, HAS_MINS=False, HAS_ROW=False)
    f = w.fmt
    if f.is_block:  # one field: the blocks' bytes (byte offsets computed in the kernel, unit stride along a row)
        if w.data.stride(-1) != 1:
            raise ValueError(f"{f.describe()} rows must be contiguous along K (stride {w.data.stride(-1)})")
        d = w.data
        if f.kind == "kmix":  # the per-expert tag rides in the scales slot (its expert stride in sse)
            return ((d, w.tag, d, d, *d.stride(), w.tag.stride(0), 0, 0, 0, 0),
                    dict(QKIND=9, GROUP=f.group, HAS_MINS=False, HAS_ROW=False))
        return ((d, d, d, d, *d.stride(), 0, 0, 0, 0, 0),
                dict(QKIND=QKIND[f.kind], GROUP=f.group, HAS_MINS=False, HAS_ROW=False))
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
    sub = ((man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(ex == 0, sub, normal)


@triton.jit
def _u8(p, off, mask):
    """Bytes at ``p + off`` as int32 (0 where masked)."""
    return tl.load(p + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, off, mask):
    """The little-endian float16 at bytes ``p + off`` as float32, from its bits (IEEE 754 binary16: sign bit 15,
    exponent bits 14-10 (bias 15), mantissa bits 9-0; exponent 0 is subnormal ``m * 2^-24``)."""
    bits = _u8(p, off, mask) | (_u8(p, off + 1, mask) << 8)
    sign = (bits >> 15) << 31
    ex = (bits >> 10) & 31
    man = bits & 1023
    f32_ex = tl.where(ex == 31, 255, ex + 112)
    normal = (sign | (f32_ex << 23) | (man << 13)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 5.960464477539063e-08
    return tl.where(ex == 0, tl.where(sign != 0, -sub, sub), normal)


@triton.jit
def _k4_scale_min(p, base, j, mask):
    """Sub-block ``j``'s 6-bit scale and min of a Q4_K / Q5_K block at bytes ``p + base`` (``scales[12]`` at offset
    4; ggml's ``get_scale_min_k4``), as float32."""
    x = _u8(p, base + 8 + j, mask)        # scales[j + 4]
    y = _u8(p, base + 4 + (j & 3), mask)  # scales[j % 4]
    z = _u8(p, base + 4 + j, mask)        # scales[j]
    lo = j < 4
    sc = tl.where(lo, y & 63, (x & 15) | ((y >> 6) << 4))
    mn = tl.where(lo, x & 63, (x >> 4) | ((z >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _spread(x, ROWS: tl.constexpr, N: tl.constexpr):
    """``x [G, N]`` repeated ``ROWS`` times along a new middle axis, flattened: ``[G * ROWS, N]``."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], (x.shape[0], ROWS, N)), (x.shape[0] * ROWS, N))


@triton.jit
def _block_tile_aligned(w_ptr, blk, n_ok, k_ok, k0, QKIND: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_K: tl.constexpr, N: tl.constexpr):
    """Float32 values of one K tile of GGML block rows whose layout the tile follows (:func:`aligned_blocks`): each
    byte is loaded once and its fields are spread over the elements in registers (a Q4_K tile of 128 loads its 64
    code bytes and its sub-blocks' scale bytes and f16s once per column, not 3 bytes per element). ``blk [1, N]``:
    byte offset of the tile's block (Q8_0: of its first block) in each column; ``k_ok [BLOCK_K]``."""
    cm = n_ok[None, :]
    if QKIND == 5:  # Q8_0: BLOCK_K // 32 whole blocks of (f16 d, 32 int8)
        G: tl.constexpr = BLOCK_K // 32
        g_ok = tl.max(tl.reshape(k_ok.to(tl.int32), (G, 32)), 1) > 0
        gm = g_ok[:, None] & cm                                                  # [G, N]
        base = blk + (tl.arange(0, G) * 34)[:, None]                            # [G, N]
        d = _f16(w_ptr, base, gm)
        off = tl.reshape(base[:, None, :] + 2 + tl.arange(0, 32)[None, :, None], (BLOCK_K, N))
        q = _u8(w_ptr, off, k_ok[:, None] & cm)
        q = tl.where(q >= 128, q - 256, q)
        w = _spread(d, 32, N) * q.to(tl.float32)
    elif QKIND == 8:  # Q6_K, a tile inside one 128-element half: d * scales[v / 16] * (q - 32)
        t0 = k0 % GROUP
        h = t0 // 128
        r0 = t0 % 128
        R: tl.constexpr = BLOCK_K // 64
        ql = _u8(w_ptr, blk + 64 * h + tl.arange(0, 64)[:, None], cm)                   # [64, N]
        lo_sh = (4 * (r0 // 64 + tl.arange(0, R)))[:, None, None]
        low = tl.reshape((ql[None, :, :] >> lo_sh) & 15, (BLOCK_K, N))
        qh = _u8(w_ptr, blk + 128 + 32 * h + tl.arange(0, 32)[:, None], cm)             # [32, N]
        hi_sh = (2 * (r0 // 32 + tl.arange(0, BLOCK_K // 32)))[:, None, None]
        high = tl.reshape((qh[None, :, :] >> hi_sh) & 3, (BLOCK_K, N))
        sc = _u8(w_ptr, blk + 192 + t0 // 16 + tl.arange(0, BLOCK_K // 16)[:, None], cm)  # [S, N]
        sc = tl.where(sc >= 128, sc - 256, sc)
        s = _f16(w_ptr, blk + 208, cm) * sc.to(tl.float32)
        w = _spread(s, 16, N) * ((low | (high << 4)) - 32).to(tl.float32)
    else:  # Q4_K / Q5_K, a tile of whole 64-element pairs of sub-blocks: d * sc * q - dmin * mn
        t0 = k0 % GROUP
        P: tl.constexpr = BLOCK_K // 64
        J: tl.constexpr = BLOCK_K // 32
        QS: tl.constexpr = 16 if QKIND == 6 else 48
        b = _u8(w_ptr, blk + QS + t0 // 2 + tl.arange(0, BLOCK_K // 2)[:, None], cm)   # [BLOCK_K / 2, N]
        b3 = tl.reshape(b, (P, 32, N))
        q = tl.reshape(tl.permute(tl.join(b3 & 15, b3 >> 4), (0, 3, 1, 2)), (BLOCK_K, N))
        j = t0 // 32 + tl.arange(0, J)[:, None]                                          # [J, 1]
        if QKIND == 7:
            qh = _u8(w_ptr, blk + 16 + tl.arange(0, 32)[:, None], cm)                     # [32, N]
            q = q | tl.reshape(((qh[None, :, :] >> j[:, :, None]) & 1) << 4, (BLOCK_K, N))
        sc, mn = _k4_scale_min(w_ptr, blk, j, cm)                                       # [J, N]
        s = _f16(w_ptr, blk, cm) * sc
        m = _f16(w_ptr, blk + 2, cm) * mn
        w = _spread(s, 32, N) * q.to(tl.float32) - _spread(m, 32, N)
    return w


@triton.jit
def _block_tile(w_ptr, e, nn, n_ok, k_ok, kc, k0, mask, swe, swn, QKIND: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Float32 values of elements ``(kc, nn)`` of GGML block rows (layouts: :mod:`ferrylm.experts.gguf_blocks`).
    When the K tile lies in one block (``GROUP % BLOCK_K == 0``) the block's f16 fields are loaded once per column."""
    BB: tl.constexpr = 34 if QKIND == 5 else (144 if QKIND == 6 else (176 if QKIND == 7 else 210))  # block bytes
    # the tile follows the block layout: whole Q8_0 blocks, Q4_K / Q5_K pairs of sub-blocks, a Q6_K half's part
    ALIGNED: tl.constexpr = (QKIND == 5 and BLOCK_K % 32 == 0) or (
        QKIND != 5 and GROUP % BLOCK_K == 0 and BLOCK_K % 64 == 0 and (QKIND != 8 or BLOCK_K <= 128))
    if ALIGNED:
        w = _block_tile_aligned(w_ptr, e * swe + nn * swn + (k0 // GROUP) * BB, n_ok, k_ok, k0, QKIND, GROUP,
                                BLOCK_K, nn.shape[1])
    else:
        if GROUP % BLOCK_K == 0:
            base_c = e * swe + nn * swn + (k0 // GROUP) * BB  # [1, BLOCK_N]
            c_mask = n_ok[None, :]
        else:
            base_c = e * swe + nn * swn + (kc // GROUP) * BB  # [BLOCK_K, BLOCK_N]
            c_mask = mask
        base = e * swe + nn * swn + (kc // GROUP) * BB
        v = kc % GROUP
        if QKIND == 5:  # Q8_0: d * int8
            q = _u8(w_ptr, base + 2 + v, mask)
            q = tl.where(q >= 128, q - 256, q)
            w = _f16(w_ptr, base_c, c_mask) * q.to(tl.float32)
        elif QKIND == 8:  # Q6_K: d * scales[v / 16] * (q - 32)
            h = v // 128
            r = v % 128
            low = (_u8(w_ptr, base + 64 * h + r % 64, mask) >> (4 * (r // 64))) & 15
            high = (_u8(w_ptr, base + 128 + 32 * h + r % 32, mask) >> (2 * (r // 32))) & 3
            sc = _u8(w_ptr, base + 192 + v // 16, mask)
            sc = tl.where(sc >= 128, sc - 256, sc)
            s = _f16(w_ptr, base_c + 208, c_mask) * sc.to(tl.float32)
            w = s * ((low | (high << 4)) - 32).to(tl.float32)
        else:  # Q4_K / Q5_K: d * sc * q - dmin * mn
            j = v // 32
            l = v % 32
            sc, mn = _k4_scale_min(w_ptr, base, j, mask)
            s = _f16(w_ptr, base_c, c_mask) * sc
            m = _f16(w_ptr, base_c + 2, c_mask) * mn
            if QKIND == 6:
                q = (_u8(w_ptr, base + 16 + 32 * (j // 2) + l, mask) >> (4 * (j % 2))) & 15
            else:
                q = (_u8(w_ptr, base + 48 + 32 * (j // 2) + l, mask) >> (4 * (j % 2))) & 15
                q = q | (((_u8(w_ptr, base + 16 + l, mask) >> j) & 1) << 4)
            w = s * q.to(tl.float32) - m
    return tl.where(mask, w, 0.0)


@triton.jit
def _codes(w_ptr, base, nn, kk, k0, n_ok, k_ok, swn, swk, QKIND: tl.constexpr, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_K, len(n)]`` codes of a quantized tile. 4-bit kinds: the ``BLOCK_K / 2`` bytes of each column are
    loaded once (contiguous along k), split into low / high nibbles and interleaved back (element ``2j`` is the low
    nibble of byte ``j``), instead of loading every byte twice through a ``k // 2`` gather."""
    if QKIND == 1 or QKIND == 3:
        j = (k0 // 2 + tl.arange(0, BLOCK_K // 2))[:, None].to(tl.int64)
        even_ok, _ = tl.split(tl.reshape(k_ok, (BLOCK_K // 2, 2)))  # byte j holds elements 2j, 2j + 1 (K even)
        b = tl.load(w_ptr + base + nn * swn + j * swk, mask=even_ok[:, None] & n_ok[None, :], other=0)
        c = tl.reshape(tl.permute(tl.join(b & 15, b >> 4), (0, 2, 1)), (BLOCK_K, b.shape[1]))
    else:
        kc = kk[:, None].to(tl.int64)
        c = tl.load(w_ptr + base + nn * swn + kc * swk, mask=k_ok[:, None] & n_ok[None, :], other=0)
    return c


@triton.jit
def weight_values(w_ptr, e, n, k0, kk, n_ok, k_ok, swe, swn, swk, QKIND: tl.constexpr, HAS_MINS: tl.constexpr,
                  BLOCK_K: tl.constexpr, HW_FP8: tl.constexpr):
    """The ``[BLOCK_K, len(n)]`` element values of a code-and-scale tile (``QKIND`` 1-4) BEFORE scaling: ``u - 8`` /
    ``u - 128`` (no mins) or ``u`` (mins) and e2m1 values as float32; fp8 as ``tl.float8e4nv`` through the
    hardware conversion when ``HW_FP8`` (sm89+: the caller's ``.to`` is one ``cvt`` per pair of elements), else
    decoded from the bits as float32. Every value is exact in bfloat16 / float16 (at most 8 significant bits).
    Masked elements hold the value of code 0 (finite): callers mask the activations or the columns instead."""
    c = _codes(w_ptr, e * swe, n[None, :].to(tl.int64), kk, k0, n_ok, k_ok, swn, swk, QKIND, BLOCK_K)
    if QKIND == 4:
        if HW_FP8:
            v = c.to(tl.float8e4nv, bitcast=True)
        else:
            v = _e4m3(c)
    elif QKIND == 3:
        v = _e2m1(c)
    else:
        v = c.to(tl.float32)
        if not HAS_MINS:
            v = v - (8.0 if QKIND == 1 else 128.0)
    return v


@triton.jit
def column_scale(s_ptr, r_ptr, e, n, k0, n_ok, sse, ssn, ssg, sre, srn, GROUP: tl.constexpr,
                 HAS_ROW: tl.constexpr):
    """``[1, len(n)]`` float32: the scale of group ``k0 // GROUP`` of each column (times the row scale when
    ``HAS_ROW``), for a K tile that lies inside one group; 0 for masked columns."""
    nn = n[None, :].to(tl.int64)
    s_off = e * sse + nn * ssn + (k0 // GROUP) * ssg
    s = tl.load(s_ptr + s_off, mask=n_ok[None, :], other=0.0).to(tl.float32)
    if HAS_ROW:
        s = s * tl.load(r_ptr + e * sre + nn * srn, mask=n_ok[None, :], other=0.0).to(tl.float32)
    return s


def scale_after_dot(kind: dict, block_k: int) -> bool:
    """Whether a launch over a projection of constexprs ``kind`` (:func:`weight_args`) with K tiles of ``block_k``
    applies the group scale after the dot (``acc += (a @ v) * s``, one multiply per output instead of one per
    weight element, as the block-FP8 GEMMs of DeepGEMM / vLLM do): code-and-scale kinds without mins whose group
    holds whole K tiles. The values are exact in the activation dtype, so the only change from scaling first is that
    the scaled weight is no longer rounded to that dtype (the float32 product is kept)."""
    return kind["QKIND"] in (1, 2, 3, 4) and not kind["HAS_MINS"] and kind["GROUP"] % block_k == 0


def hardware_fp8(device: torch.device) -> bool:
    """Whether Triton converts float8 e4m3 in hardware on ``device`` (CUDA compute capability 8.9 or newer); the
    interpreter and older GPUs decode the bits. Asked at every launch: the capability is looked up once per
    device."""
    return device.type == "cuda" and _capability(device.index if device.index is not None
                                                  else torch.cuda.current_device()) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@triton.jit
def tile_dot(acc, a, w_ptr, s_ptr, m_ptr, r_ptr, e, n, k0, kk, n_ok, k_ok,
             swe, swn, swk, sse, ssn, ssg, sre, srn,
             QKIND: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_ROW: tl.constexpr,
             BLOCK_K: tl.constexpr, HW_FP8: tl.constexpr, SCALE_AFTER: tl.constexpr, PRECISION: tl.constexpr):
    """``acc [BLOCK_M, BLOCK_N] + a [BLOCK_M, BLOCK_K] @ W[e, n, kk]^T`` in float32, for one K tile of one
    projection (the fused MoE kernels' inner step). ``SCALE_AFTER`` (:func:`scale_after_dot`): the tile's unscaled
    values (exact in ``a``'s dtype) go into the dot and the group scale multiplies its result; otherwise the
    dequantized tile (:func:`weight_tile`) is rounded to ``a``'s dtype, then multiplied."""
    if SCALE_AFTER:
        v = weight_values(w_ptr, e, n, k0, kk, n_ok, k_ok, swe, swn, swk, QKIND, HAS_MINS, BLOCK_K, HW_FP8)
        acc += tl.dot(a, v.to(a.dtype), input_precision=PRECISION) * column_scale(
            s_ptr, r_ptr, e, n, k0, n_ok, sse, ssn, ssg, sre, srn, GROUP, HAS_ROW)
    else:
        b = weight_tile(w_ptr, s_ptr, m_ptr, r_ptr, e, n, k0, kk, n_ok, k_ok, swe, swn, swk, sse, ssn, ssg, sre,
                        srn, QKIND, GROUP, HAS_MINS, HAS_ROW, BLOCK_K, HW_FP8)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
    return acc


@triton.jit
def weight_tile(w_ptr, s_ptr, m_ptr, r_ptr, e, n, k0, kk, n_ok, k_ok,
                swe, swn, swk, sse, ssn, ssg, sre, srn,
                QKIND: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_ROW: tl.constexpr,
                BLOCK_K: tl.constexpr, HW_FP8: tl.constexpr):
    """``W[e, n, kk]`` as a ``[BLOCK_K, len(n)]`` tile, ``kk = k0 + arange(BLOCK_K)``: the weight dtype for plain
    weights (``QKIND == 0``), float32 dequantized values otherwise (``QKIND >= 5``: GGML blocks, ``GROUP`` their
    element count, bytes at unit stride along a row, ``swk`` unused; ``QKIND == 9``: ``kmix``, the expert's kind
    read from its tag byte at ``s_ptr + e * sse``); masked elements are 0. ``e`` int64 scalar. When the tile lies in
    one scale group (``GROUP % BLOCK_K == 0``) one scale per column is loaded; when it spans whole groups
    (``BLOCK_K % GROUP == 0``) one per group and column, broadcast over the group's rows in registers; else one per
    element."""
    mask = k_ok[:, None] & n_ok[None, :]
    nn = n[None, :].to(tl.int64)
    kc = kk[:, None].to(tl.int64)
    if QKIND == 0:
        w = tl.load(w_ptr + e * swe + nn * swn + kc * swk, mask=mask, other=0.0)
    elif QKIND == 9:  # kmix: the expert's K-quant kind from its tag byte (one branch per program)
        tag = tl.load(s_ptr + e * sse)
        if tag == 6:
            w = _block_tile(w_ptr, e, nn, n_ok, k_ok, kc, k0, mask, swe, swn, 6, GROUP, BLOCK_K)
        elif tag == 7:
            w = _block_tile(w_ptr, e, nn, n_ok, k_ok, kc, k0, mask, swe, swn, 7, GROUP, BLOCK_K)
        else:
            w = _block_tile(w_ptr, e, nn, n_ok, k_ok, kc, k0, mask, swe, swn, 8, GROUP, BLOCK_K)
    elif QKIND >= 5:
        w = _block_tile(w_ptr, e, nn, n_ok, k_ok, kc, k0, mask, swe, swn, QKIND, GROUP, BLOCK_K)
    else:
        v = weight_values(w_ptr, e, n, k0, kk, n_ok, k_ok, swe, swn, swk, QKIND, HAS_MINS, BLOCK_K,
                          HW_FP8).to(tl.float32)
        if GROUP % BLOCK_K == 0:  # the tile is inside one group: a scale per column
            s = column_scale(s_ptr, r_ptr, e, n, k0, n_ok, sse, ssn, ssg, sre, srn, GROUP, HAS_ROW)
            if HAS_MINS:
                s_off = e * sse + nn * ssn + (k0 // GROUP) * ssg  # [1, BLOCK_N]
                m = tl.load(m_ptr + s_off, mask=n_ok[None, :], other=0.0).to(tl.float32)
                w = v * s - m
            else:
                w = v * s
        elif BLOCK_K % GROUP == 0:  # whole groups: [BLOCK_K / GROUP, BLOCK_N] scales, broadcast in registers
            g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            s_off = e * sse + nn * ssn + g[:, None].to(tl.int64) * ssg  # [G, BLOCK_N]
            g_ok = tl.max(tl.reshape(k_ok.to(tl.int32), (BLOCK_K // GROUP, GROUP)), 1) > 0
            gm = g_ok[:, None] & n_ok[None, :]
            s = tl.load(s_ptr + s_off, mask=gm, other=0.0).to(tl.float32)
            if HAS_ROW:
                s = s * tl.load(r_ptr + e * sre + nn * srn, mask=n_ok[None, :], other=0.0).to(tl.float32)
            v3 = tl.reshape(v, (BLOCK_K // GROUP, GROUP, v.shape[1]))
            if HAS_MINS:
                m = tl.load(m_ptr + s_off, mask=gm, other=0.0).to(tl.float32)
                w3 = v3 * s[:, None, :] - m[:, None, :]
            else:
                w3 = v3 * s[:, None, :]
            w = tl.reshape(w3, (BLOCK_K, v.shape[1]))
        else:  # a group size that does not divide the tile: one scale per element
            s_off = e * sse + nn * ssn + (kc // GROUP) * ssg
            s = tl.load(s_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
            if HAS_ROW:
                s = s * tl.load(r_ptr + e * sre + nn * srn, mask=n_ok[None, :], other=0.0).to(tl.float32)
            if HAS_MINS:
                m = tl.load(m_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
                w = v * s - m
            else:
                w = v * s
        w = tl.where(mask, w, 0.0)
    return w
