"""The CPU expert pool: computes experts straight from the host banks, beside the device.

One coordinator thread takes a layer's CPU share as one job. The coordinator releases the GIL inside every
kernel, so the calling thread keeps launching device work meanwhile. (Python threads that each ran whole experts
with torch ops would oversubscribe the cores: every such thread gets its own OpenMP team of the full size.)

Kernels (``--moe-cpu-kernel``):
- native (:mod:`ferrylm.experts.cpu_kernel`), when every expert of the job has at most ``NATIVE_MAX_TOKENS``
  tokens (decode): the whole job in one call, one OpenMP region of ``--moe-cpu-threads`` threads.
- torch otherwise: the experts one after another, each two matmuls on torch's intra-op pool (sized to
  ``--moe-cpu-threads``, default physical cores). ``gate | up`` are one ``[2I, H]`` block of the expert row, so an
  expert is ``y = down @ (silu(g) * u)`` with ``[g; u] = [gate; up] @ x`` (Jiang et al. 2024, "Mixtral of
  Experts", eq. 3). In bfloat16 torch dispatches these CPU matmuls to oneDNN, which accumulates in float32 (and
  uses AMX tiles where the CPU has them).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.executor import ExpertMath
from ferrylm.experts.quantized import dense
from ferrylm.experts.cpu_kernel import NATIVE_MAX_TOKENS, NativeExpertKernel, load_kernel

log = logging.getLogger("ferrylm.experts")


def physical_cores() -> int:
    """Physical CPU cores (logical ones when psutil cannot tell)."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # noqa: BLE001 - psutil missing or unsupported platform
        n = None
    return int(n or os.cpu_count() or 1)


def cpu_expert(x: torch.Tensor, row: torch.Tensor, layout: ExpertLayout, math: ExpertMath | None = None,
               e: int = 0) -> torch.Tensor:
    """One expert on the CPU: ``x [N, H]`` and the expert's ``row [S]`` -> ``[N, H]`` in ``x``'s dtype (quantized
    rows are dequantized to it first: the reference path; ``math``: expert ``e``'s biases and clamped SwiGLU)."""
    i = layout.inter
    if math is not None:
        gu = dense(layout.gate_up(row), x.dtype)
        return math.expert(x, gu[:i], gu[i:], dense(layout.down(row), x.dtype), e)
    gu = F.linear(x, dense(layout.gate_up(row), x.dtype))
    return F.linear(F.silu(gu[:, :i]) * gu[:, i:], dense(layout.down(row), x.dtype))


@dataclass
class CpuJob:
    """A layer's CPU share.

    Attributes:
        x: ``[M, H]`` host activations: the rows of every assignment of the job's experts, grouped by expert.
        weights: ``[M]`` float32 routing weights, same order.
        items: ``(expert id, host row [S], start, count)`` per expert; rows ``start : start + count`` of ``x``.
        out_dtype: dtype of the returned contributions.
        math: the layer's :class:`~ferrylm.experts.executor.ExpertMath` (host tensors), None = plain SwiGLU.
    """

    x: torch.Tensor
    weights: torch.Tensor
    items: list[tuple[int, torch.Tensor, int, int]]
    out_dtype: torch.dtype
    math: ExpertMath | None = None


class CpuExpertPool:
    """Runs :class:`CpuJob` s on a coordinator thread (see the module docstring).

    Args:
        threads: threads for the expert kernels; None keeps torch's setting (physical cores by default).
            NOTE: torch's intra-op pool is process-wide; setting it here sets it for the whole engine process.
        kernel: ``--moe-cpu-kernel`` (see :mod:`ferrylm.experts.cpu_kernel`).

    Raises:
        ValueError: ``kernel`` unknown, or ``native`` for experts in a dtype it does not read.
        KernelBuildError: ``kernel="native"`` and the build failed.
    """

    def __init__(self, layout: ExpertLayout, threads: int | None = None, kernel: str = "auto"):
        self.layout = layout
        if threads is not None and threads != torch.get_num_threads():
            log.info("CPU experts: torch intra-op threads %d -> %d (--moe-cpu-threads)", torch.get_num_threads(),
                     threads)
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        if self.threads > (os.cpu_count() or self.threads):
            log.warning("CPU experts: %d threads on %d CPUs (--moe-cpu-threads): torch's intra-op pool is "
                        "process-wide, so every CPU op (not only the experts) will be oversubscribed and slow",
                        self.threads, os.cpu_count())
        if kernel == "native" and not NativeExpertKernel.supports(layout):
            raise ValueError(f"--moe-cpu-kernel native reads {NativeExpertKernel.SUPPORTED}, not "
                             f"{layout.quant.describe() if layout.quant else layout.dtype}")
        self.native = load_kernel(kernel) if NativeExpertKernel.supports(layout) else None
        self.kernel_name = f"native-{self.native.isa}" if self.native else "torch"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrylm-cpu-experts")

    def _run(self, job: CpuJob) -> tuple[list[torch.Tensor], float]:
        t0 = time.perf_counter()
        outs = []
        with torch.inference_mode():
            if self.native is not None and job.math is None and self._native_fits(job):
                y = self.native.run(job.x, job.weights, [row for _, row, _, _ in job.items],
                                    [s for _, _, s, _ in job.items], [n for *_, n in job.items], self.layout.hidden,
                                    self.layout.inter, self.threads,
                                    layout=self.layout if self.layout.quant is not None else None)
                return [y.to(job.out_dtype)], time.perf_counter() - t0
            for e, row, start, n in job.items:
                y = cpu_expert(job.x[start:start + n], row, self.layout, job.math, e)
                outs.append((y.float() * job.weights[start:start + n, None]).to(job.out_dtype))
        return outs, time.perf_counter() - t0

    @staticmethod
    def _native_fits(job: CpuJob) -> bool:
        """Decode-sized experts (at most ``NATIVE_MAX_TOKENS`` tokens each) whose spans tile ``job.x`` in item
        order (so the kernel's ``[M, H]`` output is the items' outputs concatenated, as the torch path returns)."""
        pos = 0
        for *_, start, n in job.items:
            if start != pos or n > NATIVE_MAX_TOKENS:
                return False
            pos += n
        return pos == job.x.shape[0]

    def submit(self, job: CpuJob) -> Future:
        """Start ``job``; the future gives ``(weighted outputs, seconds)``: a list of ``[count, H]`` tensors whose
        concatenation is ``[M, H]`` in the job's row order (one tensor per expert, or one for the whole job)."""
        return self._pool.submit(self._run, job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
