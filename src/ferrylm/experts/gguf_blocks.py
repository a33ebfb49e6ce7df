"""GGML block formats kept as their bytes: the layouts of ``Q4_K``, ``Q5_K``, ``Q6_K`` and ``Q8_0`` and their torch
reference dequantization.

A row of ``K`` weights is ``K / QK`` consecutive blocks of ``BB`` bytes (``QK`` elements each), exactly as a GGUF
file stores it; a ``[N, K]`` projection is ``N`` such rows, uint8 ``[N, K / QK * BB]``. Layouts from ggml's
``ggml-common.h`` (``block_q8_0``, ``block_q4_K``, ``block_q5_K``, ``block_q6_K``) and the decoding of ggml's
``dequantize_row_*`` in ``ggml-quants.c``, which gguf-py's ``gguf.quants.dequantize`` mirrors (the tests' oracle):

======  ====  =====  ============================================================================================
type    QK    BB     bytes of one block (offsets) and value of element ``v``
======  ====  =====  ============================================================================================
Q8_0    32    34     ``d`` f16 (0), ``qs`` int8[32] (2): ``d * qs[v]``
Q4_K    256   144    ``d`` f16 (0), ``dmin`` f16 (2), ``scales`` [12] (4), ``qs`` [128] (16):
                     ``d * sc[j] * q - dmin * mn[j]``, ``j = v // 32``, ``q = (qs[32 (j // 2) + v % 32] >> 4 (j % 2))
                     & 15``
Q5_K    256   176    ``d``, ``dmin`` f16 (0, 2), ``scales`` [12] (4), ``qh`` [32] (16), ``qs`` [128] (48): as Q4_K
                     with a fifth bit ``(qh[v % 32] >> j) & 1`` above the nibble
Q6_K    256   210    ``ql`` [128] (0), ``qh`` [64] (128), ``scales`` int8[16] (192), ``d`` f16 (208):
                     ``d * scales[v // 16] * (q - 32)``; with ``h = v // 128``, ``w = v % 128``: low 4 bits
                     ``(ql[64 h + w % 64] >> 4 (w // 64)) & 15``, high 2 bits ``(qh[32 h + w % 32] >> 2 (w // 32)) & 3``
======  ====  =====  ============================================================================================

K-quant 6-bit scales and mins of sub-block ``j`` (``get_scale_min_k4`` in ``ggml-quants.c``), ``s = scales[12]``:
``j < 4``: ``sc = s[j] & 63``, ``mn = s[j + 4] & 63``; ``j >= 4``: ``sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)``,
``mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)``.

Every product is exact in float32 (an f16 ``d`` has 11 significant bits, scales 6-8, codes 4-8), so the one float32
rounding is the K-quants' subtraction of the min, as in the reference: a kernel that fuses it into an FMA gets the
same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256


@dataclass(frozen=True)
class BlockType:
    """One GGML block type: ``name`` (GGUF's ``GGMLQuantizationType`` name), ``elems`` per block (``QK``) and
    ``nbytes`` per block (``BB``); the fields inside a block are in the module docstring's table."""

    name: str
    elems: int
    nbytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.elems


#: internal kind -> block type (the kind names of :class:`~ferrylm.experts.quantized.QuantFormat`)
BLOCK_TYPES = {"q8_0": BlockType("Q8_0", 32, 34), "q4_k": BlockType("Q4_K", QK_K, 144),
               "q5_k": BlockType("Q5_K", QK_K, 176), "q6_k": BlockType("Q6_K", QK_K, 210)}
#: GGUF type name -> internal kind
KIND_OF_GGUF = {b.name: k for k, b in BLOCK_TYPES.items()}
#: internal kind -> the code a mixed projection's per-expert ``tag`` byte holds (also the kernels' kind numbers)
BLOCK_CODE = {"q8_0": 5, "q4_k": 6, "q5_k": 7, "q6_k": 8}
KIND_OF_CODE = {v: k for k, v in BLOCK_CODE.items()}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2]`` little-endian halves -> float32 ``[...]``."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``[B, 12]`` packed K-quant scales -> ``(sc, mn)`` float32 ``[B, 8]`` (module docstring)."""
    s = s.to(torch.int32)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 6) << 4)), 1)
    mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), 1)
    return sc.float(), mn.float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, 0:2])[:, None] * b[:, 2:].view(torch.int8).float()


def _ints(b: torch.Tensor, *values: int) -> torch.Tensor:
    """``values`` as an int32 tensor on ``b``'s device (shift amounts of the decoders below)."""
    return torch.tensor(values, dtype=torch.int32, device=b.device)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    s = _f16(b[:, 0:2])[:, None] * sc  # [B, 8], exact
    m = _f16(b[:, 2:4])[:, None] * mn
    qs = b[:, 16:144].view(nb, 4, 1, 32).to(torch.int32)
    q = ((qs >> _ints(b, 0, 4).view(1, 1, 2, 1)) & 15).reshape(nb, 8, 32).float()
    return (s[..., None] * q - m[..., None]).reshape(nb, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    s = _f16(b[:, 0:2])[:, None] * sc
    m = _f16(b[:, 2:4])[:, None] * mn
    qh = b[:, 16:48].view(nb, 1, 32).to(torch.int32)
    qs = b[:, 48:176].view(nb, 4, 1, 32).to(torch.int32)
    low = ((qs >> _ints(b, 0, 4).view(1, 1, 2, 1)) & 15).reshape(nb, 8, 32)
    high = (qh >> _ints(b, *range(8)).view(1, 8, 1)) & 1
    q = (low | (high << 4)).float()
    return (s[..., None] * q - m[..., None]).reshape(nb, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql = b[:, 0:128].view(nb, 2, 1, 64).to(torch.int32)
    qh = b[:, 128:192].view(nb, 2, 1, 32).to(torch.int32)
    sc = b[:, 192:208].view(torch.int8).float()
    s = _f16(b[:, 208:210])[:, None] * sc  # [B, 16], exact
    low = ((ql >> _ints(b, 0, 4).view(1, 1, 2, 1)) & 15).reshape(nb, 2, 128)
    high = ((qh >> _ints(b, 0, 2, 4, 6).view(1, 1, 4, 1)) & 3).reshape(nb, 2, 128)
    q = ((low | (high << 4)) - 32).float().reshape(nb, 16, 16)
    return (s[..., None] * q).reshape(nb, QK_K)


_DECODE = {"q8_0": _q8_0, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


def dequantize_blocks(data: torch.Tensor, kind: str) -> torch.Tensor:
    """The torch reference: uint8 ``[..., N, K / QK * BB]`` rows of ``kind`` blocks -> float32 ``[..., N, K]``.

    Raises:
        ValueError: an unknown kind, or a row length that is not a whole number of blocks.
    """
    if kind not in BLOCK_TYPES:
        raise ValueError(f"unknown GGML block kind {kind!r}; kinds: {', '.join(BLOCK_TYPES)}")
    bt = BLOCK_TYPES[kind]
    *lead, n, rb = data.shape
    if data.dtype != torch.uint8 or rb % bt.nbytes:
        raise ValueError(f"{bt.name} rows must be uint8 and a multiple of {bt.nbytes} bytes, got {data.dtype} "
                         f"[..., {rb}]")
    blocks = data.reshape(-1, bt.nbytes)
    return _DECODE[kind](blocks).reshape(*lead, n, rb // bt.nbytes * bt.elems)


def fill_random_blocks(data: torch.Tensor, kind: str, *, generator: torch.Generator, std: float = 1.0) -> None:
    """Fill uint8 rows of ``kind`` blocks in place with random codes and positive f16 scales (tests, synthetic
    models): values of roughly ``std`` spread around zero, never NaN / inf."""
    bt = BLOCK_TYPES[kind]
    flat = data.view(-1, bt.nbytes)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=generator, dtype=torch.uint8))
    nb = flat.shape[0]

    def put_f16(off: int, values: torch.Tensor) -> None:
        flat[:, off:off + 2] = values.to(torch.float16).view(torch.uint8).view(nb, 2)

    jitter = 0.5 + torch.rand(nb, generator=generator)
    if kind == "q8_0":  # int8 codes: std ~74
        put_f16(0, std / 74 * jitter)
    elif kind == "q6_k":  # int8 scales (std ~74) times codes - 32 (std ~18)
        put_f16(208, std / (74 * 18) * jitter)
    else:  # Q4_K / Q5_K: 6-bit scales (~32) times codes (~8 / ~16) minus 6-bit mins (~32): mean ~0 when dmin ~ d q/2
        half = 7.5 if kind == "q4_k" else 15.5
        d = std / (32 * half) * jitter
        put_f16(0, d)
        put_f16(2, d * half)
