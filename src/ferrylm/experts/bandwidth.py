"""Measure the rates the placement decisions and the roofline use (:class:`~ferrylm.experts.options.Bandwidths`).

The probes, shared by the boot (:func:`measure_bandwidths`), ``ferry bench bw`` and the roofline
(``bench/roofline.py``): :func:`copy_rate` (any tensor copy: pinned host->device, device->host, device->device),
:func:`host_read_rate`, :func:`cpu_expert_rate` (the CPU expert kernel, one token per expert),
:func:`cpu_job_latency`, and :class:`BackgroundCopies` (host->device copies streaming on a thread while another
probe runs). Copies are best-of-N wall-clock timings (``time.perf_counter`` around a device sync) after one
warm-up; the CPU kernel is the median of its jobs.

:func:`machine_bandwidths` is what the boot asks: the machine profile written by ``ferry bench bw``
(:mod:`ferrylm.experts.machine_profile`) when it covers this machine and expert format, else a measurement now.
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import threading
import time
from collections.abc import Callable

import torch

from ferrylm.experts.banks import register_host_memory
from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.cpu_pool import CpuExpertPool, CpuJob
from ferrylm.experts.options import Bandwidths

log = logging.getLogger("ferrylm.experts")


def best_time(fn: Callable[[], None], sync: Callable[[], None], reps: int) -> float:
    """Seconds of the fastest of ``reps`` calls of ``fn`` (each followed by ``sync``), after one warm-up call."""
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def device_sync(device: torch.device) -> Callable[[], None]:
    """A zero-argument sync for ``device`` (a no-op on the CPU)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def copy_rate(dst: torch.Tensor, src: torch.Tensor, sync: Callable[[], None], reps: int) -> float:
    """Bytes per second of ``dst.copy_(src, non_blocking=True)`` (``src``'s bytes once; best of ``reps``)."""
    return src.numel() * src.element_size() / best_time(lambda: dst.copy_(src, non_blocking=True), sync, reps)


def host_read_rate(t: torch.Tensor, reps: int) -> float:
    """Bytes per second of a reduction over the CPU tensor ``t`` (every torch thread reads)."""
    return t.numel() * t.element_size() / best_time(lambda: t.sum(), lambda: None, reps)


def probe_rows(layout: ExpertLayout, n: int) -> torch.Tensor:
    """``[n, S]`` host expert rows for the CPU probes: plain weights 1e-3, quantized bytes zero (the kernels' speed
    does not depend on the values)."""
    return torch.empty(n, layout.numel, dtype=layout.row_dtype).fill_(1e-3 if layout.quant is None else 0)


def cpu_expert_rate(pool: CpuExpertPool, bank: torch.Tensor, layout: ExpertLayout, per_job: int, jobs: int) -> float:
    """Expert weight bytes per second of the CPU pool's kernel: the median of ``jobs`` jobs (after one warm-up) of
    ``per_job`` distinct experts, one token each, walking the rows of ``bank [E, S]`` (a bank larger than the CPU
    caches makes every job read DRAM)."""
    e = bank.shape[0]
    x = torch.full((per_job, layout.hidden), 1e-2, dtype=layout.dtype)
    w = torch.ones(per_job)

    def job(j: int) -> CpuJob:
        ids = [(j * per_job + i) % e for i in range(per_job)]
        return CpuJob(x=x, weights=w, items=[(d, bank[d], i, 1) for i, d in enumerate(ids)], out_dtype=layout.dtype)

    pool.submit(job(0)).result()
    times = []
    for j in range(1, jobs + 1):
        t0 = time.perf_counter()
        pool.submit(job(j)).result()
        times.append(time.perf_counter() - t0)
    return per_job * layout.nbytes / max(statistics.median(times), 1e-9)


def cpu_job_latency(pool: CpuExpertPool, row: torch.Tensor, layout: ExpertLayout, device: torch.device,
                    rate: float, reps: int) -> float:
    """Seconds a one-expert, one-token job costs beyond its bytes at ``rate``: activations from ``device`` to the
    host, the pool's wake-up, the output back (what a layer's CPU share waits on)."""
    x_dev = torch.full((1, layout.hidden), 1e-2, dtype=layout.dtype, device=device)

    def round_trip() -> None:
        one = CpuJob(x=x_dev.to("cpu"), weights=torch.ones(1), items=[(0, row, 0, 1)], out_dtype=layout.dtype)
        outs, _ = pool.submit(one).result()
        outs[0].to(device)

    return max(0.0, best_time(round_trip, device_sync(device), max(reps, 5)) - layout.nbytes / rate)


class BackgroundCopies:
    """Host->device copies of ``nbytes`` repeated on a thread between ``__enter__`` and ``__exit__``: pinned host
    memory to ``device`` on a side CUDA stream, or on the CPU a host ``memcpy`` of one thread (there is no device);
    ``rate``: the bytes per second they achieved."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device, self.rate = device, 0.0
        self._src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self._dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ferrylm-bw-copies", daemon=True)
        self._copied = 0
        self._seconds = 0.0

    def _loop(self) -> None:
        n = self._src.numel()
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        t0 = time.perf_counter()
        while not self._stop.is_set():
            if side is None:   # ctypes releases the GIL for the call
                ctypes.memmove(self._dst.data_ptr(), self._src.data_ptr(), n)
            else:
                with torch.cuda.stream(side):
                    self._dst.copy_(self._src, non_blocking=True)
                side.synchronize()
            self._copied += n
        self._seconds = time.perf_counter() - t0

    def __enter__(self) -> "BackgroundCopies":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.rate = self._copied / max(self._seconds, 1e-9)


def measure_bandwidths(device: torch.device | str, layout: ExpertLayout, *, pinned: bool = True,
                       pool: CpuExpertPool | None = None, size_bytes: int | None = None,
                       num_experts: int | None = None, reps: int = 3) -> Bandwidths:
    """Measure ``pcie`` (host->device, from pinned memory when ``pinned``), ``host`` (read), ``hbm`` (device
    copy, read + write), ``cpu`` (the CPU expert kernel on one token over ``num_experts`` distinct experts) and
    ``cpu_latency`` (:func:`cpu_job_latency`).

    Args:
        device: the compute device. layout: expert shape and dtype for the CPU probe.
        pinned: page-lock the probe's host buffer (match the banks).
        pool: the CPU expert pool to time (default: a temporary one with torch's threads).
        size_bytes: copy probe size (default 256 MiB on CUDA, 16 MiB on the CPU).
        num_experts: CPU probe experts (default: enough for 512 MiB on CUDA, 4 on the CPU).

    Returns:
        :class:`Bandwidths` in bytes per second.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    size = size_bytes or ((256 << 20) if cuda else (16 << 20))
    sync = device_sync(device)
    host = torch.empty(size // 2, dtype=torch.bfloat16).fill_(1.0)
    if cuda and pinned:
        register_host_memory(host)  # failure: a pageable probe, as the banks would be
    dev = torch.empty(size // 2, dtype=torch.bfloat16, device=device)
    pcie = copy_rate(dev, host, sync, reps)
    host_rate = host_read_rate(host, reps)
    hbm = 2 * copy_rate(torch.empty_like(dev), dev, sync, reps)
    if cuda and pinned:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())

    n = num_experts or (max(2, (512 << 20) // layout.nbytes) if cuda else 4)
    rows = probe_rows(layout, n)
    own = pool is None
    pool = pool or CpuExpertPool(layout)
    try:
        cpu = cpu_expert_rate(pool, rows, layout, per_job=n, jobs=reps)
        latency = cpu_job_latency(pool, rows[0], layout, device, cpu, reps)
    finally:
        if own:
            pool.close()
    return Bandwidths(pcie=pcie, host=host_rate, cpu=cpu, hbm=hbm, cpu_latency=latency)


def machine_bandwidths(device: torch.device | str, layout: ExpertLayout, *, pinned: bool,
                       pool: CpuExpertPool | None = None, threads: int | None = None) -> Bandwidths:
    """The rates the boot's decisions start from: the machine profile's (``ferry bench bw``) when one covers this
    machine, ``layout``'s format and the banks' pinning (logged with its date), else :func:`measure_bandwidths`
    now (logged with the reason). ``threads``: the CPU pool's (default: ``pool``'s, else torch's)."""
    # NOTE: imported here: the profile's pydantic schema costs ~0.15 s of every boot, and a CPU boot never reads it
    from ferrylm.experts import machine_profile

    device = torch.device(device)
    threads = pool.threads if pool is not None else (threads or torch.get_num_threads())
    found = machine_profile.profile_bandwidths(device, layout, threads=threads, pinned=pinned)
    if found is not None:
        return found
    bw = measure_bandwidths(device, layout, pinned=pinned, pool=pool)
    log.info("measured bandwidths (GB/s): %s; CPU job latency %.0f us",
             {k: round(v / 1e9, 1) for k, v in bw.as_dict().items()}, bw.cpu_latency * 1e6)
    return bw
