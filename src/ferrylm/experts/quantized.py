"""Quantized routed experts: the few internal representations every checkpoint format is repacked into at load.

A projection of ``E`` experts, each ``[N, K]`` (``N`` output rows, ``K`` inputs; gate/up ``[I, H]``, down
``[H, I]``), is a :class:`QuantTensor` of one :class:`QuantFormat`:

========  ============================  =============================================================
kind      ``data`` per expert           value of element ``(n, k)``, group ``g = k // group``
========  ============================  =============================================================
``int4``  uint8 ``[N, K/2]``, 2 codes   ``(u - 8) * s[n, g]``, or ``u * s[n, g] - m[n, g]`` with mins
``int8``  uint8 ``[N, K]``              ``(u - 128) * s[n, g]``, or ``u * s[n, g] - m[n, g]`` with mins
``fp4``   uint8 ``[N, K/2]``, 2 codes   ``e2m1(u) * s[n, g]``
``fp8``   float8_e4m3fn ``[N, K]``      ``float(q) * s[n, g]``
``q4_k``  uint8 ``[N, K/256*144]``      GGML blocks kept as the file's bytes (no ``scales`` field):
``q5_k``  uint8 ``[N, K/256*176]``      :mod:`ferrylm.experts.gguf_blocks` has the layouts (ggml's
``q6_k``  uint8 ``[N, K/256*210]``      ``ggml-common.h``) and their reference decoding; ``group`` is the
``q8_0``  uint8 ``[N, K/32*34]``        block's element count (256, or 32 for Q8_0)
``kmix``  uint8 ``[N, K/256*BBmax]``    per expert one of the K-quant kinds ``mix`` (its ``tag`` byte
                                        ``[1]`` holds :data:`~ferrylm.experts.gguf_blocks.BLOCK_CODE`); each
                                        row its blocks, padded to the widest kind of the mix
========  ============================  =============================================================

* Packed 4-bit codes: element ``2j`` in the low nibble of byte ``j``, element ``2j + 1`` in the high nibble
  (the order of OCP MX ``e2m1`` pairs in gpt-oss and of compressed-tensors' nibbles).
* Integer codes ``u`` are unsigned (``0 .. 2^bits - 1``). Without mins the format is symmetric around
  ``2^(bits-1)``; with mins it is affine (``w = u * s - m``: GPTQ's ``s * (u - z)`` is ``m = s * z``; GGUF Q4_K's
  ``d * sc * u - dmin * mn`` is ``s = d * sc, m = dmin * mn``).
* ``e2m1`` (OCP Microscaling Formats v1.0, §5.3.3): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0;
  code ``0..7`` = ``0, 0.5, 1, 1.5, 2, 3, 4, 6``, ``8..15`` their negatives.
* ``scales`` / ``mins``: ``[N, K / group]`` in ``scale_dtype`` (float32, bfloat16, float16 or float8_e4m3fn),
  one per ``group`` consecutive inputs of a row (a 128x128 block scale is repeated over its 128 rows).
* ``row_scale`` (optional): float32 ``[N]``, multiplies every scale of its row (NVFP4's per-tensor global
  scale; per row so that the gate and up projections, fused into one ``[2I, H]`` block, keep theirs).
  The effective scale of a group is ``float(s) * row_scale`` (computed first, as a kernel does once per group).

Every kernel computes in float32 from these fields; :meth:`QuantTensor.dequantize` is the torch reference.
The group size, kind and dtypes are constants of a projection for a whole model (:class:`QuantFormat`), so a
GPU kernel can dequantize in its inner loop with compile-time constants.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ferrylm.experts.gguf_blocks import (BLOCK_CODE, BLOCK_TYPES, KIND_OF_CODE, dequantize_blocks,
                                         fill_random_blocks)

BLOCK_KINDS = tuple(BLOCK_TYPES)  # GGML block formats: q8_0, q4_k, q5_k, q6_k
MIX_KIND = "kmix"  # K-quant blocks whose kind is chosen per expert (a projection mixing types across layers)
QUANT_KINDS = ("int4", "int8", "fp4", "fp8", *BLOCK_KINDS, MIX_KIND)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
ALIGN = 64  # byte alignment of every field inside an expert row (SIMD loads; dtype views need their item size)

#: e2m1 code -> value (OCP MX v1.0 §5.3.3)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float8_e4m3fn: "f8e4m3"}


@dataclass(frozen=True)
class QuantFormat:
    """How one projection's experts are stored (see the module docstring).

    Attributes:
        kind: ``int4``, ``int8``, ``fp4``, ``fp8``, or a GGML block kind (``q4_k``, ``q5_k``, ``q6_k``, ``q8_0``;
            :func:`block_format` makes one).
        group: inputs per scale along ``K`` (even for 4-bit kinds); for a block kind the block's element count.
        scale_dtype: dtype of ``scales`` and ``mins`` (unused by block kinds, whose scales live inside the blocks).
        mins: integer kinds only: affine ``u * s - m`` instead of symmetric ``(u - 2^(bits-1)) * s``.
        row_scale: a float32 multiplier per output row.
        mix: ``kmix`` only: the K-quant kinds its experts may have (sorted by block size; rows padded to the last).
    """

    kind: str
    group: int
    scale_dtype: torch.dtype = torch.bfloat16
    mins: bool = False
    row_scale: bool = False
    mix: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in QUANT_KINDS:
            raise ValueError(f"unknown quantized kind {self.kind!r}; kinds: {', '.join(QUANT_KINDS)}")
        if self.kind == MIX_KIND:
            if (len(self.mix) < 2 or any(BLOCK_TYPES.get(m) is None or BLOCK_TYPES[m].elems != 256 for m in self.mix)
                    or list(self.mix) != sorted(set(self.mix), key=lambda m: BLOCK_TYPES[m].nbytes)
                    or self.group != 256 or self.mins or self.row_scale):
                raise ValueError(f"kmix needs two or more K-quant kinds sorted by block size and group 256, got "
                                 f"{self.mix} group {self.group}")
            return
        if self.mix:
            raise ValueError(f"{self.kind}: only kmix has a mix")
        if self.kind in BLOCK_TYPES:
            if self.group != BLOCK_TYPES[self.kind].elems or self.mins or self.row_scale:
                raise ValueError(f"{self.kind}: group must be its block size {BLOCK_TYPES[self.kind].elems}, "
                                 f"without mins or a row scale")
            return
        if self.group < 1 or (self.bits == 4 and self.group % 2):
            raise ValueError(f"{self.kind}: group size must be >= 1 (even for 4-bit), got {self.group}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale dtype {self.scale_dtype} is not one of {SCALE_DTYPES}")
        if self.mins and not self.kind.startswith("int"):
            raise ValueError(f"{self.kind} has no mins (only integer kinds are affine)")

    @property
    def bits(self) -> int:
        """Bits of one code (element kinds; block kinds: 8, the bytes being opaque to element arithmetic)."""
        return 4 if self.kind in ("int4", "fp4") else 8

    @property
    def is_block(self) -> bool:
        """A GGML block kind (``kmix`` included): ``data`` holds whole blocks, scales included."""
        return self.kind in BLOCK_TYPES or self.kind == MIX_KIND

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of a block kind (``kmix``: of its widest kind, the padded row's unit)."""
        return BLOCK_TYPES[self.mix[-1] if self.kind == MIX_KIND else self.kind].nbytes

    @property
    def data_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kind == "fp8" else torch.uint8

    def packed_k(self, k: int) -> int:
        """Elements of ``data`` per row for ``k`` inputs."""
        if self.is_block:
            return k // self.group * self.block_bytes
        return k // 2 if self.bits == 4 else k

    def unpacked_k(self, kp: int) -> int:
        """Inputs ``k`` of a row whose ``data`` has ``kp`` elements (inverse of :meth:`packed_k`)."""
        if self.is_block:
            return kp // self.block_bytes * self.group
        return kp * 2 if self.bits == 4 else kp

    def check_shape(self, n: int, k: int, what: str = "projection") -> None:
        """Raise ValueError unless ``[n, k]`` can be stored (``k`` a multiple of the group size)."""
        if n < 1 or k < 1 or k % self.group:
            raise ValueError(f"{what} [{n}, {k}]: {self.kind} with group {self.group} needs K to be a multiple of "
                             f"{self.group}")

    def fields(self, n: int, k: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, per-expert shape)`` of every stored field, in row order."""
        g = k // self.group
        if self.kind == MIX_KIND:
            return [("data", torch.uint8, (n, self.packed_k(k))), ("tag", torch.uint8, (1,))]
        if self.is_block:
            return [("data", torch.uint8, (n, self.packed_k(k)))]
        out = [("data", self.data_dtype, (n, self.packed_k(k))), ("scales", self.scale_dtype, (n, g))]
        if self.mins:
            out.append(("mins", self.scale_dtype, (n, g)))
        if self.row_scale:
            out.append(("row_scale", torch.float32, (n,)))
        return out

    def expert_bytes(self, n: int, k: int) -> int:
        """Bytes of one expert's ``[n, k]`` projection (fields not padded)."""
        return sum(_numel(shape) * _itemsize(dt) for _, dt, shape in self.fields(n, k))

    def bits_per_weight(self, n: int, k: int) -> float:
        return 8 * self.expert_bytes(n, k) / (n * k)

    def describe(self) -> str:
        """E.g. ``int4 g128 (bf16 scales, mins)``, or ``Q4_K (ggml blocks)``."""
        if self.kind == MIX_KIND:
            return f"{'|'.join(BLOCK_TYPES[m].name for m in self.mix)} (ggml blocks, a kind per expert)"
        if self.is_block:
            return f"{BLOCK_TYPES[self.kind].name} (ggml blocks)"
        extra = [f"{_DTYPE_NAMES[self.scale_dtype]} scales"] + (["mins"] if self.mins else []) + (
            ["row scale"] if self.row_scale else [])
        return f"{self.kind} g{self.group} ({', '.join(extra)})"


def block_format(gguf_type: str) -> QuantFormat:
    """The format that keeps GGUF ``gguf_type`` blocks (``"Q4_K"``, ``"Q5_K"``, ``"Q6_K"``, ``"Q8_0"``) as bytes.

    Raises:
        ValueError: another type.
    """
    kind = gguf_type.lower()
    if kind not in BLOCK_TYPES:
        raise ValueError(f"GGUF type {gguf_type} is not kept as blocks; block types: "
                         f"{', '.join(b.name for b in BLOCK_TYPES.values())}")
    return QuantFormat(kind, BLOCK_TYPES[kind].elems)


def mix_format(gguf_types: list[str] | tuple[str, ...]) -> QuantFormat:
    """The ``kmix`` format of K-quant GGUF types (``["Q4_K", "Q6_K"]``). Raises ValueError for other types."""
    kinds = sorted({t.lower() for t in gguf_types}, key=lambda m: BLOCK_TYPES[m].nbytes if m in BLOCK_TYPES else 0)
    return QuantFormat(MIX_KIND, 256, mix=tuple(kinds))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class QuantTensor:
    """One projection of ``E`` experts (leading ``[E]``) or of one expert (no leading dim), see the module docstring.

    Attributes:
        fmt: the format. data: ``[..., N, K/2]`` uint8 (4-bit), ``[..., N, K]`` uint8 (int8) or float8_e4m3fn;
            block kinds: uint8 ``[..., N, K / QK * BB]``, the GGML blocks of each row.
        tag: ``kmix`` only: uint8 ``[..., 1]``, each expert's block kind (``gguf_blocks.BLOCK_CODE``).
        scales: ``[..., N, K/group]`` (None for block kinds). mins: same, or None. row_scale: ``[..., N]``
            float32, or None.
        dtype: what :meth:`dequantize` returns by default (the model's compute dtype).
    """

    fmt: QuantFormat
    data: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None
    dtype: torch.dtype = torch.bfloat16
    tag: torch.Tensor | None = None

    def __post_init__(self) -> None:
        f = self.fmt
        if (self.tag is not None) != (f.kind == MIX_KIND):
            raise ValueError(f"{f.describe()}: a per-expert tag [..., 1] goes with kmix only")
        if f.is_block:
            if self.data.dtype != torch.uint8 or self.scales is not None or self.data.dim() < 2 or (
                    self.data.shape[-1] % f.packed_k(f.group)):
                raise ValueError(f"{f.describe()}: data must be uint8 [..., N, whole blocks] without scales, got "
                                 f"{self.data.dtype} {list(self.data.shape)}")
            return
        if self.scales is None:
            raise ValueError(f"{f.describe()}: scales are missing")
        if self.data.dtype != f.data_dtype or self.scales.dtype != f.scale_dtype:
            raise ValueError(f"{f.describe()}: data {self.data.dtype} / scales {self.scales.dtype} do not match")
        if (self.mins is not None) != f.mins or (self.row_scale is not None) != f.row_scale:
            raise ValueError(f"{f.describe()}: mins / row_scale presence does not match the format")
        n, kp = self.data.shape[-2:]
        k = f.unpacked_k(kp)
        want = (*self.data.shape[:-2], n, k // f.group)
        if k % f.group or tuple(self.scales.shape) != want or (
                self.mins is not None and tuple(self.mins.shape) != want) or (
                self.row_scale is not None and tuple(self.row_scale.shape) != want[:-1]):
            raise ValueError(f"{f.describe()}: scales {list(self.scales.shape)} do not fit data "
                             f"{list(self.data.shape)} (want {list(want)})")

    # --- shape ----------------------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        """The dequantized shape ``[..., N, K]``."""
        *lead, n, kp = self.data.shape
        return torch.Size((*lead, n, self.fmt.unpacked_k(kp)))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_cuda(self) -> bool:
        return self.data.is_cuda

    def _parts(self) -> dict[str, torch.Tensor | None]:
        return {"data": self.data, "scales": self.scales, "mins": self.mins, "row_scale": self.row_scale,
                "tag": self.tag}

    def _map(self, fn) -> "QuantTensor":
        return replace(self, **{k: None if v is None else fn(v) for k, v in self._parts().items()})

    def __getitem__(self, idx) -> "QuantTensor":
        """Index the leading (expert) dims: ``qt[e]`` is one expert, ``qt[a:b]`` a range."""
        return self._map(lambda t: t[idx])

    def index_select(self, dim: int, index: torch.Tensor) -> "QuantTensor":
        """Experts ``index`` along the leading dim (``dim`` must be 0)."""
        if dim != 0:
            raise ValueError("QuantTensor.index_select selects experts (dim 0)")
        return self._map(lambda t: t.index_select(0, index))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "QuantTensor":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def rows(self, start: int, stop: int) -> "QuantTensor":
        """Output rows ``start:stop`` (a view): the gate / up halves of a fused gate|up block."""
        return replace(self, data=self.data[..., start:stop, :],
                       scales=None if self.scales is None else self.scales[..., start:stop, :],
                       mins=None if self.mins is None else self.mins[..., start:stop, :],
                       row_scale=None if self.row_scale is None else self.row_scale[..., start:stop])

    def copy_(self, src: "QuantTensor") -> "QuantTensor":
        """Copy ``src``'s fields into this one's (same format and shape). Returns self."""
        if src.fmt != self.fmt:
            raise ValueError(f"cannot copy {src.fmt.describe()} into {self.fmt.describe()}")
        for name, dst in self._parts().items():
            if dst is not None:
                dst.copy_(getattr(src, name))
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of all fields."""
        return sum(t.numel() * t.element_size() for t in self._parts().values() if t is not None)

    # --- the reference ------------------------------------------------------------------------------------
    def codes_f32(self) -> torch.Tensor:
        """``[..., N, K]`` float32: the element values before scaling (integer codes ``u``, e2m1 or fp8 values)."""
        kind = self.fmt.kind
        if self.fmt.bits == 4:
            d = self.data
            c = torch.stack((d & 15, d >> 4), -1).flatten(-2)
            return e2m1_to_f32(c) if kind == "fp4" else c.float()
        return self.data.float()

    def effective_scales(self) -> torch.Tensor:
        """``[..., N, K/group]`` float32: ``float(s)`` times the row scale (when there is one)."""
        s = self.scales.float()
        return s * self.row_scale[..., None] if self.row_scale is not None else s

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The torch reference: ``[..., N, K]`` in ``dtype`` (default :attr:`dtype`), computed in float32 as the
        module docstring's table says, then rounded once to ``dtype``."""
        f = self.fmt
        if f.kind == MIX_KIND:
            return self._dequantize_mix().to(dtype or self.dtype)
        if f.is_block:
            return dequantize_blocks(self.data, f.kind).to(dtype or self.dtype)
        *lead, n, k = self.shape
        g = k // f.group
        c = self.codes_f32().view(*lead, n, g, f.group)
        s = self.effective_scales()[..., None]
        if f.kind.startswith("int"):
            w = c * s - self.mins.float()[..., None] if f.mins else (c - float(1 << (f.bits - 1))) * s
        else:
            w = c * s
        return w.reshape(*lead, n, k).to(dtype or self.dtype)


    def _dequantize_mix(self) -> torch.Tensor:
        """``kmix``: each expert's rows decoded as its tagged kind (the leading bytes of each padded row)."""
        *lead, n, k = self.shape
        data = self.data.reshape(-1, n, self.data.shape[-1])
        tags = self.tag.reshape(-1)
        out = torch.empty(data.shape[0], n, k, dtype=torch.float32, device=self.data.device)
        for code in tags.unique().tolist():
            kind = KIND_OF_CODE.get(int(code))
            if kind not in self.fmt.mix:
                raise ValueError(f"{self.fmt.describe()}: an expert is tagged {code}, not one of the mix")
            idx = (tags == code).nonzero().reshape(-1)
            rb = k // 256 * BLOCK_TYPES[kind].nbytes
            out[idx] = dequantize_blocks(data[idx, :, :rb].contiguous(), kind)
        return out.reshape(*lead, n, k)


def e2m1_to_f32(c: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 ``0..15``) -> float32 values, by arithmetic on the bits (no lookup table is copied to the
    device, so it runs inside CUDA graph capture): ``0.5 * m`` for exponent 0, else ``2^(e-1) * (1 + m / 2)``."""
    mag = c & 7
    ex = (mag >> 1).float()
    mt = (mag & 1).float()
    v = torch.where(ex == 0, 0.5 * mt, torch.exp2(ex - 1) * (1 + 0.5 * mt))
    return torch.where((c & 8) != 0, -v, v)


def dense(w: torch.Tensor | QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as a plain tensor for a matmul with ``dtype`` activations: dequantized when it is a
    :class:`QuantTensor` (the dequantize-then-GEMM reference path), else unchanged."""
    return w.dequantize(dtype) if isinstance(w, QuantTensor) else w


def cat_rows(parts: list[QuantTensor]) -> QuantTensor:
    """Concatenate projections of one format along the output rows ``N`` (gate rows then up rows)."""
    first = parts[0]
    if any(p.fmt != first.fmt for p in parts):
        raise ValueError("cannot concatenate projections of different formats")

    def cat(name: str) -> torch.Tensor | None:
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts, dim=ts[0].dim() - (1 if name == "row_scale" else 2))

    if first.tag is not None and any(not torch.equal(p.tag, first.tag) for p in parts):
        raise ValueError("cannot concatenate kmix projections whose experts have different kinds")
    return QuantTensor(first.fmt, cat("data"), cat("scales"), cat("mins"), cat("row_scale"), first.dtype,
                       first.tag)


def empty_quant(fmt: QuantFormat, lead: tuple[int, ...], n: int, k: int, *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.bfloat16, pin_memory: bool = False) -> QuantTensor:
    """An uninitialised :class:`QuantTensor` of ``[*lead, n, k]``. Raises ValueError when ``k`` does not fit."""
    fmt.check_shape(n, k)
    t = {name: torch.empty(*lead, *shape, dtype=dt, device=device, pin_memory=pin_memory)
         for name, dt, shape in fmt.fields(n, k)}
    return QuantTensor(fmt, t["data"], t.get("scales"), t.get("mins"), t.get("row_scale"), dtype, t.get("tag"))


def random_quant(fmt: QuantFormat, lead: tuple[int, ...], n: int, k: int, *, generator: torch.Generator,
                 std: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> QuantTensor:
    """Random valid codes and positive scales (tests): values of roughly ``std`` spread, no NaN / inf codes."""
    qt = empty_quant(fmt, lead, n, k, dtype=dtype)
    if fmt.kind == MIX_KIND:  # expert e gets kind mix[e % len(mix)]; the padding is zero
        qt.data.zero_()
        data, tags = qt.data.reshape(-1, n, qt.data.shape[-1]), qt.tag.reshape(-1)
        for e in range(data.shape[0]):
            kind = fmt.mix[e % len(fmt.mix)]
            part = torch.empty(n, k // 256 * BLOCK_TYPES[kind].nbytes, dtype=torch.uint8)
            fill_random_blocks(part, kind, generator=generator, std=std)
            data[e, :, :part.shape[1]] = part
            tags[e] = BLOCK_CODE[kind]
        return qt
    if fmt.is_block:
        fill_random_blocks(qt.data, fmt.kind, generator=generator, std=std)
        return qt
    shape = qt.data.shape
    if fmt.kind == "fp8":
        qt.data.copy_(torch.randn(shape, generator=generator).to(torch.float8_e4m3fn))
    else:
        qt.data.copy_(torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8))
    spread = {"int4": 4.6, "int8": 74.0, "fp4": 2.6, "fp8": 1.0}[fmt.kind]  # rough std of the codes
    s = (std / spread) * (0.5 + torch.rand(qt.scales.shape, generator=generator))
    qt.scales.copy_(s.to(fmt.scale_dtype))
    if qt.mins is not None:
        qt.mins.copy_((qt.scales.float() * float(1 << (fmt.bits - 1))
                       * (0.8 + 0.4 * torch.rand(qt.scales.shape, generator=generator))).to(fmt.scale_dtype))
    if qt.row_scale is not None:
        qt.row_scale.copy_(0.5 + torch.rand(qt.row_scale.shape, generator=generator))
    return qt


@dataclass(frozen=True)
class ExpertQuant:
    """The formats of a layer's routed experts: ``gate_up`` (gate and up, one fused ``[2I, H]`` block) and
    ``down`` (``[H, I]``). The same for every MoE layer of a model (one row shape for banks and slots)."""

    gate_up: QuantFormat
    down: QuantFormat

    def check(self, hidden: int, inter: int) -> None:
        """Raise ValueError when ``H`` / ``I`` are not multiples of the group sizes."""
        self.gate_up.check_shape(2 * inter, hidden, "gate/up")
        self.down.check_shape(hidden, inter, "down")

    def describe(self) -> str:
        if self.gate_up == self.down:
            return self.gate_up.describe()
        return f"gate/up {self.gate_up.describe()}, down {self.down.describe()}"


@dataclass(frozen=True)
class RowFields:
    """Byte offsets of one projection's fields inside an expert row: ``(name, offset, dtype, shape)``."""

    fields: tuple[tuple[str, int, torch.dtype, tuple[int, ...]], ...]
    end: int

    @classmethod
    def build(cls, fmt: QuantFormat, n: int, k: int, start: int) -> "RowFields":
        out, off = [], start
        for name, dt, shape in fmt.fields(n, k):
            off = -(-off // ALIGN) * ALIGN
            out.append((name, off, dt, shape))
            off += _numel(shape) * _itemsize(dt)
        return cls(tuple(out), off)

    def view(self, fmt: QuantFormat, rows: torch.Tensor, dtype: torch.dtype) -> QuantTensor:
        """The projection inside uint8 ``rows [..., S]`` (one row ``[S]`` or a stack ``[E, S]``), as views."""
        lead = rows.shape[:-1]
        t = {}
        for name, off, dt, shape in self.fields:
            nb = _numel(shape) * _itemsize(dt)
            t[name] = rows[..., off:off + nb].view(dt).view(*lead, *shape)
        return QuantTensor(fmt, t["data"], t.get("scales"), t.get("mins"), t.get("row_scale"), dtype, t.get("tag"))
