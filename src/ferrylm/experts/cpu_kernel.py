"""The native CPU expert kernels (``native/expert_gemv.c``): built once per machine, called through ctypes.

Why: at decode a CPU expert is a GEMV bound by host memory bandwidth, and the torch path (two oneDNN matmuls and
six elementwise ops per expert, each its own parallel region) reads far below the DRAM's rate (docs/BENCHMARKS.md,
"The figures behind choices in the code"). The native kernel computes a layer's whole
CPU share in one OpenMP region, reading quantized experts as stored (integer dot products against an 8-bit
activation; see the C file's header for the arithmetic and the formats).

Build: the host C compiler (``$CC``, default ``cc``) with ``-O3 -fopenmp`` (no ``-march``: the AVX-512, AVX2 and
plain C kernels are all in the library and :attr:`NativeExpertKernel.isa` is the best this CPU runs, found at load),
into ``<cache root>/kernels/expert_gemv-<key>.so`` where the key hashes the sources, the compile command, the
compiler's version and the machine architecture. The build takes a few seconds and is written atomically, so
concurrent processes may race on it safely; a cache folder that cannot be written gives an uncached build in a
temporary folder.

``--moe-cpu-kernel``: ``auto`` (native when it builds, else torch with a warning), ``native`` (fail when it does
not build), ``torch``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ferrylm.cachedir import cache_root
from ferrylm.config import CPU_KERNELS
from ferrylm.experts.native_build import CFLAGS, KernelBuildError, compile_library, compiler_version, read_sources
from ferrylm.experts.native_layouts import (BLOCK_KINDS, PLAIN_KIND, BlockMatrix, StackRows, fits, plain_qproj, qproj,
                                            stack_bytes, stack_qproj)

log = logging.getLogger("ferrylm.experts")

# NOTE: the kernel reads each weight row once per 4 tokens; from ~8 tokens per expert oneDNN's blocked GEMM
# (one read of the weights for all tokens) is the better kernel, so the pool uses torch above this.
NATIVE_MAX_TOKENS = 8
ISAS = ("scalar", "avx2", "avx512")  # the C file's instruction-set levels 0, 1, 2
_RC = {-1: "bad arguments", -2: "an instruction set this CPU lacks", -3: "out of memory"}


@dataclass
class NativeExpertKernel:
    """A loaded build of the native kernels.

    Attributes:
        path: the shared library. isa: the instruction set its calls use (``avx512``, ``avx2``, ``scalar``): the
            best this CPU runs, unless :meth:`with_isa` chose a lower one.
    """

    path: Path
    isa: str
    _lib: ctypes.CDLL

    @classmethod
    def build(cls, root: Path | None = None, cc: str | None = None) -> "NativeExpertKernel":
        """Compile (or reuse the cached build) and load. ``cc``: the compiler command (default ``$CC``, else
        ``cc``; split like a shell word list, so ``"ccache gcc"`` works), once per process for a folder and compiler.
        When the cache folder cannot be written, the kernel is built in a temporary folder (a warning says so) and
        not cached.

        Raises:
            KernelBuildError: no compiler, the compile failed, or the library does not load.
        """
        cc_cmd = shlex.split(cc or os.environ.get("CC") or "cc")
        return _build_once((root or cache_root()) / "kernels", tuple(cc_cmd))

    @classmethod
    def _load(cls, lib_path: Path) -> "NativeExpertKernel":
        try:
            lib = ctypes.CDLL(str(lib_path))
        except OSError as e:
            raise KernelBuildError(f"cannot load {lib_path}: {e}") from e
        i64, ptr, vp, ci = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p, ctypes.c_int
        for name, args in (("ferry_experts", [ptr, ci, ci, ci, ctypes.POINTER(vp), ptr, ptr, i64, i64, vp, i64, vp,
                                              vp, vp, vp, i64, vp, vp]),
                           ("ferry_experts_routed", [ptr, ci, ci, vp, i64, vp, i64, vp, i64, i64, i64, i64, vp, i64,
                                                     vp, vp, i64, vp]),
                           ("ferry_matvec", [ptr, ci, ci, ci, ctypes.POINTER(vp), ptr, i64, vp, i64, vp]),
                           ("ferry_quantize_act", [vp, i64, i64, i64, vp, vp]),
                           ("ferry_dequant", [ptr, ci, vp, i64, vp, i64, i64, vp]),
                           ("ferry_decode_attention", [ci, ci, vp, vp, vp, ci, vp, i64, vp, i64, i64, i64, i64,
                                                       ctypes.c_float, vp]),
                           ("ferry_isa_best", [])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, args
        return cls(path=lib_path, isa=ISAS[lib.ferry_isa_best()], _lib=lib)

    def with_isa(self, isa: str) -> "NativeExpertKernel":
        """This build calling its ``isa`` kernels (tests compare the paths). Raises ValueError when the CPU lacks
        ``isa``."""
        if isa not in ISAS or ISAS.index(isa) > ISAS.index(self.isa):
            raise ValueError(f"this CPU runs the {', '.join(ISAS[:ISAS.index(self.isa) + 1])} kernels, not {isa!r}")
        return NativeExpertKernel(path=self.path, isa=isa, _lib=self._lib)

    SUPPORTED = ("bfloat16 or float32 experts, or quantized int4 / int8 / fp4 / GGML-block ones (H and I multiples "
                 "of 32, groups of 16s) and fp8 ones (groups of 8s)")

    @staticmethod
    def supports(layout) -> bool:
        """Whether the kernels read experts of ``layout`` (an :class:`~ferrylm.experts.executor.ExpertLayout`): plain
        bfloat16 and float32 rows; quantized rows whose shapes the integer kernels take (see :data:`SUPPORTED`)."""
        if layout.quant is None:
            return layout.dtype in PLAIN_KIND
        return all(fits(fmt, k) for fmt, k in ((layout.quant.gate_up, layout.hidden),
                                                (layout.quant.down, layout.inter)))

    def run(self, x: torch.Tensor, weights: torch.Tensor, rows: list[torch.Tensor], starts: list[int],
            counts: list[int], hidden: int, inter: int, threads: int, layout=None) -> torch.Tensor:
        """A layer's CPU share in one call.

        Args:
            x: ``[M, H]`` host activations (any float dtype; widened to float32).
            weights: ``[M]`` host routing weights, same order.
            rows: one host row per expert: plain ``[3 * I * H]`` (gate|up ``[2I, H]`` then down ``[H, I]``), all
                bfloat16 or all float32; or quantized uint8 ``[layout.numel]``.
            starts, counts: expert ``e`` owns rows ``starts[e] : starts[e] + counts[e]`` of ``x`` (within ``M``).
            hidden, inter: ``H`` and ``I``. threads: OpenMP threads for the call (>= 1).
            layout: the rows' :class:`~ferrylm.experts.executor.ExpertLayout` when they are quantized; None for plain.

        Returns:
            ``[M, H]`` float32: ``w_m * down_e @ (silu(g) * u)`` for every row an expert owns (integer kinds: with
            8-bit activations, see the C file's header); rows no expert owns are zero.

        Raises:
            ValueError: a tensor not on the CPU, mismatched shapes or spans, a non-contiguous row, an unsupported
                weight dtype or shape, ``threads < 1``.
        """
        if not rows:
            raise ValueError("no expert rows: one per expert")
        _check_rows(rows, layout, hidden, inter)
        if any(t.device.type != "cpu" for t in rows):
            raise ValueError("the native kernel reads host tensors; got a tensor on another device")
        qp = qproj(layout) if layout is not None else plain_qproj(rows[0].dtype, hidden, inter)
        return self._call(x, weights, qp, [r.data_ptr() for r in rows for _ in range(3)], starts, counts, hidden,
                          inter, threads)

    def run_stacks(self, x: torch.Tensor, weights: torch.Tensor, stacks: "StackRows", experts: list[int],
                   starts: list[int], counts: list[int], threads: int) -> torch.Tensor:
        """As :meth:`run` for experts ``experts`` of a layer's stacks (:meth:`stack_rows`), read where they lie
        (e.g. a GGUF file's mapped bytes): gate, up and down of an expert need not be adjacent.

        Raises:
            ValueError: as :meth:`run`; an expert outside the stacks.
        """
        return self._call(x, weights, stacks.qproj, stacks.bases(experts), starts, counts, stacks.hidden,
                          stacks.inter, threads)

    def run_routed(self, x: torch.Tensor, stacks: "StackRows", topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   threads: int) -> tuple[int, torch.Tensor]:
        """A whole layer's routed experts for the ``T`` tokens of ``x [T, H]`` in one call: ``topk_ids`` /
        ``topk_weights [T, k]`` are grouped by expert in C, each assignment reads its token's row of ``x``, and each
        token's ``k`` outputs are summed in ascending expert id (the order of ``LayerWork.combine``). Returns
        ``(experts used, [T, H] float32)``.

        Raises:
            ValueError: shapes off, a tensor off the CPU, an expert id outside ``[0, num_experts)``.
        """
        t, k = topk_ids.shape
        if (x.dim() != 2 or x.shape != (t, stacks.hidden) or topk_weights.shape != (t, k) or t == 0 or threads < 1
                or any(v.device.type != "cpu" for v in (x, topk_ids, topk_weights))):
            raise ValueError(f"x [T >= 1, {stacks.hidden}], topk ids and weights [T, k] on the CPU and threads >= 1; "
                             f"got {list(x.shape)}, {list(topk_ids.shape)}, {list(topk_weights.shape)}, {threads}")
        xf = x.to(torch.float32).contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        wf = topk_weights.to(torch.float32).contiguous()
        out = torch.empty(t, stacks.hidden, dtype=torch.float32)
        (g, gs), (u, us), (d, ds) = stacks.lies
        used = self._lib.ferry_experts_routed(stacks.qproj, ISAS.index(self.isa), int(threads), g, gs, u, us, d, ds,
                                              stacks.num_experts, stacks.hidden, stacks.inter, xf.data_ptr(), t,
                                              ids.data_ptr(), wf.data_ptr(), k, out.data_ptr())
        self._check(min(used, 0))
        return used, out

    def stack_rows(self, le) -> "StackRows":
        """Where the expert stacks ``le`` (a :class:`~ferrylm.experts.executor.LayerExperts` that
        :meth:`reads_stacks`) lie, for :meth:`run_stacks`: found once per layer.

        Raises:
            ValueError: stacks the kernels do not read.
        """
        if not self.reads_stacks(le):
            raise ValueError("the native kernels read plain bfloat16 / float32 or GGML-block expert stacks on the CPU")
        g, u, d = (stack_bytes(t) for t in (le.gate, le.up, le.down))
        inter, hidden = g.shape[1], d.shape[1]
        row = g.stride(1) * g.element_size()  # bytes per gate|up row

        def lie(t: torch.Tensor, shift: int = 0) -> tuple[int, int]:
            return t.data_ptr() + shift, t.stride(0) * t.element_size()

        return StackRows(stack_qproj(le), hidden, inter, g.shape[0], (lie(g), lie(u, -inter * row), lie(d)),
                         (g, u, d))

    @staticmethod
    def reads_stacks(le) -> bool:
        """Whether :meth:`run_stacks` reads ``le``: host stacks of one plain dtype (bfloat16 / float32), or of one
        GGML block format per projection (Q8_0, Q4_K, Q5_K, Q6_K), each expert contiguous, no expert math."""
        if le.math is not None or any(stack_bytes(t).device.type != "cpu" for t in (le.gate, le.up, le.down)):
            return False
        if all(isinstance(t, torch.Tensor) for t in (le.gate, le.up, le.down)):
            return le.gate.dtype in PLAIN_KIND and le.up.dtype == le.down.dtype == le.gate.dtype and all(
                t[0].is_contiguous() for t in (le.gate, le.up, le.down))
        quant = le.quant
        return quant is not None and all(f.kind in BLOCK_KINDS for f in (quant.gate_up, quant.down)) and all(
            t.data[0].is_contiguous() for t in (le.gate, le.up, le.down))

    def _call(self, x: torch.Tensor, weights: torch.Tensor, qp, bases: list[int], starts: list[int],
              counts: list[int], hidden: int, inter: int, threads: int) -> torch.Tensor:
        """``ferry_experts`` on ``bases`` (three addresses per expert, see the C file) with checked spans: row ``m``
        of the result is its expert's output for row ``m`` of ``x`` times ``weights[m]``."""
        k = len(bases) // 3
        if not bases or len(starts) != k or len(counts) != k:
            raise ValueError(f"{k} rows, {len(starts)} starts and {len(counts)} counts: one of each per expert")
        m = int(x.shape[0])
        if x.dim() != 2 or x.shape[1] != hidden or weights.dim() != 1 or weights.shape[0] != m:
            raise ValueError(f"x must be [M, {hidden}] and weights [M], got {list(x.shape)} and "
                             f"{list(weights.shape)}")
        spans = sorted(zip(starts, counts))
        if any(c < 0 or s < 0 or s + c > m for s, c in spans) or any(
                s0 + c0 > s1 for (s0, c0), (s1, _) in zip(spans, spans[1:])):
            raise ValueError(f"expert spans (starts {starts}, counts {counts}) must lie within the {m} rows of x "
                             f"and not overlap")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if any(t.device.type != "cpu" for t in (x, weights)):
            raise ValueError("the native kernel reads host tensors; got a tensor on another device")
        xf = x.to(torch.float32).contiguous()
        wf = weights.to(torch.float32).contiguous()
        scratch = torch.empty(m, 2 * inter, dtype=torch.float32)
        out = torch.zeros(m, hidden, dtype=torch.float32)
        ptrs = (ctypes.c_void_p * len(bases))(*bases)
        self._check(self._lib.ferry_experts(qp, ISAS.index(self.isa), int(threads), k, ptrs,
                                            (ctypes.c_int64 * k)(*starts), (ctypes.c_int64 * k)(*counts), hidden,
                                            inter, xf.data_ptr(), m, None, wf.data_ptr(), scratch.data_ptr(), None,
                                            1, None, out.data_ptr()))
        return out

    def project(self, x: torch.Tensor, row: torch.Tensor, layout, part: str, threads: int = 1) -> torch.Tensor:
        """One projection of one quantized expert ``row``: ``x [M, K]`` -> ``[M, N]`` float32 (``part``:
        ``gate_up``, ``[2I, H]``, or ``down``, ``[H, I]``)."""
        which = ("gate_up", "down").index(part)
        n, kk = (2 * layout.inter, layout.hidden) if which == 0 else (layout.hidden, layout.inter)
        _check_rows([row], layout, layout.hidden, layout.inter)
        xf = x.to(torch.float32).contiguous()
        if xf.dim() != 2 or xf.shape[1] != kk:
            raise ValueError(f"x must be [M, {kk}], got {list(x.shape)}")
        y = torch.empty(xf.shape[0], n, dtype=torch.float32)
        qp = qproj(layout)
        self._check(self._lib.ferry_matvec((ctypes.c_int64 * 9).from_buffer(qp, 72 * which),
                                           ISAS.index(self.isa), int(threads), 1, (ctypes.c_void_p * 1)(
                                               row.data_ptr()), (ctypes.c_int64 * 1)(n), kk, xf.data_ptr(),
                                           xf.shape[0], y.data_ptr()))
        return y

    def matmul(self, x: torch.Tensor, m: "BlockMatrix", threads: int) -> torch.Tensor:
        """``x [M, K] @ W.T`` for the GGML-block matrix ``m`` (``[N, K]``, read where it lies): ``[M, N]`` float32,
        with ``x`` quantized to 8 bits per 32 inputs as the expert kernels do (any float dtype; widened first).

        Raises:
            ValueError: ``x`` not ``[M, K]`` on the CPU, ``M == 0``, ``threads < 1``.
        """
        if x.dim() != 2 or x.shape[1] != m.k or x.shape[0] == 0 or x.device.type != "cpu":
            raise ValueError(f"x must be a host [M >= 1, {m.k}] tensor, got {list(x.shape)} on {x.device}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        xf = x.to(torch.float32).contiguous()
        y = torch.empty(xf.shape[0], m.n, dtype=torch.float32)
        self._check(self._lib.ferry_matvec(m.qp, ISAS.index(self.isa), int(threads), len(m.segments), m.bases,
                                           m.seg_rows, m.k, xf.data_ptr(), xf.shape[0], y.data_ptr()))
        return y

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                         lens: torch.Tensor, scale: float, threads: int) -> torch.Tensor:
        """One decode token per sequence attending over its positions in a paged pool, read in place:
        ``q [B, Hq, D]`` float32; pools ``k, v [S, Hkv, D]`` float32 or bfloat16 (contiguous); ``slots [B, L]``
        int64 (row b's first ``lens[b]`` are its positions' pool rows); ``lens [B]`` int64, each in ``[1, L]``.
        Returns ``[B, Hq, D]`` float32. Raises ValueError: shapes, dtypes or lengths off."""
        b, hq, d = q.shape
        if (q.dtype != torch.float32 or k.dtype != v.dtype or k.dtype not in (torch.float32, torch.bfloat16)
                or k.shape != v.shape or k.dim() != 3 or k.shape[2] != d or not (k.is_contiguous() and v.is_contiguous())
                or slots.dtype != torch.int64 or lens.dtype != torch.int64 or slots.shape[0] != b or lens.shape != (b,)):
            raise ValueError("decode attention takes q [B, Hq, D] float32, contiguous pools [S, Hkv, D] of float32 or "
                             "bfloat16, slots [B, L] and lens [B] int64")
        qc, sc, lc = q.contiguous(), slots.contiguous(), lens.contiguous()
        out = torch.empty(b, hq, d, dtype=torch.float32)
        self._check(self._lib.ferry_decode_attention(
            ISAS.index(self.isa), int(threads), qc.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
            sc.data_ptr(), sc.shape[1], lc.data_ptr(), b, hq, k.shape[1], d, float(scale), out.data_ptr()))
        return out

    def gather(self, m: "BlockMatrix", idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` (int64 ``[n]``, each in ``[0, N)``) of a one-segment block matrix, dequantized as gguf-py
        does (bit for bit): ``[n, K]`` float32. Raises ValueError: several segments, an index out of range."""
        if len(m.segments) != 1:
            raise ValueError("rows are gathered from a one-segment block matrix")
        ids = idx.to(device="cpu", dtype=torch.int64).contiguous().view(-1)
        out = torch.empty(ids.numel(), m.k, dtype=torch.float32)
        if ids.numel():
            self._check(self._lib.ferry_dequant(m.qp, ISAS.index(self.isa), m.segments[0].data_ptr(), m.n,
                                                ids.data_ptr(), ids.numel(), m.k, out.data_ptr()))
        return out

    def dequantize(self, row: torch.Tensor, layout, part: str) -> torch.Tensor:
        """One projection of a quantized expert ``row`` (an integer kind) as the kernels decode it: ``[N, K]``
        float32, ``v * s + o`` rounded twice (see ``ferry_dequant``)."""
        which = ("gate_up", "down").index(part)
        n, kk = (2 * layout.inter, layout.hidden) if which == 0 else (layout.hidden, layout.inter)
        _check_rows([row], layout, layout.hidden, layout.inter)
        out = torch.empty(n, kk, dtype=torch.float32)
        qp = qproj(layout)
        self._check(self._lib.ferry_dequant((ctypes.c_int64 * 9).from_buffer(qp, 72 * which),
                                            ISAS.index(self.isa), row.data_ptr(), n, None, n, kk, out.data_ptr()))
        return out

    def quantize_activation(self, x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [M, K]`` as the integer kernels read it: int8 codes ``[M, K]`` and float32 scales ``[M, K / block]``
        (``x ~ q * d`` per block); ``block`` 32 for most kinds, 256 for the K-quants (ggml's Q8_K). Raises
        ValueError: ``K`` not a multiple of ``block``, a block other than 32 or 256."""
        xf = x.to(torch.float32).contiguous()
        m, kk = xf.shape
        if block not in (32, 256) or kk % block:
            raise ValueError(f"activations are quantized per 32 or 256 inputs (a multiple of K {kk}), not {block}")
        q, d = torch.empty(m, kk, dtype=torch.int8), torch.empty(m, kk // block, dtype=torch.float32)
        self._check(self._lib.ferry_quantize_act(xf.data_ptr(), m, kk, block, q.data_ptr(), d.data_ptr()))
        return q, d

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise ValueError(f"native expert kernel: {_RC.get(rc, 'error')} (rc {rc})")


def _check_rows(rows: list[torch.Tensor], layout, hidden: int, inter: int) -> None:
    """Raise ValueError unless ``rows`` are contiguous rows of ``layout`` (quantized) or plain rows."""
    if layout is not None:
        if (layout.hidden, layout.inter) != (hidden, inter) or any(
                r.dtype != torch.uint8 or not r.is_contiguous() or r.numel() != layout.numel for r in rows):
            raise ValueError(f"quantized expert rows must be contiguous uint8 [{layout.numel}] tensors")
        if not NativeExpertKernel.supports(layout):
            raise ValueError(f"the native kernels read {NativeExpertKernel.SUPPORTED}, not "
                             f"{layout.quant.describe()} at H {hidden}, I {inter}")
        return
    dt = rows[0].dtype
    if dt not in PLAIN_KIND or any(r.dtype != dt or not r.is_contiguous() or r.numel() != 3 * hidden * inter
                                    for r in rows):
        raise ValueError("expert rows must be contiguous [3*I*H] tensors, all bfloat16 or all float32")


@functools.cache
def _build_once(folder: Path, cc_cmd: tuple[str, ...]) -> NativeExpertKernel:
    """:meth:`NativeExpertKernel.build` for one kernel folder and compiler, once per process (a folder that cannot
    be written would otherwise compile again for every caller)."""
    srcs = read_sources()
    key = hashlib.sha256("\0".join([*srcs.values(), " ".join([*cc_cmd, *CFLAGS]), compiler_version(list(cc_cmd)),
                                     platform.machine()]).encode()).hexdigest()[:16]
    lib_path = folder / f"expert_gemv-{key}.so"
    if lib_path.exists():
        try:
            return NativeExpertKernel._load(lib_path)
        except KernelBuildError as e:  # a broken cached build (truncated, overwritten): build it again
            log.warning("CPU experts: the cached native kernel does not load (%s); rebuilding it", e)
            lib_path.unlink(missing_ok=True)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            os.replace(compile_library(list(cc_cmd), srcs, Path(tmp)), lib_path)
    except OSError as e:
        log.warning("CPU experts: cannot write the kernel cache %s (%s); building the native kernel in a "
                    "temporary folder (set $FERRYLM_CACHE_DIR to a writable folder to keep it)", folder, e)
        with tempfile.TemporaryDirectory(prefix="ferrylm-kernel-") as tmp:
            return NativeExpertKernel._load(compile_library(list(cc_cmd), srcs, Path(tmp)))  # the library outlives its file
    log.info("CPU experts: built the native kernel %s", lib_path)
    return NativeExpertKernel._load(lib_path)


def load_kernel(mode: str, root: Path | None = None) -> NativeExpertKernel | None:
    """The kernel for ``--moe-cpu-kernel mode``: None for ``torch``; for ``auto`` also None (with a warning)
    when the build fails.

    Raises:
        ValueError: unknown mode. KernelBuildError: ``native`` and the build failed.
    """
    if mode not in CPU_KERNELS:
        raise ValueError(f"--moe-cpu-kernel must be one of {', '.join(CPU_KERNELS)}, got {mode!r}")
    if mode == "torch":
        return None
    try:
        return NativeExpertKernel.build(root)
    except KernelBuildError as e:
        if mode == "native":
            raise
        log.warning("CPU experts: native kernel unavailable, using torch matmuls (slower at decode): %s", e)
        return None
