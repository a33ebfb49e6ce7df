"""Per-step and cumulative expert counters (what the engine's ``stats()`` and later ``/metrics`` show).

A *step* is one forward pass of the model: the executor sees it as a run of MoE layers in ascending order, and a
layer index that does not increase starts the next step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class Counters:
    """Additive counters.

    Attributes:
        steps: forward passes; tokens: tokens through the MoE layers (counted once per step).
        needed: (layer, expert) pairs a step needed; hits: of those, already in the device cache (prefetched ones
            included); misses: not cached (fetched, streamed or computed on the CPU).
        prefetched: experts copied ahead of need by prefetch; prefetch_hits: needed ones found there;
            prefetch_wasted: prefetched ones evicted before any use.
        fetched: experts copied host->device on demand; streamed: experts copied by prefill layer streaming.
        bytes_copied: expert bytes host->device (demand + prefetch + streaming).
        bytes_activations: activation bytes moved for CPU experts (both directions).
        mapped: experts the fused kernel read from host memory over PCIe itself (table steps' misses);
            bytes_mapped: their bytes.
        cpu_experts: expert computations done on the CPU; cpu_expert_time_s: wall seconds of those jobs.
        copy_time_s: seconds the copy engine spent copying; copy_exposed_s: seconds compute waited for copies.
    """

    steps: int = 0
    tokens: int = 0
    needed: int = 0
    hits: int = 0
    misses: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0
    fetched: int = 0
    streamed: int = 0
    bytes_copied: int = 0
    bytes_activations: int = 0
    mapped: int = 0
    bytes_mapped: int = 0
    cpu_experts: int = 0
    cpu_expert_time_s: float = 0.0
    copy_time_s: float = 0.0
    copy_exposed_s: float = 0.0

    def add(self, other: "Counters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        """Fields plus ``hit_rate`` (hits / needed, 1.0 when nothing was needed) and ``copy_hidden_s``
        (copy time not exposed, >= 0)."""
        d = asdict(self)
        d["hit_rate"] = self.hits / self.needed if self.needed else 1.0
        d["copy_hidden_s"] = max(0.0, self.copy_time_s - self.copy_exposed_s)
        return d


class ExpertStats:
    """Cumulative counters, the current step's, and the last finished step's; per-layer hits and misses.

    Args:
        layers: MoE layer indices (for the per-layer lists, in this order).
    """

    def __init__(self, layers: tuple[int, ...]):
        self.layers = tuple(layers)
        self.total = Counters()
        self.step = Counters()
        self.last = Counters()
        self._last_layer: int | None = None

    def starts_step(self, layer: int) -> bool:
        """Note that ``layer`` runs now; True when this begins a new step (the first MoE layer of a forward)."""
        new = self._last_layer is None or layer <= self._last_layer
        self._last_layer = layer
        return new

    def open_step(self, num_tokens: int) -> None:
        """Close the current step (if any) and open a new one of ``num_tokens`` tokens."""
        self.close_step()
        self.step.steps = 1
        self.step.tokens = num_tokens

    def close_step(self) -> None:
        """Fold the current step into the totals and keep it as the last step."""
        if self.step.steps:
            self.total.add(self.step)
            self.last = self.step
        self.step = Counters()

    def snapshot(self, backend: str, layer_hits: dict[int, int], layer_misses: dict[int, int], *,
                 num_slots: int = 0) -> "ExpertReport":
        """Totals (including the open step), the last step, and per-layer hits and misses aligned with ``layers``."""
        cur = Counters()
        cur.add(self.total)
        cur.add(self.step)
        last = Counters()
        last.add(self.step if self.step.steps and not self.last.steps else self.last)
        return ExpertReport(backend=backend, totals=cur, last_step=last, layers=list(self.layers),
                            layer_hits=[layer_hits.get(i, 0) for i in self.layers],
                            layer_misses=[layer_misses.get(i, 0) for i in self.layers], num_slots=num_slots)


@dataclass
class SlotCacheReport:
    """The shape of an offloading backend's cache: ``expert_bytes`` per slot row (bytes), ``slot_blocks`` and
    ``slot_bytes`` (device bytes the blocks hold now), ``pinned`` (page-locked host banks), ``prefetch`` (on),
    ``cpu_threads`` / ``cpu_kernel`` of its CPU expert pool (0 / None: none)."""

    expert_bytes: int
    slot_blocks: int
    slot_bytes: int
    pinned: bool
    prefetch: bool
    cpu_threads: int = 0
    cpu_kernel: str | None = None


@dataclass
class ExpertReport:
    """What an executor reports (``ExpertExecutor.stats``).

    Attributes:
        backend: its name. totals: cumulative counters, the open step included. last_step: the last finished step's
            (the open one before any finished). layers: MoE layer indices; layer_hits / layer_misses: aligned with
            them. num_slots: device slots (0: resident). cache: the slot cache's shape (offloading backends).
        cpu_share: hybrid: per step size (tokens), ``{"share", "settled"}`` of its CPU share chooser.
    """

    backend: str
    totals: Counters
    last_step: Counters
    layers: list[int]
    layer_hits: list[int]
    layer_misses: list[int]
    num_slots: int = 0
    cache: SlotCacheReport | None = None
    cpu_share: dict[int, dict] | None = field(default=None)

    def as_dict(self) -> dict:
        """The engine's ``stats()["experts"]``: the totals' fields (:meth:`Counters.as_dict`) at the top level,
        ``last_step``, the per-layer lists (lists, not int-keyed maps, so msgpack round-trips them), ``backend``,
        ``num_slots``, the cache's fields and ``cpu_share`` when present."""
        d = self.totals.as_dict()
        d.update(last_step=self.last_step.as_dict(), layers=list(self.layers), layer_hits=list(self.layer_hits),
                 layer_misses=list(self.layer_misses), backend=self.backend, num_slots=self.num_slots)
        if self.cache is not None:
            d.update(asdict(self.cache))
        if self.cpu_share is not None:
            d["cpu_share"] = self.cpu_share
        return d
