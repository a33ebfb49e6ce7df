"""``ferry bench bw``: this machine's copy and memory rates and the CPU expert kernel per format, as a table with
the verdict they imply, saved as the machine profile the boot starts from (:mod:`ferrylm.experts.machine_profile`).

Measured with the probes of :mod:`ferrylm.experts.bandwidth`: pinned host->device and device->host copies, a host
read, a device copy (read + write), and per expert format the CPU pool's kernel on jobs of ``--experts-per-job``
distinct experts, one token each, walking a bank of ``--bank-mib`` (beyond the CPU caches), at each thread count
of ``--threads``: alone, and while host->device copies stream on another thread
(:class:`~ferrylm.experts.bandwidth.BackgroundCopies`). Without a GPU the "device" is host memory: every copy is a
host memcpy, and the table says so.

Verdict per format, from the best thread count (the fewest threads within 3 % of the fastest; beside copies on a
GPU host, alone without one) and ``c`` its rate beside copies against ``p`` the host->device rate: ``cpu`` when
``c >= p`` (the CPU computes a missed expert before PCIe could bring it); ``hybrid`` when the CPU would take at
least ``HYBRID_MIN_SHARE`` of a step's misses (``c / (c + p)``, the hybrid split's share); else ``offload`` (a
smaller CPU share does not pay for its per-layer job latency). Without a GPU: ``resident`` (what ``auto`` serves
on ``--device cpu``).
"""

from __future__ import annotations

import datetime as _dt
import sys
from dataclasses import dataclass

import torch

from ferrylm.bench.report import write_json
from ferrylm.experts.bandwidth import (BackgroundCopies, copy_rate, cpu_expert_rate, cpu_job_latency, device_sync,
                                       host_read_rate, probe_rows)
from ferrylm.experts.cpu_kernel import KernelBuildError
from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.cpu_pool import CpuExpertPool, physical_cores
from ferrylm.experts.machine_profile import (FormatProfile, MachineProfile, ThreadRates, current_machine,
                                             format_key, save_profile)

PLAIN_FORMATS = {"bf16": torch.bfloat16, "f32": torch.float32}
HYBRID_MIN_SHARE = 0.2
BEST_WITHIN = 0.97  # the best thread count: the fewest threads reaching this share of the fastest


@dataclass(frozen=True)
class BwConfig:
    """What to measure (sizes in bytes; ``formats``: ``bf16``, ``f32`` or a ``synthetic:...:quant=`` name)."""

    device: torch.device
    formats: tuple[str, ...]
    threads: tuple[int, ...]
    hidden: int = 2048
    inter: int = 768
    experts_per_job: int = 8
    bank_bytes: int = 512 << 20
    copy_bytes: int = 256 << 20
    host_bytes: int = 1 << 30
    jobs: int = 20
    reps: int = 5
    kernel: str = "auto"


def all_formats() -> tuple[str, ...]:
    """Every expert format `bench bw` can time: the plain dtypes and each synthetic quantization."""
    from ferrylm.synthetic.spec import SYNTHETIC_QUANT

    return (*PLAIN_FORMATS, *SYNTHETIC_QUANT)


def default_threads(cores: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``cores``, then ``cores``."""
    out, t = [], 1
    while t < cores:
        out.append(t)
        t *= 2
    return (*out, cores)


def format_layout(name: str, hidden: int, inter: int) -> ExpertLayout:
    """The expert layout of format ``name`` (quantized formats compute in bfloat16). Raises ValueError for an
    unknown name or shapes its groups do not divide."""
    if name in PLAIN_FORMATS:
        return ExpertLayout(hidden, inter, PLAIN_FORMATS[name])
    from ferrylm.synthetic.quant import SYNTHETIC_FORMATS

    if name not in SYNTHETIC_FORMATS:
        raise ValueError(f"--formats: unknown format {name!r}; formats: {', '.join(all_formats())}")
    quant = SYNTHETIC_FORMATS[name]
    quant.check(hidden, inter)
    return ExpertLayout(hidden, inter, torch.bfloat16, quant=quant)


def best_threads(rates: tuple[ThreadRates, ...], with_copies: bool) -> int:
    """The fewest threads within ``BEST_WITHIN`` of the fastest rate (beside copies, or alone)."""
    rate = (lambda r: r.with_copies) if with_copies else (lambda r: r.alone)
    top = max(rate(r) for r in rates)
    return min(r.threads for r in rates if rate(r) >= BEST_WITHIN * top)


def verdict(row: ThreadRates, h2d: float, gpu: bool) -> tuple[str, str]:
    """``(backend, reason)`` for a format whose best thread count measured ``row`` (module docstring)."""
    c, p = row.with_copies, h2d
    if not gpu:
        return "resident", (f"no GPU: experts stay in host memory (auto serves resident on --device cpu); the CPU "
                            f"kernel reads {row.alone / 1e9:.1f} GB/s with {row.threads} thread(s)")
    rates = f"{c / 1e9:.1f} GB/s on the CPU beside copies vs {p / 1e9:.1f} GB/s host->device"
    if c >= p:
        return "cpu", f"the CPU computes a missed expert faster than PCIe brings it ({rates})"
    share = c / (c + p)
    if share >= HYBRID_MIN_SHARE:
        return "hybrid", f"the CPU would take {100 * share:.0f} % of a step's misses ({rates})"
    return "offload", (f"the CPU would take only {100 * share:.0f} % of a step's misses ({rates}), less than its "
                       f"per-layer job latency costs")


def _measure_format(cfg: BwConfig, name: str, h2d: float, progress) -> tuple[str, FormatProfile]:
    """``(format_key, profile)`` of format ``name``: the kernel at every thread count, the verdict."""
    layout = format_layout(name, cfg.hidden, cfg.inter)
    bank = probe_rows(layout, max(cfg.experts_per_job, cfg.bank_bytes // layout.nbytes))
    rates, kernel = [], "torch"
    for th in cfg.threads:
        pool = CpuExpertPool(layout, th, cfg.kernel)
        try:
            kernel = pool.kernel_name
            alone = cpu_expert_rate(pool, bank, layout, cfg.experts_per_job, cfg.jobs)
            with BackgroundCopies(cfg.device, cfg.copy_bytes) as copies:
                beside = cpu_expert_rate(pool, bank, layout, cfg.experts_per_job, cfg.jobs)
        finally:
            pool.close()
        rates.append(ThreadRates(threads=pool.threads, alone=alone, with_copies=beside, copies_during=copies.rate))
        progress(f"  {name:<7} {kernel:<15} threads {pool.threads:>3}: {alone / 1e9:6.1f} GB/s alone, "
                 f"{beside / 1e9:6.1f} beside copies ({copies.rate / 1e9:.1f} GB/s copied meanwhile)")
    gpu = cfg.device.type == "cuda"
    best = best_threads(tuple(rates), with_copies=gpu)
    row = next(r for r in rates if r.threads == best)
    pool = CpuExpertPool(layout, best, cfg.kernel)
    try:
        latency = cpu_job_latency(pool, bank[0], layout, cfg.device, row.alone, cfg.reps)
    finally:
        pool.close()
    backend, reason = verdict(row, h2d, gpu)
    return format_key(layout), FormatProfile(name=name, kernel=kernel, expert_bytes=layout.nbytes,
                                             rates=tuple(rates), best_threads=best, cpu_latency=latency,
                                             backend=backend, reason=reason)


def run_bw(cfg: BwConfig, progress=print) -> MachineProfile:
    """Measure everything of ``cfg`` (module docstring); returns the profile (not saved)."""
    dev, sync, torch_threads = cfg.device, device_sync(cfg.device), torch.get_num_threads()
    gpu = dev.type == "cuda"
    host = torch.ones(cfg.host_bytes // 4, dtype=torch.float32)
    host_rate = host_read_rate(host, cfg.reps)
    del host
    src = torch.ones(cfg.copy_bytes, dtype=torch.uint8, pin_memory=gpu)
    back = torch.empty(cfg.copy_bytes, dtype=torch.uint8, pin_memory=gpu)
    on_dev = torch.empty(cfg.copy_bytes, dtype=torch.uint8, device=dev)
    h2d, d2h = copy_rate(on_dev, src, sync, cfg.reps), copy_rate(back, on_dev, sync, cfg.reps)
    hbm = 2 * copy_rate(torch.empty_like(on_dev), on_dev, sync, cfg.reps)
    del src, back, on_dev
    progress(f"copies: host->device {h2d / 1e9:.1f} GB/s, device->host {d2h / 1e9:.1f}, host read "
             f"{host_rate / 1e9:.1f}, device copy {hbm / 1e9:.1f}")
    try:
        formats = dict(_measure_format(cfg, name, h2d, progress) for name in cfg.formats)
    finally:
        torch.set_num_threads(torch_threads)   # the pools set torch's process-wide intra-op threads
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return MachineProfile(machine=current_machine(dev), measured_at=stamp, copies="cuda" if gpu else "memcpy",
                          h2d=h2d, d2h=d2h, host=host_rate, hbm=hbm, formats=formats)


def format_table(p: MachineProfile, cfg: BwConfig) -> str:
    """The profile as the command prints it: the copy rates, the kernel per format and thread count, the
    verdicts."""
    gb = lambda v: f"{v / 1e9:7.1f}"  # noqa: E731
    memcpy = p.copies == "memcpy"
    note = "  (no GPU: the 'device' is host memory, every copy a host memcpy)" if memcpy else ""
    lines = [f"ferry bench bw  {p.machine.id}  {p.measured_at}{note}",
             f"  host->device {gb(p.h2d)} GB/s{'' if memcpy else '  (pinned)'}",
             f"  device->host {gb(p.d2h)} GB/s{'' if memcpy else '  (pinned)'}",
             f"  host read    {gb(p.host)} GB/s",
             f"  device copy  {gb(p.hbm)} GB/s  (read + write)",
             f"CPU expert kernel: {cfg.experts_per_job} experts x 1 token per job, H {cfg.hidden}, I {cfg.inter}; "
             f"GB/s of expert weight bytes; copies = host->device {'memcpy' if memcpy else 'copies'} on a thread",
             f"  {'format':<8} {'kernel':<15} {'MiB/expert':>10} {'threads':>7} {'alone':>7} {'w/ copies':>9} "
             f"{'copies':>7}"]
    for fp in p.formats.values():
        for r in fp.rates:
            best = " *" if r.threads == fp.best_threads else ""
            lines.append(f"  {fp.name:<8} {fp.kernel:<15} {fp.expert_bytes / 2**20:>10.2f} {r.threads:>7} "
                         f"{gb(r.alone)} {gb(r.with_copies):>9} {gb(r.copies_during)}{best}")
    lines.append("verdict (* = best thread count):")
    for fp in p.formats.values():
        n = fp.best_threads
        lines.append(f"  {fp.name:<8} {fp.backend}, {n} CPU thread{'s' if n > 1 else ''}: {fp.reason}")
    return "\n".join(lines)


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes a comma-separated list of integers >= 1, got {text!r}")
    return values


def config_from_args(args) -> BwConfig:
    """``ferry bench bw``'s flags as a :class:`BwConfig`. Raises ValueError naming the flag."""
    try:
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              "cpu" if args.device == "auto" else args.device)
    except RuntimeError:
        raise ValueError(f"--device takes auto, cpu or cuda[:N], got {args.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available")
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip()) if args.formats else all_formats()
    if not formats:
        raise ValueError("--formats names no format")
    for flag, v in (("--hidden", args.hidden), ("--inter", args.inter), ("--experts-per-job", args.experts_per_job),
                    ("--jobs", args.jobs), ("--reps", args.reps), ("--bank-mib", args.bank_mib),
                    ("--copy-mib", args.copy_mib), ("--host-mib", args.host_mib)):
        if v <= 0:
            raise ValueError(f"{flag} must be > 0, got {v}")
    cfg = BwConfig(device=device, formats=formats,
                   threads=_int_list("--threads", args.threads) if args.threads else default_threads(physical_cores()),
                   hidden=args.hidden, inter=args.inter, experts_per_job=args.experts_per_job,
                   bank_bytes=int(args.bank_mib * 2**20), copy_bytes=int(args.copy_mib * 2**20),
                   host_bytes=int(args.host_mib * 2**20), jobs=args.jobs, reps=args.reps, kernel=args.kernel)
    for name in formats:
        format_layout(name, cfg.hidden, cfg.inter)
    return cfg


def main(args) -> int:
    """``ferry bench bw``: 0 when measured (and saved unless ``--no-save``), 2 for a bad flag."""
    try:
        cfg = config_from_args(args)
        profile = run_bw(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, KernelBuildError) as e:
        print(f"ferry bench bw: {e}", file=sys.stderr)
        return 2
    print(format_table(profile, cfg))
    if args.output_json:
        write_json(args.output_json, profile.model_dump(mode="json"))
    if not args.no_save:
        print(f"profile saved: {save_profile(profile)} (`ferry serve` on this machine starts from it)")
    return 0
