"""The native CPU expert kernel (``native/expert_gemv.c``): built once per machine, called through ctypes.

Why: at decode a CPU expert is a GEMV bound by host memory bandwidth, and the torch path (two oneDNN matmuls and
six elementwise ops per expert, each its own parallel region) measured 0.4-0.7 ms per 9 MiB Qwen3-30B-A3B expert
on the H200 host (13-23 GB/s) against a DRAM that reads at ~90 GB/s. The native kernel computes a layer's whole
CPU share in one OpenMP region (see the C file's header for the arithmetic).

Build: the host C compiler (``$CC``, default ``cc``) with ``-O3 -march=native -fopenmp``, into
``<cache root>/kernels/expert_gemv-<key>.so`` where the key hashes the source, the compile command, the compiler's
version and the CPU's feature flags from ``/proc/cpuinfo`` (so a cache folder shared between machines does not
hand one a binary built for another's instruction set; where ``/proc/cpuinfo`` is missing only the processor
name is hashed). The build takes about a second and is written atomically, so concurrent processes may race on it
safely; a cache folder that cannot be written gives an uncached build in a temporary folder.

``--moe-cpu-kernel``: ``auto`` (native when it builds, else torch with a warning), ``native`` (fail when it does
not build), ``torch``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ferrylm.cachedir import cache_root
from ferrylm.config import CPU_KERNELS
from ferrylm.errors import FerryError

log = logging.getLogger("ferrylm.experts")

# NOTE: the kernel reads each weight row once per 4 tokens; from ~8 tokens per expert oneDNN's blocked GEMM
# (one read of the weights for all tokens) is the better kernel, so the pool uses torch above this.
NATIVE_MAX_TOKENS = 8
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_ISA = {0: "scalar", 1: "avx2", 2: "avx512"}
_WDTYPE = {torch.bfloat16: 0, torch.float32: 1}


class KernelBuildError(FerryError):
    """The native kernel could not be compiled or loaded (message: the command and the compiler's output)."""

    code = "cpu_kernel_unavailable"
    param = "--moe-cpu-kernel"


def _source() -> str:
    return resources.files("ferrylm.experts").joinpath("native/expert_gemv.c").read_text()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler_version(cc: list[str]) -> str:
    try:
        return subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"no C compiler {' '.join(cc)!r} ({e}); set $CC or use --moe-cpu-kernel torch") from e


def _compile(cc: list[str], src: str, folder: Path) -> Path:
    """Compile ``src`` in ``folder``; returns the library's path. Raises KernelBuildError (the compiler failed) or
    OSError (``folder`` not writable)."""
    c_file, out = folder / "expert_gemv.c", folder / "expert_gemv.so"
    c_file.write_text(src)
    cmd = [*cc, *CFLAGS, str(c_file), "-o", str(out), "-lm"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{' '.join(cmd)}: {e}") from e
    if r.returncode != 0:
        raise KernelBuildError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    if not out.is_file():
        raise KernelBuildError(f"{' '.join(cmd)} exited 0 but wrote no library")
    return out


@dataclass
class NativeExpertKernel:
    """A loaded build of the native kernel.

    Attributes:
        path: the shared library. isa: the instruction set it was compiled for (``avx512``, ``avx2``, ``scalar``).
    """

    path: Path
    isa: str
    _lib: ctypes.CDLL

    @classmethod
    def build(cls, root: Path | None = None, cc: str | None = None) -> "NativeExpertKernel":
        """Compile (or reuse the cached build) and load. ``cc``: the compiler command (default ``$CC``, else
        ``cc``; split like a shell word list, so ``"ccache gcc"`` works). When the cache folder cannot be written,
        the kernel is built in a temporary folder (a warning says so) and not cached.

        Raises:
            KernelBuildError: no compiler, the compile failed, or the library does not load.
        """
        cc_cmd = shlex.split(cc or os.environ.get("CC") or "cc")
        src = _source()
        key = hashlib.sha256("\0".join([src, " ".join(cc_cmd + CFLAGS), _compiler_version(cc_cmd),
                                         _cpu_flags()]).encode()).hexdigest()[:16]
        folder = (root or cache_root()) / "kernels"
        lib_path = folder / f"expert_gemv-{key}.so"
        if lib_path.exists():
            try:
                return cls._load(lib_path)
            except KernelBuildError as e:  # a broken cached build (truncated, overwritten): build it again
                log.warning("CPU experts: the cached native kernel does not load (%s); rebuilding it", e)
                lib_path.unlink(missing_ok=True)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                os.replace(_compile(cc_cmd, src, Path(tmp)), lib_path)
        except OSError as e:
            log.warning("CPU experts: cannot write the kernel cache %s (%s); building the native kernel in a "
                        "temporary folder (set $FERRYLM_CACHE_DIR to a writable folder to keep it)", folder, e)
            with tempfile.TemporaryDirectory(prefix="ferrylm-kernel-") as tmp:
                return cls._load(_compile(cc_cmd, src, Path(tmp)))  # Linux: the loaded library outlives its file
        log.info("CPU experts: built the native kernel %s", lib_path)
        return cls._load(lib_path)

    @classmethod
    def _load(cls, lib_path: Path) -> "NativeExpertKernel":
        try:
            lib = ctypes.CDLL(str(lib_path))
        except OSError as e:
            raise KernelBuildError(f"cannot load {lib_path}: {e}") from e
        fn = lib.ferry_expert_gemv
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                       ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fq = lib.ferry_expert_gemv_q
        fq.restype = ctypes.c_int
        fq.argtypes = [ctypes.POINTER(ctypes.c_int64)] + fn.argtypes[1:]
        lib.ferry_isa.restype = ctypes.c_int
        return cls(path=lib_path, isa=_ISA.get(lib.ferry_isa(), "?"), _lib=lib)

    SUPPORTED = "bfloat16 or float32 experts, or quantized int4 / int8 / fp4 / fp8 / GGML-block ones"

    @staticmethod
    def supports(layout) -> bool:
        """Whether the kernel reads experts of ``layout`` (an :class:`~ferrylm.experts.banks.ExpertLayout`):
        plain bfloat16 and float32 rows, and quantized rows of every :mod:`~ferrylm.experts.quantized` format
        (GGML blocks Q8_0 / Q4_K / Q5_K / Q6_K included: each weight row decoded into float32, then dotted)."""
        return layout.quant is not None or layout.dtype in _WDTYPE

    def run(self, x: torch.Tensor, weights: torch.Tensor, rows: list[torch.Tensor], starts: list[int],
            counts: list[int], hidden: int, inter: int, threads: int, layout=None) -> torch.Tensor:
        """A layer's CPU share in one call.

        Args:
            x: ``[M, H]`` host activations (any float dtype; widened to float32).
            weights: ``[M]`` host routing weights, same order.
            rows: one ``[S]`` host row per expert (``S = 3 * I * H``: gate|up ``[2I, H]`` then down ``[H, I]``),
                contiguous, all bfloat16 or all float32.
            starts, counts: expert ``e`` owns rows ``starts[e] : starts[e] + counts[e]`` of ``x`` (within ``M``).
            hidden, inter: ``H`` and ``I``. threads: OpenMP threads for the call (>= 1).
            layout: the rows' :class:`~ferrylm.experts.banks.ExpertLayout` when they are quantized (uint8 rows of
                ``layout.numel`` bytes; each weight row is dequantized in float32 and dotted, see the C file);
                None for plain rows.

        Returns:
            ``[M, H]`` float32: ``w_m * down_e @ (silu(g) * u)`` for every row an expert owns (see the C file's
            header); rows no expert owns are zero.

        Raises:
            ValueError: a tensor not on the CPU, mismatched shapes or spans, a non-contiguous row, an unsupported
                weight dtype, ``threads < 1``.
        """
        k = len(rows)
        if not rows or len(starts) != k or len(counts) != k:
            raise ValueError(f"{k} rows, {len(starts)} starts and {len(counts)} counts: one of each per expert")
        if x.dim() != 2 or x.shape[1] != hidden or weights.dim() != 1 or weights.shape[0] != x.shape[0]:
            raise ValueError(f"x must be [M, {hidden}] and weights [M], got {list(x.shape)} and "
                             f"{list(weights.shape)}")
        m = int(x.shape[0])
        spans = sorted(zip(starts, counts))
        if any(c < 0 or s < 0 or s + c > m for s, c in spans) or any(
                s0 + c0 > s1 for (s0, c0), (s1, _) in zip(spans, spans[1:])):
            raise ValueError(f"expert spans (starts {starts}, counts {counts}) must lie within the {m} rows of x "
                             f"and not overlap")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        quant = layout.quant if layout is not None else None
        dt = rows[0].dtype
        if quant is not None:
            if (layout.hidden, layout.inter) != (hidden, inter) or any(
                    r.dtype != torch.uint8 or not r.is_contiguous() or r.numel() != layout.numel for r in rows):
                raise ValueError(f"quantized expert rows must be contiguous uint8 [{layout.numel}] tensors")
        elif dt not in _WDTYPE or any(r.dtype != dt or not r.is_contiguous() or r.numel() != 3 * hidden * inter
                                      for r in rows):
            raise ValueError("expert rows must be contiguous [3*I*H] tensors, all bfloat16 or all float32")
        if any(t.device.type != "cpu" for t in (x, weights, *rows)):
            raise ValueError("the native kernel reads host tensors; got a tensor on another device")
        xf = x.to(torch.float32).contiguous()
        wf = weights.to(torch.float32).contiguous()
        scratch = torch.empty(m, 2 * inter, dtype=torch.float32)
        out = torch.zeros(m, hidden, dtype=torch.float32)
        ptrs = (ctypes.c_void_p * k)(*[r.data_ptr() for r in rows])
        args = (int(threads), k, ptrs, (ctypes.c_int64 * k)(*starts), (ctypes.c_int64 * k)(*counts), hidden, inter,
                xf.data_ptr(), wf.data_ptr(), scratch.data_ptr(), out.data_ptr())
        if quant is not None:
            rc = self._lib.ferry_expert_gemv_q(_qproj(layout), *args)
        else:
            rc = self._lib.ferry_expert_gemv(_WDTYPE[dt], *args)
        if rc != 0:
            raise ValueError(f"native expert kernel rejected its arguments (rc {rc})")
        return out


_QKIND = {"int4": 1, "int8": 2, "fp4": 3, "fp8": 4, "q8_0": 5, "q4_k": 6, "q5_k": 7, "q6_k": 8}
_SDTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}


def _qproj(layout):
    """The C ``qproj[2]`` (gate|up, down) of a quantized ``layout``: kind, group, scale dtype, mins, row scale and
    the fields' byte offsets in the expert row (``ExpertLayout._rows``), as 18 int64."""
    vals = []
    for fmt, fields in ((layout.quant.gate_up, layout._rows[0]), (layout.quant.down, layout._rows[1])):
        off = {name: o for name, o, _, _ in fields.fields}
        if fmt.kind == "kmix":  # the tag's offset in the scales slot, the widest kind (row padding) in sdtype
            vals += [9, fmt.group, _QKIND[fmt.mix[-1]], 0, 0, off["data"], off["tag"], 0, 0]
            continue
        vals += [_QKIND[fmt.kind], fmt.group, _SDTYPE[fmt.scale_dtype], int(fmt.mins), int(fmt.row_scale),
                 off["data"], off.get("scales", 0), off.get("mins", 0), off.get("row_scale", 0)]
    return (ctypes.c_int64 * len(vals))(*vals)


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
