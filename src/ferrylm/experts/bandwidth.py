"""Measure the rates the placement decisions and the roofline use (:class:`~ferrylm.experts.options.Bandwidths`).

Each probe is a best-of-N wall-clock timing (seconds via ``time.perf_counter`` around a device sync), after one
warm-up; sizes are large enough to reach steady state on the GPU machine (256 MiB copies, 64 experts), small on
``--device cpu`` (so CI stays fast).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ferrylm.experts.banks import ExpertLayout, register_host_memory
from ferrylm.experts.cpu_pool import CpuExpertPool, CpuJob
from ferrylm.experts.options import Bandwidths


def best_time(fn: Callable[[], None], sync: Callable[[], None], reps: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def measure_bandwidths(device: torch.device | str, layout: ExpertLayout, *, pinned: bool = True,
                       pool: CpuExpertPool | None = None, size_bytes: int | None = None,
                       num_experts: int | None = None, reps: int = 3) -> Bandwidths:
    """Measure ``pcie`` (host->device, from pinned memory when ``pinned``), ``host`` (read), ``hbm`` (device
    copy, read + write), ``cpu`` (the CPU expert kernel on one token over ``num_experts`` distinct experts) and
    ``cpu_latency`` (a one-expert job from device activations back to the device, minus its bytes at ``cpu``).

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
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    host = torch.empty(size // 2, dtype=torch.bfloat16).fill_(1.0)
    if cuda and pinned:
        register_host_memory(host)  # failure: a pageable probe, as the banks would be
    dev = torch.empty(size // 2, dtype=torch.bfloat16, device=device)
    t_pcie = best_time(lambda: dev.copy_(host, non_blocking=True), sync, reps)
    t_host = best_time(lambda: host.sum(), lambda: None, reps)
    dev2 = torch.empty_like(dev)
    t_hbm = best_time(lambda: dev2.copy_(dev), sync, reps)
    if cuda and pinned:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())

    n = num_experts or (max(2, (512 << 20) // layout.nbytes) if cuda else 4)
    rows = torch.empty(n, layout.numel, dtype=layout.row_dtype).fill_(1e-3 if layout.quant is None else 0)
    own = pool is None
    pool = pool or CpuExpertPool(layout)
    x = torch.full((n, layout.hidden), 1e-2, dtype=layout.dtype)
    job = CpuJob(x=x, weights=torch.ones(n), items=[(e, rows[e], e, 1) for e in range(n)], out_dtype=layout.dtype)
    t_cpu = best_time(lambda: pool.submit(job).result(), lambda: None, reps)
    cpu = n * layout.nbytes / t_cpu

    # one expert, one token, from device activations back to the device (what a layer's CPU share waits on)
    x_dev = x[:1].to(device)

    def round_trip() -> None:
        one = CpuJob(x=x_dev.to("cpu"), weights=torch.ones(1), items=[(0, rows[0], 0, 1)], out_dtype=layout.dtype)
        outs, _ = pool.submit(one).result()
        outs[0].to(device)

    t_one = best_time(round_trip, sync, max(reps, 5))
    if own:
        pool.close()
    return Bandwidths(pcie=size / t_pcie, host=size / t_host, cpu=cpu, hbm=2 * size / t_hbm,
                      cpu_latency=max(0.0, t_one - layout.nbytes / cpu))
