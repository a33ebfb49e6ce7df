"""GGUF expert blocks decoded into integer codes, scales and mins, and repacked without loss into element formats.

Serving a MoE GGUF reads the file itself (:mod:`ferrylm.checkpoints.quant.gguf_file`, experts kept as GGML blocks); it
uses this module for a projection whose layers mix types (:func:`unified_format` + :func:`repack`) and for MXFP4
experts (:func:`repack_mxfp4`). The stacked expert tensors ``blk.N.ffn_{gate,up,down}_exps`` are ``[E, I, H]`` /
``[E, H, I]`` in PyTorch order. Block layouts (ggml's ``ggml-common.h`` / ``ggml-quants.c``, and gguf-py's ``quants.py`` whose ``dequantize`` the tests compare against):

* ``Q8_0``: blocks of 32: ``d`` float16, 32 int8 ``q``; ``w = d * q``. -> ``int8`` group 32, float16 scales,
  code ``q + 128``.
* ``Q6_K``: super-blocks of 256: ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2 bits), ``scales[16]`` int8 (one per
  16), ``d`` float16; ``w = d * sc * (q - 32)`` with ``q`` 6 bits. Element ``v = 128h + 64s + t`` (``t < 64``) has
  its low bits in nibble ``s`` of ``ql[64h + t]``; element ``128h + 32s + l`` its high bits at ``2s`` of
  ``qh[32h + l]``. -> ``int8`` group 16, float32 scales ``d * sc`` (exact), code ``q - 32 + 128``.
* ``Q4_K``: super-blocks of 256: ``d``, ``dmin`` float16, ``scales[12]`` (6-bit scale and min of 8 sub-blocks of
  32, unpacked by gguf-py's ``Q4_K.get_scale_min``), ``qs[128]``: chunk ``c`` of 64 elements is 32 bytes, low
  nibbles the first 32 elements, high nibbles the next 32; ``w = d * sc * q - dmin * m``. -> ``int4`` group 32
  with mins, float32 ``s = d * sc`` and ``m = dmin * m`` (exact products; the one rounding is the subtraction, as
  in the reference).

When one projection (gate and up together, or down) has several of these types across layers (llama.cpp's
``Q4_K_M`` puts ``Q6_K`` in some layers' ``ffn_down_exps``), every layer of it becomes ``int8`` with float32
scales and mins at the finest group of the types (still exact: each type's ``(q - z) * s`` is ``q * s - z * s``
with both products exact in float32).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ferrylm.experts.quantized import QuantFormat, QuantTensor
from ferrylm.checkpoints.gguf_reader import GGUFTensor

_QK_K = 256


# --------------------------------------------------------------------------------------------------------------
# Block formats -> integer codes, scales, mins
# --------------------------------------------------------------------------------------------------------------

@dataclass
class Decoded:
    """A GGUF tensor ``[..., N, K]`` as its raw integer codes: value ``u * s - m`` (``mins``) or ``(u - zero) * s``.

    Attributes:
        codes: uint8 ``[..., N, K]`` (Q8_0: ``q + 128``; Q6_K: ``q`` in 0..63; Q4_K: ``q`` in 0..15).
        scales: ``[..., N, K / group]`` (float16 for Q8_0, float32 otherwise). mins: float32 like scales, or None.
        zero: the symmetric zero code (None with mins). group: K per scale.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    zero: int | None
    group: int


def _blocks(data: np.ndarray, t: GGUFTensor, block_bytes: int) -> torch.Tensor:
    raw = data[t.offset:t.offset + t.nbytes]
    return torch.from_numpy(np.array(raw, copy=True)).view(-1, block_bytes)  # one tensor's bytes, writable


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).reshape(b.shape[:-1])


def decode_q8_0(data: np.ndarray, t: GGUFTensor) -> Decoded:
    b = _blocks(data, t, 34)
    *lead, n, k = t.shape
    codes = (b[:, 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return Decoded(codes.reshape(*lead, n, k), _f16(b[:, :2]).reshape(*lead, n, k // 32), None, 128, 32)


def decode_q6_k(data: np.ndarray, t: GGUFTensor) -> Decoded:
    b = _blocks(data, t, 210)
    nb = b.shape[0]
    ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208].contiguous().view(torch.int8)
    d = _f16(b[:, 208:210]).float()
    low = torch.stack((ql.view(nb, 2, 64) & 15, ql.view(nb, 2, 64) >> 4), 2).reshape(nb, 256)  # (h, s, t)
    high = torch.stack([(qh.view(nb, 2, 32) >> (2 * s)) & 3 for s in range(4)], 2).reshape(nb, 256)  # (h, s, l)
    q = low | (high << 4)  # 0..63
    *lead, n, k = t.shape
    scales = (d[:, None] * sc.float()).reshape(*lead, n, k // 16)
    return Decoded(q.reshape(*lead, n, k), scales, None, 32, 16)


def _k_decoded(b: torch.Tensor, q: torch.Tensor, t: GGUFTensor) -> Decoded:
    """A Q4_K / Q5_K tensor from its codes ``q [nb, 256]`` and the header its blocks share (bytes ``0:16`` of each
    row of ``b [nb, block bytes]``: the f16 super-block scale and min, then 8 six-bit sub-block scales and mins):
    value ``code * d * sc - dmin * m`` per sub-block of 32."""
    from gguf.quants import Q4_K

    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]).float(), _f16(b[:, 2:4]).float()
    sc, m = Q4_K.get_scale_min(b[:, 4:16].numpy())
    sc, m = torch.from_numpy(np.asarray(sc)).reshape(nb, 8), torch.from_numpy(np.asarray(m)).reshape(nb, 8)
    *lead, n, k = t.shape
    scales = (d[:, None] * sc.float()).reshape(*lead, n, k // 32)
    mins = (dmin[:, None] * m.float()).reshape(*lead, n, k // 32)
    return Decoded(q.reshape(*lead, n, k), scales, mins, None, 32)


def decode_q4_k(data: np.ndarray, t: GGUFTensor) -> Decoded:
    b = _blocks(data, t, 144)
    qs = b[:, 16:].reshape(b.shape[0], 4, 32)
    q = torch.stack((qs & 15, qs >> 4), 2).reshape(b.shape[0], 256)  # chunk c: 32 low nibbles, then 32 high nibbles
    return _k_decoded(b, q, t)


def decode_q5_k(data: np.ndarray, t: GGUFTensor) -> Decoded:
    """Q5_K (``experts/gguf_blocks.py``): Q4_K's scales and mins, a fifth code bit from ``qh[32]``."""
    b = _blocks(data, t, 176)
    nb = b.shape[0]
    qh = b[:, 16:48].reshape(nb, 1, 32)
    qs = b[:, 48:].reshape(nb, 4, 32)
    low = torch.stack((qs & 15, qs >> 4), 2).reshape(nb, 8, 32)
    high = (qh >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    q = (low | (high << 4)).reshape(nb, 256)  # 0..31
    return _k_decoded(b, q, t)


MXFP4_FORMAT = QuantFormat("fp4", 32, torch.bfloat16)


def repack_mxfp4(data: np.ndarray, t: GGUFTensor, dtype: torch.dtype) -> QuantTensor:
    """GGML ``MXFP4`` blocks of 32 (ggml's ``block_mxfp4``: an E8M0 scale byte ``e``, then 16 bytes whose low nibbles
    are elements 0-15 and high nibbles 16-31, OCP e2m1 codes; value ``e2m1 * 2^(e - 127)``, gguf-py's
    ``MXFP4.dequantize_blocks``) as the ``fp4`` format (:data:`MXFP4_FORMAT`: codes paired ``2j`` / ``2j + 1`` per
    byte, the scales as bfloat16): the same values and code bits, rearranged."""
    from ferrylm.checkpoints.quant.base import e8m0_to_bf16

    *lead, n, k = t.shape
    b = _blocks(data, t, 17)
    qs = b[:, 1:]
    codes = torch.cat((qs & 15, qs >> 4), 1)  # [blocks, 32] in element order
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return QuantTensor(MXFP4_FORMAT, packed.reshape(*lead, n, k // 2).contiguous(),
                       e8m0_to_bf16(b[:, 0].contiguous()).reshape(*lead, n, k // 32), dtype=dtype)


_DECODERS: dict[str, tuple[Callable[[np.ndarray, GGUFTensor], Decoded], QuantFormat]] = {
    "Q8_0": (decode_q8_0, QuantFormat("int8", 32, torch.float16)),
    "Q6_K": (decode_q6_k, QuantFormat("int8", 16, torch.float32)),
    "Q4_K": (decode_q4_k, QuantFormat("int4", 32, torch.float32, mins=True)),
    "Q5_K": (decode_q5_k, QuantFormat("int8", 32, torch.float32, mins=True)),
}


def unified_format(types: set[str]) -> QuantFormat:
    """The format one projection takes when its layers use the GGUF ``types`` (module docstring)."""
    if len(types) == 1:
        return _DECODERS[next(iter(types))][1]
    group = math.gcd(*(_DECODERS[ty][1].group for ty in types))
    return QuantFormat("int8", group, torch.float32, mins=True)


def repack(dec: Decoded, fmt: QuantFormat, dtype: torch.dtype) -> QuantTensor:
    """``dec`` in ``fmt`` (its own natural format, or the unified int8 one). Raises ValueError when ``fmt`` cannot
    hold it exactly."""
    rep = dec.group // fmt.group
    if dec.group % fmt.group:
        raise ValueError(f"cannot express groups of {dec.group} in groups of {fmt.group}")
    scales = dec.scales.repeat_interleave(rep, -1) if rep > 1 else dec.scales
    codes = dec.codes

    def packed(c: torch.Tensor) -> torch.Tensor:
        return (c[..., 0::2] | (c[..., 1::2] << 4)) if fmt.bits == 4 else c

    if not fmt.mins:  # symmetric: shift the raw codes onto the format's zero code 2^(bits-1)
        if dec.zero is None:
            raise ValueError(f"affine codes do not fit the symmetric {fmt.describe()}")
        shift = (1 << (fmt.bits - 1)) - dec.zero
        if int(codes.max()) + shift >= 1 << fmt.bits or int(codes.min()) + shift < 0:
            raise ValueError(f"codes around {dec.zero} do not fit {fmt.describe()}")
        codes = (codes.to(torch.int16) + shift).to(torch.uint8)
        return QuantTensor(fmt, packed(codes).contiguous(), scales.to(fmt.scale_dtype).contiguous(), dtype=dtype)
    # affine: the raw codes, m = zero * s for a symmetric type (both products exact in float32)
    mins = dec.scales.float() * dec.zero if dec.mins is None else dec.mins
    mins = mins.repeat_interleave(rep, -1) if rep > 1 else mins
    return QuantTensor(fmt, packed(codes).contiguous(), scales.float().contiguous(), mins.contiguous(), dtype=dtype)
