"""The machine's bandwidths, read by probes that do not use our kernels, and the roofline of a served run.

Probes (best of ``reps`` timings after a warm-up): ``pcie`` a pinned host->device copy, ``hbm`` a device->device
copy counted as bytes read + written, ``dram`` a host read (``torch.sum`` of a float32 tensor on every torch
thread). All in bytes per second; ``pcie`` and ``hbm`` are None without CUDA.

Roofline of a run (per output token; ``W`` the non-expert bytes a step reads, ``S`` one expert's bytes, counters
summed over the run, ``T`` the output tokens):
  * HBM:  ``(W * steps + hits * S) / T`` bytes, at ``hbm``
  * PCIe: ``(bytes_copied + bytes_mapped) / T`` bytes (what crossed: copies and mapped reads), at ``pcie``
  * DRAM: ``cpu_experts * S / T`` bytes, at ``dram``
and the floor is the slowest of the three (they can overlap). On a CPU server every weight read is a DRAM read. A prefill run's floor is one pass over the experts
that are not on the device: ``(experts - slots) * S / pcie``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ferrylm.experts.bandwidth import copy_rate, device_sync, host_read_rate


@dataclass(frozen=True)
class Bandwidths:
    """Measured rates in bytes per second (None where the probe cannot run)."""

    dram: float
    pcie: float | None = None
    hbm: float | None = None
    device: str = "cpu"

    def to_dict(self) -> dict:
        return asdict(self)


def probe_bandwidths(*, host_bytes: int = 1 << 30, copy_bytes: int = 256 << 20, reps: int = 5) -> Bandwidths:
    """Measure the host read rate and, with CUDA, the pinned PCIe and HBM copy rates (module docstring)."""
    import torch

    host = torch.ones(host_bytes // 4, dtype=torch.float32)
    dram = host_read_rate(host, reps)
    del host
    if not torch.cuda.is_available():
        return Bandwidths(dram=dram)
    dev = torch.device("cuda")
    sync = device_sync(dev)
    src = torch.ones(copy_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    pcie = copy_rate(dst, src, sync, reps)
    hbm = 2 * copy_rate(torch.empty_like(dst), dst, sync, reps)
    return Bandwidths(dram=dram, pcie=pcie, hbm=hbm, device=torch.cuda.get_device_name(dev))


def _seconds(nbytes: float, rate: float | None) -> float | None:
    return nbytes / rate if rate else None


def decode_roofline(experts: dict, model_bytes: dict, output_tokens: int, bw: Bandwidths) -> dict:
    """Bytes per output token over HBM, PCIe and host DRAM for the counters ``experts`` (the run's delta, as
    ``bench/serve.py`` records it), their seconds at ``bw``, and the floor (the slowest). Empty without tokens or
    model sizes."""
    w, s = model_bytes.get("dense_step_bytes"), model_bytes.get("expert_bytes")
    if not output_tokens or w is None or s is None:
        return {}
    steps = experts.get("steps", 0)
    per = {"hbm": (w * steps + experts.get("hits", 0) * s) / output_tokens,
           "pcie": (experts.get("bytes_copied", 0) + experts.get("bytes_mapped", 0)) / output_tokens,
           "dram": experts.get("cpu_experts", 0) * s / output_tokens}
    if bw.hbm is None:   # a CPU server: its "device" memory is host DRAM
        per = {"hbm": 0.0, "pcie": 0.0, "dram": per["dram"] + per["hbm"]}
    rates = {"hbm": bw.hbm, "pcie": bw.pcie, "dram": bw.dram}
    secs = {k: _seconds(v, rates[k]) for k, v in per.items()}
    known = [v for v in secs.values() if v is not None]
    floor = max(known) if known else None
    return {"bytes_per_token": per, "seconds_per_token": secs,
            "bound": max((k for k in secs if secs[k] is not None), key=lambda k: secs[k]) if known else None,
            "floor_s": floor, "floor_tok_s": 1 / floor if floor else None}


def prefill_floor(plan: dict, model_bytes: dict, bw: Bandwidths) -> float | None:
    """Seconds to move every expert that is not on the device once over PCIe (None when all are resident or the
    rates are unknown)."""
    s, total = model_bytes.get("expert_bytes"), plan.get("expert_total") or 0
    if not s or not total or not bw.pcie:
        return None
    return max(0, total - (plan.get("expert_slots") or 0)) * s / bw.pcie
