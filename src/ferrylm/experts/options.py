"""How the expert executor is shaped: backend name plus the knobs of the caching backends (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass

from ferrylm.backends import MOE_BACKENDS
from ferrylm.config import CACHE_POLICIES, CPU_KERNELS


@dataclass(frozen=True)
class Bandwidths:
    """Measured rates, bytes per second.

    Attributes:
        pcie: host->device copy of pinned (or, if the banks are pageable, pageable) memory; on ``--device cpu``
            a memcpy.
        host: host memory read (a large reduction over host memory).
        cpu: CPU expert rate: expert weight bytes processed per second by the CPU expert kernel for one token.
        hbm: device memory copy rate, read + write bytes per second (for the resident roofline).
        cpu_latency: seconds a CPU expert job costs besides its expert bytes (activations to the host, the pool's
            wake-up, the output back to the device); reported by ``ferry bench decode`` and the logs.
        cpu_with_copies: the CPU expert rate measured while host->device copies run (the machine profile of
            ``ferry bench bw``); None when not measured (the hybrid split then estimates it,
            :func:`~ferrylm.experts.hybrid.cpu_effective_rate`).
    """

    pcie: float
    host: float
    cpu: float
    hbm: float
    cpu_latency: float = 0.0
    cpu_with_copies: float | None = None

    def as_dict(self) -> dict:
        """The four rates (bytes per second)."""
        return {"pcie": self.pcie, "host": self.host, "cpu": self.cpu, "hbm": self.hbm}


@dataclass(frozen=True)
class ExpertOptions:
    """Knobs of the expert executor (``--moe-*`` flags).

    Attributes:
        backend: one of ``MOE_BACKENDS``.
        cache_size: device expert slots (``--moe-cache-size``); None = as many as the device budget allows
            (all experts when there is no budget, e.g. ``--device cpu``).
        cpu_threads: threads of the CPU expert pool (``--moe-cpu-threads``); None = physical cores.
        cpu_kernel: the CPU expert kernel (``--moe-cpu-kernel``, one of ``CPU_KERNELS``).
        cpu_share: hybrid: predicted misses per layer planned for the CPU (``--moe-cpu-share``); None = chosen by
            timing decode steps (:mod:`ferrylm.experts.share_tuner`).
        prefetch: steps planned on the host copy layer L+1's predicted experts while layer L runs (the device
            table's steps never do); None = backend default (on for ``offload`` and ``hybrid``, n/a for ``cpu``).
        stream_prefill: stream whole expert layers through a two-layer double buffer for large chunks.
        stream_min_tokens: stream when a step has at least this many tokens; None = when
            ``tokens * top_k >= num_experts`` (a chunk that is expected to touch most experts).
        prefetch_max_tokens: no prefetch for steps with more tokens than this (they need most experts anyway).
        bandwidths: measured rates for the hybrid split of steps without prefetch and for ``auto``; None =
            measured on first need.
        cache_policy: ``"layer-lru"`` (LRU within per-layer shares, default), ``"lru"`` (one LRU over all
            layers) or ``"layer-lrfu"`` (decaying use counts within the shares); see :mod:`ferrylm.experts.cache`
            (``--moe-cache-policy``).
        decode_table: offload: steps of up to 256 tokens run from the device expert table (one fused launch per
            layer, misses read over PCIe by the kernel, whole-step CUDA graphs: ``experts/slot_table.py``); False
            keeps the host-planned path (one device->host read per layer, DMA fetch + next-layer prefetch).
    """

    backend: str = "resident"
    cache_size: int | None = None
    cpu_threads: int | None = None
    cpu_kernel: str = "auto"
    cpu_share: int | None = None
    prefetch: bool | None = None
    stream_prefill: bool = True
    stream_min_tokens: int | None = None
    prefetch_max_tokens: int = 64
    bandwidths: Bandwidths | None = None
    cache_policy: str = "layer-lru"
    decode_table: bool = True

    def validate(self) -> "ExpertOptions":
        """Raise ValueError naming the flag when a value is out of range or the backend is unknown."""
        if self.backend not in MOE_BACKENDS:
            raise ValueError(f"unknown MoE backend {self.backend!r}; valid: {', '.join(MOE_BACKENDS)}")
        if self.cache_size is not None and self.cache_size < 0:
            raise ValueError(f"--moe-cache-size must be >= 0, got {self.cache_size}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--moe-cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.cpu_share is not None and self.cpu_share < 0:
            raise ValueError(f"--moe-cpu-share must be >= 0, got {self.cpu_share}")
        if self.cpu_share is not None and self.backend not in ("hybrid", "auto"):
            raise ValueError(f"--moe-cpu-share applies to --moe-backend hybrid, not {self.backend}")
        if self.cpu_kernel not in CPU_KERNELS:
            raise ValueError(f"--moe-cpu-kernel must be one of {', '.join(CPU_KERNELS)}, got {self.cpu_kernel!r}")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"--moe-cache-policy must be one of {', '.join(CACHE_POLICIES)}, "
                             f"got {self.cache_policy!r}")
        if self.stream_min_tokens is not None and self.stream_min_tokens < 1:
            raise ValueError(f"stream_min_tokens must be >= 1, got {self.stream_min_tokens}")
        return self
