"""Where routed experts live and run. ``build_executor`` picks a backend by its ``--moe-backend`` name.

Rooms: ``executor.py`` (the interface), ``quantized.py`` (quantized expert representations), ``resident.py`` (all
experts on the device), ``banks.py`` (host expert rows, pinned), ``cache.py`` (slot cache bookkeeping, LRU), ``transfer.py`` (copy stream / copy thread),
``stream.py`` (prefill double buffer, streamed layer), ``slots.py`` (slot rows in blocks, elastic shrink / grow),
``table_decode.py`` (offload's device-table decode), ``cached.py`` (the base of the offloading backends), ``offload.py``,
``cpu.py`` + ``cpu_pool.py``, ``hybrid.py``, ``auto.py`` (the choice), ``bandwidth.py`` (measured rates),
``stats.py`` (counters), ``options.py`` (knobs).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ferrylm.backends import CACHED_BACKENDS, MOE_BACKENDS
from ferrylm.experts.options import Bandwidths, ExpertOptions

if TYPE_CHECKING:
    import torch

    from ferrylm.experts.executor import ExpertExecutor, LayerExperts

# NOTE: no torch at import: the CLI's parser reads MOE_BACKENDS through this package (flag choices)

log = logging.getLogger("ferrylm.experts")


def backend_name(backend: str | ExpertOptions) -> str:
    """The backend name of a ``--moe-backend`` value or :class:`ExpertOptions` (``fused`` -> ``resident``)."""
    name = backend.backend if isinstance(backend, ExpertOptions) else backend
    return "resident" if name == "fused" else name


def check_backend(backend: str | ExpertOptions) -> str:
    """Return ``backend`` if it names a known MoE backend (or is valid :class:`ExpertOptions`), else raise
    ValueError listing the valid names."""
    if isinstance(backend, ExpertOptions):
        backend.validate()
        return backend.backend
    if backend not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; valid: {', '.join(MOE_BACKENDS)}")
    return backend


def expert_home(backend: str | ExpertOptions, device: torch.device | str) -> torch.device:
    """Where a loader should assemble the routed experts: on ``device`` for the resident backend, in host memory
    for every other (the offloading backends bank them there; ``auto`` moves them if it picks resident)."""
    import torch

    return torch.device(device) if backend_name(backend) == "resident" else torch.device("cpu")


def build_executor(backend: str | ExpertOptions, layers: dict[int, LayerExperts],
                   device: torch.device | str) -> ExpertExecutor:
    """Build the executor for ``--moe-backend backend``.

    Args:
        backend: one of ``MOE_BACKENDS``, or :class:`ExpertOptions` carrying the name and the cache knobs.
        layers: decoder layer index -> stacked expert weights. The resident backend moves them to ``device``;
            the others pack them into host banks (the given objects are rewritten to views of the banks).
        device: the compute device.

    Raises:
        ValueError: unknown backend name (the message lists the valid ones), ``auto`` (the boot resolves it before
            loading: ``engine/expert_choice.resolve_expert_backend``) or an out-of-range option.
    """
    import torch

    options = backend if isinstance(backend, ExpertOptions) else ExpertOptions(backend=check_backend(backend))
    options.validate()
    dev = torch.device(device)
    name = backend_name(options)
    if name == "auto":
        raise ValueError("--moe-backend auto is resolved before loading (engine/expert_choice.py); pass a backend")
    if name == "resident":
        from ferrylm.experts.resident import ResidentExecutor

        placed = {i: le.to(dev) for i, le in layers.items()}
        return _resident(placed, dev, options)
    from ferrylm.experts.banks import HostBanks

    return build_from_banks(name, HostBanks.from_layers(layers), dev, options)


def _resident(placed: dict[int, LayerExperts], device: torch.device, options: ExpertOptions) -> ExpertExecutor:
    """The resident executor; on the CPU with the native kernel of ``--moe-cpu-kernel`` (None for ``torch``, or
    when ``auto`` cannot build it) and ``--moe-cpu-threads``."""
    from ferrylm.experts.resident import ResidentExecutor

    if device.type != "cpu":
        return ResidentExecutor(placed)
    from ferrylm.experts.cpu_kernel import load_kernel

    native = load_kernel(options.cpu_kernel)
    log.info("resident experts on the CPU: %s kernel", f"native-{native.isa}" if native else "torch")
    return ResidentExecutor(placed, native=native, threads=options.cpu_threads)


def build_from_banks(name: str, banks, device: torch.device | str, options: ExpertOptions | None = None
                     ) -> ExpertExecutor:
    """An executor of backend ``name`` over existing :class:`~ferrylm.experts.banks.HostBanks` (several
    executors may share one bank, e.g. ``ferry bench decode --moe-backend all``). ``resident`` copies every
    expert to ``device``.

    Raises:
        ValueError: ``name`` is not a concrete backend (``auto`` is resolved by the caller).
    """
    import torch

    dev = torch.device(device)
    options = options or ExpertOptions(backend=name)
    name = backend_name(name)
    if name == "resident":
        from ferrylm.experts.resident import ResidentExecutor

        placed = {}
        for i in banks.layers:
            placed[i] = banks.layer_experts(i).to(dev)
        return _resident(placed, dev, options)
    if name not in CACHED_BACKENDS:
        raise ValueError(f"cannot build backend {name!r} from banks; valid: resident, "
                         f"{', '.join(CACHED_BACKENDS.names)}")
    cls = CACHED_BACKENDS.get(name)
    return cls(banks, dev, options)


__all__ = ["MOE_BACKENDS", "Bandwidths", "ExpertOptions", "backend_name",
           "build_executor", "build_from_banks", "check_backend", "expert_home"]
