"""How the native kernels (``native/expert_gemv.c``) read weights: the C ``qproj`` arguments of a projection (its
block kind, group, scale dtype and byte offsets), a GGUF's dense block matrices (:class:`BlockMatrix`) and a layer's
expert stacks read where they lie (:class:`StackRows`). Built once per weight, passed on every call."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

PLAIN_KIND = {torch.bfloat16: 10, torch.float32: 11}   # the C kinds of plain rows
QKIND = {"int4": 1, "int8": 2, "fp4": 3, "fp8": 4, "q8_0": 5, "q4_k": 6, "q5_k": 7, "q6_k": 8}
SDTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}
BLOCK_KINDS = ("q8_0", "q4_k", "q5_k", "q6_k")


class BlockMatrix:
    """A dense ``[N, K]`` weight of GGML blocks, read where it lies (e.g. a GGUF file's mapped bytes): the rows of
    ``segments`` in order, each uint8 ``[n_s, K / QK * BB]`` with contiguous rows in block kind ``kinds[s]`` (a fused
    q|k|v is the three mapped tensors, possibly of three kinds). The kernels' call arguments are built once here.

    Raises:
        ValueError: a kind the kernels do not read, ``K`` not a whole number of blocks, a segment of another shape.
    """

    def __init__(self, kind: str, k: int, data: torch.Tensor):
        self._init(k, [(kind, data)])

    def _init(self, k: int, parts: list[tuple[str, torch.Tensor]]) -> None:
        from ferrylm.experts.gguf_blocks import BLOCK_TYPES

        vals = []
        for kind, t in parts:
            if kind not in BLOCK_KINDS:
                raise ValueError(f"block matrices are one of {', '.join(BLOCK_KINDS)}, not {kind!r}")
            bt = BLOCK_TYPES[kind]
            if k <= 0 or k % bt.elems:
                raise ValueError(f"{bt.name} rows of {k} inputs: K must be a positive multiple of {bt.elems}")
            rb = k // bt.elems * bt.nbytes
            if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != rb or t.stride(1) != 1 or (
                    t.shape[0] > 1 and t.stride(0) != rb) or t.device.type != "cpu":
                raise ValueError(f"{bt.name} rows of {k} inputs must be host uint8 [rows, {rb}] with contiguous rows, "
                                 f"got {t.dtype} {list(t.shape)} on {t.device}")
            vals += [QKIND[kind], bt.elems, 0, 0, 0, 0, 0, 0, 0]
        self.k = k
        self.kinds = tuple(kind for kind, _ in parts)
        self.segments = tuple(t for _, t in parts)
        self.n = sum(int(t.shape[0]) for t in self.segments)
        self.qp = (ctypes.c_int64 * len(vals))(*vals)
        self.bases = (ctypes.c_void_p * len(parts))(*[t.data_ptr() for t in self.segments])
        self.seg_rows = (ctypes.c_int64 * len(parts))(*[int(t.shape[0]) for t in self.segments])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.segments)

    @classmethod
    def stacked(cls, parts: list["BlockMatrix"]) -> "BlockMatrix":
        """One matrix of ``parts``' rows in order (their segments, nothing copied). Raises ValueError: parts of
        another ``K``."""
        if len({p.k for p in parts}) != 1:
            raise ValueError(f"stacked block matrices share K, got {[p.k for p in parts]}")
        m = cls.__new__(cls)
        m._init(parts[0].k, [(kind, t) for p in parts for kind, t in zip(p.kinds, p.segments)])
        return m


@dataclass(frozen=True, eq=False)
class StackRows:
    """A layer's expert stacks as :meth:`~ferrylm.experts.cpu_kernel.NativeExpertKernel.run_stacks` reads them: the C ``qproj[2]``, ``H``,
    ``I``, the number of experts, and per projection (gate, up, down) the address of expert 0's rows and the bytes
    from one expert to the next (up's address is shifted back ``I`` rows: the kernel reads an expert's gate|up rows
    from two bases, split at ``I``); ``keep`` holds the tensors, so the addresses stay valid."""

    qproj: object
    hidden: int
    inter: int
    num_experts: int
    lies: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
    keep: tuple

    def bases(self, experts: list[int]):
        """The C array of three addresses per expert of ``experts`` (gate, up shifted, down). Raises ValueError:
        an expert outside the stacks."""
        if experts and (min(experts) < 0 or max(experts) >= self.num_experts):
            raise ValueError(f"experts {experts} outside the layer's {self.num_experts}")
        (g, gs), (u, us), (d, ds) = self.lies
        return (ctypes.c_void_p * (3 * len(experts)))(*[a for e in experts for a in (g + e * gs, u + e * us,
                                                                                      d + e * ds)])


def fits(fmt, k: int) -> bool:
    """Whether the kernels read a projection of ``fmt`` with ``k`` inputs (the C file's ``q_ok``)."""
    if fmt.kind == "fp8":
        return fmt.group % 8 == 0
    return k % 32 == 0 and fmt.group % 16 == 0


def stack_bytes(t) -> torch.Tensor:
    """The tensor holding a stack's weights (a QuantTensor's block bytes, or the plain tensor)."""
    return t if isinstance(t, torch.Tensor) else t.data


def stack_qproj(le):
    """The C ``qproj[2]`` of stacks read by :meth:`~ferrylm.experts.cpu_kernel.NativeExpertKernel.run_stacks`: every offset 0 (each projection
    has its own base address)."""
    if isinstance(le.gate, torch.Tensor):
        kind = PLAIN_KIND[le.gate.dtype]
        return qproj_vals((kind, 1, 0, 0, 0, 0, 0, 0, 0, kind, 1, 0, 0, 0, 0, 0, 0, 0))
    q = le.quant
    return qproj_vals((QKIND[q.gate_up.kind], q.gate_up.group, 0, 0, 0, 0, 0, 0, 0,
                        QKIND[q.down.kind], q.down.group, 0, 0, 0, 0, 0, 0, 0))


@functools.lru_cache(maxsize=64)
def qproj_vals(vals: tuple[int, ...]):
    """``vals`` as the C ``int64`` array (one per distinct tuple: the kernels keep its address)."""
    return (ctypes.c_int64 * len(vals))(*vals)


@functools.lru_cache(maxsize=64)
def plain_qproj(dtype: torch.dtype, hidden: int, inter: int):
    """The C ``qproj[2]`` of a plain row: gate|up at byte 0, down after its ``2 I H`` elements."""
    kind, size = PLAIN_KIND[dtype], torch.empty((), dtype=dtype).element_size()
    vals = [kind, 1, 0, 0, 0, 0, 0, 0, 0, kind, 1, 0, 0, 0, 2 * inter * hidden * size, 0, 0, 0]
    return (ctypes.c_int64 * len(vals))(*vals)


@functools.lru_cache(maxsize=64)
def qproj(layout):
    """The C ``qproj[2]`` (gate|up, down) of a quantized ``layout``: kind, group, scale dtype, mins, row scale and
    the fields' byte offsets in the expert row (``ExpertLayout._rows``), as 18 int64."""
    vals = []
    for fmt, fields in ((layout.quant.gate_up, layout._rows[0]), (layout.quant.down, layout._rows[1])):
        off = {name: o for name, o, _, _ in fields.fields}
        if fmt.kind == "kmix":  # the tag's offset in the scales slot, the widest kind (row padding) in sdtype
            vals += [9, fmt.group, QKIND[fmt.mix[-1]], 0, 0, off["data"], off["tag"], 0, 0]
            continue
        vals += [QKIND[fmt.kind], fmt.group, SDTYPE[fmt.scale_dtype], int(fmt.mins), int(fmt.row_scale),
                 off["data"], off.get("scales", 0), off.get("mins", 0), off.get("row_scale", 0)]
    return (ctypes.c_int64 * len(vals))(*vals)
