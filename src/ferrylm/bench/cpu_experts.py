"""``ferry bench cpu-experts``: the CPU expert pool's unit of work (one job: a layer's CPU share of ``k`` experts, one
token each, as at batch-1 decode) timed per kernel (``--moe-cpu-kernel``), thread count and ``k``.

Conditions of the real thing, each optional: the job runs on the pool's coordinator thread while the calling
thread waits (always); the calling thread busy for ``--gap-ms`` between jobs (launching device work, as the
engine does between layers); pinned host->device copies streaming on a side CUDA stream during the jobs
(``--dma``: the expert prefetch reads the same DRAM as the CPU). The experts are distinct rows of a bank larger
than the CPU caches (``--bank-experts``), visited in a strided order, so every job reads its weights from DRAM.

Reported per configuration: median and 90th-percentile seconds per job and the weight bytes per second at the
median (``k * expert bytes / median``). ``--quant`` times quantized rows too (the formats of
``synthetic:<preset>:quant=Q``): their expert bytes are the quantized ones, so ``gb_s`` is stored bytes per second.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

import torch

from ferrylm.bench.report import write_json
from ferrylm.config import CPU_KERNELS
from ferrylm.experts.cpu_kernel import KernelBuildError
from ferrylm.experts.executor import ExpertLayout, LayerExperts
from ferrylm.experts.cpu_pool import CpuExpertPool, CpuJob, physical_cores


@dataclass
class CpuExpertsRow:
    """One configuration's timing (seconds per job; ``gb_s``: expert weight bytes per second at the median)."""

    kernel: str
    quant: str
    threads: int
    experts: int
    dma: bool
    median_s: float
    p90_s: float
    gb_s: float


def _dma_stream(bank: torch.Tensor, seconds: float):
    """Queue pinned host->device copies of bank rows for about ``seconds`` at 55 GB/s on a side stream; returns
    the stream (synchronize it to end), or None without CUDA."""
    if not torch.cuda.is_available() or not bank.is_pinned():
        return None
    side = torch.cuda.Stream()
    dst = torch.empty(4, bank.shape[1], dtype=bank.dtype, device="cuda")
    n = max(1, int(seconds * 55e9 / bank[0].nbytes))
    with torch.cuda.stream(side):
        for i in range(n):
            dst[i % 4].copy_(bank[(i * 7) % bank.shape[0]], non_blocking=True)
    return side


def time_jobs(pool: CpuExpertPool, bank: torch.Tensor, layout: ExpertLayout, k: int, jobs: int, gap_s: float,
              dma: bool) -> tuple[float, float]:
    """Median and p90 seconds of ``jobs`` jobs of ``k`` experts (one token each) through ``pool``.

    Args:
        bank: ``[E, S]`` host expert rows (pinned for ``dma``). gap_s: calling thread busy between jobs (s).
        dma: stream host->device copies meanwhile (needs CUDA and a pinned bank; silently off otherwise).
    """
    e = bank.shape[0]
    x = torch.randn(1, layout.hidden).to(layout.dtype).expand(k, layout.hidden).contiguous()
    w = torch.rand(k)

    def job(j: int) -> CpuJob:
        ids = [(j * k * 13 + i * 31) % e for i in range(k)]
        return CpuJob(x=x, weights=w, items=[(d, bank[d], i, 1) for i, d in enumerate(ids)], out_dtype=layout.dtype)

    for j in range(3):  # warm-up: kernel build/load, thread teams
        pool.submit(job(j)).result()
    side = _dma_stream(bank, jobs * (k * 0.6e-3 + gap_s) + 0.2) if dma else None
    times = []
    for j in range(jobs):
        t0 = time.perf_counter()
        pool.submit(job(j + 3)).result()
        times.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        while time.perf_counter() - t1 < gap_s:
            pass
    if side is not None:
        side.synchronize()
    times.sort()
    return times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.9))]


def _bank(layout: ExpertLayout, quant: str, bank_experts: int, pin: bool) -> torch.Tensor:
    """``[bank_experts, S]`` host rows of random experts (plain, or codes of the ``quant`` format)."""
    bank = torch.empty(bank_experts, layout.numel, dtype=layout.row_dtype, pin_memory=pin)
    if layout.quant is None:
        return bank.copy_(torch.randn(bank_experts, layout.numel).mul_(0.02))
    from ferrylm.synthetic.quant import CodePool, random_stack

    pool, h, i = CodePool(0), layout.hidden, layout.inter
    le = {p: random_stack(pool, fmt, bank_experts, n, k, k ** -0.5, f"bench.{p}", device="cpu", dtype=layout.dtype)
          for p, fmt, n, k in (("gate", layout.quant.gate_up, i, h), ("up", layout.quant.gate_up, i, h),
                               ("down", layout.quant.down, h, i))}

    layout.pack(bank, LayerExperts(**le))
    return bank


def run_cpu_experts_bench(*, hidden: int, inter: int, dtype: torch.dtype, kernels: list[str], threads: list[int],
                          experts: list[int], jobs: int, gap_s: float, dma: bool, bank_experts: int,
                          quants: tuple[str, ...] = ("none",), progress=print) -> list[CpuExpertsRow]:
    """Time every (kernel, threads, experts per job) combination; see the module docstring.

    Raises:
        ValueError / KernelBuildError: as :class:`~ferrylm.experts.cpu_pool.CpuExpertPool` (``native`` that does
            not build, an unknown kernel).
    """
    from ferrylm.synthetic.quant import SYNTHETIC_FORMATS

    rows = []
    for quant in quants:
        layout = ExpertLayout(hidden=hidden, inter=inter, dtype=dtype,
                              quant=None if quant == "none" else SYNTHETIC_FORMATS[quant])
        if layout.quant is not None:
            layout.quant.check(hidden, inter)
        bank = _bank(layout, quant, bank_experts, dma and torch.cuda.is_available())
        for kernel in kernels:
            for th in threads:
                pool = CpuExpertPool(layout, th, kernel)
                try:
                    for k in experts:
                        med, p90 = time_jobs(pool, bank, layout, k, jobs, gap_s, dma)
                        row = CpuExpertsRow(kernel=pool.kernel_name, quant=quant, threads=pool.threads, experts=k,
                                            dma=bool(dma and bank.is_pinned()), median_s=med, p90_s=p90,
                                            gb_s=k * layout.nbytes / med / 1e9)
                        rows.append(row)
                        progress(f"{quant:<6} {row.kernel:<16} threads {row.threads:>3}  experts/job {k:>2}  dma "
                                 f"{int(row.dma)}  median {med * 1e3:7.3f} ms  p90 {p90 * 1e3:7.3f} ms  "
                                 f"{row.gb_s:6.1f} GB/s")
                finally:
                    pool.close()
    return rows


def _int_list(flag: str, text: str, low: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < low for v in values):
        raise ValueError(f"{flag} takes a comma-separated list of integers >= {low}, got {text!r}")
    return values


def main(args) -> int:
    """CLI entry (``ferry bench cpu-experts``). Returns the exit code; bad flags print a message naming the flag."""
    try:
        experts = _int_list("--experts", args.experts, 1)
        threads = _int_list("--threads", args.threads, 1) if args.threads else [physical_cores()]
        kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
        if not kernels or any(k not in CPU_KERNELS for k in kernels):
            raise ValueError(f"--kernels takes a comma-separated list of {', '.join(CPU_KERNELS)}, got "
                             f"{args.kernels!r}")
        for flag, v, low in (("--jobs", args.jobs, 1), ("--hidden", args.hidden, 1), ("--inter", args.inter, 1)):
            if v < low:
                raise ValueError(f"{flag} must be >= {low}, got {v}")
        if args.bank_experts < max(experts):
            raise ValueError(f"--bank-experts ({args.bank_experts}) must be >= the largest --experts value "
                             f"({max(experts)})")
        if args.dma == "on" and not torch.cuda.is_available():
            raise ValueError("--dma on needs a CUDA device (the copies go host -> device); use --dma off or auto")
        if args.gap_ms < 0:
            raise ValueError(f"--gap-ms must be >= 0, got {args.gap_ms}")
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
        from ferrylm.synthetic.spec import SYNTHETIC_QUANT

        quants = tuple(q.strip() for q in args.quant.split(",") if q.strip())
        if not quants or any(q != "none" and q not in SYNTHETIC_QUANT for q in quants):
            raise ValueError(f"--quant takes a comma-separated list of none, {', '.join(SYNTHETIC_QUANT)}, got "
                             f"{args.quant!r}")
        dma = args.dma == "on" or (args.dma == "auto" and torch.cuda.is_available())
        rows = run_cpu_experts_bench(hidden=args.hidden, inter=args.inter, dtype=dtype, kernels=kernels,
                                     threads=threads, experts=experts, jobs=args.jobs, gap_s=args.gap_ms / 1e3,
                                     dma=dma, bank_experts=args.bank_experts, quants=quants)
    except (ValueError, KernelBuildError) as e:
        print(f"ferry bench cpu-experts: {e}", file=sys.stderr)
        return 2
    if args.output_json:
        write_json(args.output_json, {"hidden": args.hidden, "inter": args.inter, "dtype": args.dtype,
                                      "gap_ms": args.gap_ms, "rows": [asdict(r) for r in rows]})
    return 0
