"""Random quantized expert stacks for ``synthetic:<preset>:quant=Q``, made directly in the stored format.

Nothing is quantized: an 8 MiB pool of valid codes per format is drawn once (seeded), and every ``data`` tensor is
filled with windows of it at seeded random offsets (a memory copy, so a 48-layer qwen3-30b-a3b in int4 builds at
copy speed). The scale of every group is one constant chosen so that the dequantized weights have the requested
standard deviation (the same init scale the plain synthetic model uses), so logits stay of the usual size.

Code pools (values before scaling):
- ``int4``: ``clamp(round(2.5 z) + 8, 0, 15)``, ``z ~ N(0, 1)``; ``fp4``: the e2m1 code nearest ``2 z``;
  ``fp8``: ``z`` rounded to e4m3. The codes' standard deviation is measured on the pool.
- GGML blocks (``q4_k``, ``q6_k``, ``q8_0``: the layouts a GGUF file holds, kept as bytes): a pool of whole random
  blocks per (kind, standard deviation) (:func:`ferrylm.experts.gguf_blocks.fill_random_blocks`: random codes and
  scale bytes, f16 ``d`` / ``dmin`` chosen for the spread), copied in whole blocks.
"""

from __future__ import annotations

import hashlib
import math
import random

import torch

from ferrylm.experts.gguf_blocks import BLOCK_TYPES, fill_random_blocks
from ferrylm.experts.quantized import (E2M1_VALUES, ExpertQuant, QuantFormat, QuantTensor, block_format,
                                       empty_quant)

POOL_BYTES = 1 << 23
_CACHE: dict[tuple[int, str, int], tuple[torch.Tensor, float]] = {}  # (seed, kind, size) -> pool: built once

#: ``quant=`` name -> formats of gate/up and down (see ``synthetic/spec.py`` SYNTHETIC_QUANT)
SYNTHETIC_FORMATS: dict[str, ExpertQuant] = {
    "fp8": ExpertQuant(QuantFormat("fp8", 128, torch.float32), QuantFormat("fp8", 128, torch.float32)),
    "int4": ExpertQuant(QuantFormat("int4", 128, torch.bfloat16), QuantFormat("int4", 128, torch.bfloat16)),
    "mxfp4": ExpertQuant(QuantFormat("fp4", 32, torch.bfloat16), QuantFormat("fp4", 32, torch.bfloat16)),
    "nvfp4": ExpertQuant(QuantFormat("fp4", 16, torch.float8_e4m3fn, row_scale=True),
                         QuantFormat("fp4", 16, torch.float8_e4m3fn, row_scale=True)),
    "q4_k": ExpertQuant(block_format("Q4_K"), block_format("Q4_K")),
    "q4_k_m": ExpertQuant(block_format("Q4_K"), block_format("Q6_K")),
    "q8_0": ExpertQuant(block_format("Q8_0"), block_format("Q8_0")),
}


def _seed(*parts: object) -> int:
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:15], 16)


class CodePool:
    """Seeded pools of valid code bytes per quantized kind, and the standard deviation of their values."""

    def __init__(self, seed: int, size: int = POOL_BYTES):
        self.seed, self.size = seed, size
        self._pools: dict[str, tuple[torch.Tensor, float]] = {}

    def pool(self, kind: str) -> tuple[torch.Tensor, float]:
        """``(uint8 bytes [size], std of the values)`` for ``kind``."""
        key = (self.seed, kind, self.size)
        if kind not in self._pools and key in _CACHE:
            self._pools[kind] = _CACHE[key]
        if kind not in self._pools:
            g = torch.Generator().manual_seed(_seed(self.seed, "codes", kind))
            n = self.size * (2 if kind in ("int4", "fp4") else 1)
            z = torch.randn(n, generator=g)
            if kind == "fp8":
                vals = z.to(torch.float8_e4m3fn)
                codes, std = vals.view(torch.uint8), vals.float().std().item()
            else:
                if kind == "int4":
                    c = (torch.round(2.5 * z) + 8).clamp(0, 15)
                    std = (c - 8).std().item()
                elif kind == "fp4":
                    table = torch.tensor(E2M1_VALUES)
                    mids = (table[1:8] + table[0:7]) / 2  # nearest magnitude, then the sign bit
                    c = (torch.bucketize((2 * z).abs(), mids) + 8 * (z < 0)).float()
                    std = table[c.long()].std().item()
                else:  # int8
                    c = (torch.round(40 * z) + 128).clamp(0, 255)
                    std = (c - 128).std().item()
                c = c.to(torch.uint8)
                codes = (c[0::2] | (c[1::2] << 4)) if kind in ("int4", "fp4") else c
            self._pools[kind] = _CACHE[key] = (codes.contiguous(), std)
        return self._pools[kind]

    def fill_(self, data: torch.Tensor, kind: str, key: str) -> None:
        """Fill ``data`` (contiguous, uint8 or float8 bytes) with windows of the pool at seeded offsets."""
        codes, _ = self.pool(kind)
        flat = data.view(torch.uint8).view(-1)
        rng = random.Random(_seed(self.seed, key))
        src = codes.to(flat.device)
        start, total, chunk = 0, flat.numel(), self.size // 2
        while start < total:
            n = min(chunk, total - start)
            off = rng.randrange(self.size - n + 1)
            flat[start:start + n].copy_(src[off:off + n])
            start += n


def fill_blocks_(data: torch.Tensor, kind: str, std: float, seed: int, key: str) -> None:
    """Fill ``data`` (contiguous uint8 rows of whole ``kind`` blocks) with windows of a pool of random blocks,
    copied at block boundaries (so every block keeps valid f16 scales)."""
    bt = BLOCK_TYPES[kind]
    pkey = (seed, f"{kind}@{std!r}", POOL_BYTES)
    if pkey not in _CACHE:
        pool = torch.empty(POOL_BYTES // bt.nbytes, bt.nbytes, dtype=torch.uint8)
        fill_random_blocks(pool, kind, generator=torch.Generator().manual_seed(_seed(seed, "blocks", kind)), std=std)
        _CACHE[pkey] = (pool, std)
    pool = _CACHE[pkey][0].to(data.device)
    flat = data.view(-1, bt.nbytes)
    rng = random.Random(_seed(seed, key))
    start, total, chunk = 0, flat.shape[0], pool.shape[0] // 2
    while start < total:
        n = min(chunk, total - start)
        off = rng.randrange(pool.shape[0] - n + 1)
        flat[start:start + n].copy_(pool[off:off + n])
        start += n


def random_stack(pool: CodePool, fmt: QuantFormat, experts: int, n: int, k: int, std: float, key: str, *,
                 device: torch.device | str, dtype: torch.dtype, pin_memory: bool = False) -> QuantTensor:
    """``[experts, n, k]`` random quantized weights of ``fmt`` whose values have standard deviation ``std``."""
    qt = empty_quant(fmt, (experts,), n, k, device=device, dtype=dtype, pin_memory=pin_memory)
    if fmt.is_block:
        fill_blocks_(qt.data, fmt.kind, std, pool.seed, key)
        return qt
    pool.fill_(qt.data, fmt.kind, key)
    scale = std / pool.pool(fmt.kind)[1]
    if fmt.kind == "fp4" and fmt.scale_dtype == torch.bfloat16:  # MXFP4: scales are powers of two
        scale = 2.0 ** round(math.log2(scale))
    if qt.row_scale is not None:  # NVFP4: fp8 block scales near 1, the size in the row scale
        qt.scales.fill_(1.0)
        qt.row_scale.fill_(scale)
    else:
        qt.scales.fill_(scale)
    if qt.mins is not None:
        qt.mins.copy_(qt.scales.float().mul(float(1 << (fmt.bits - 1))).to(fmt.scale_dtype))
    return qt
