"""The ``hybrid`` backend: a layer's expert misses are split between copies to the device and computation on the
CPU, running at the same time.

Decode (prefetch on, the default): the next layer's predicted misses (its router applied to this layer's hidden
state; Eliseev & Mazur 2023) are split when they are predicted. The *share* of them predicted for the fewest
tokens is *planned* for the CPU; the others are copied ahead on the copy stream, as ``offload`` does. When the
next layer runs, its misses among the planned ones go to the CPU pool instead of the PCIe link. A wrong guess costs
nothing on the CPU side (an expert planned but not routed is simply not computed), unlike a wasted copy. Misses
nobody predicted, and predicted ones beyond the free slots, are fetched when the layer needs them, whatever the
share, so that the tuner compares shares and nothing else.

The share (experts per layer) is measured, not modelled: a CPU expert sits on its layer's critical path while a
prefetched copy overlaps the layers before, so the answer depends on the layer's GPU time and on how much host
memory bandwidth the CPU keeps while the DMA reads the same DRAM. :class:`~ferrylm.experts.share_tuner.ShareTuner`
times the decode steps at share 0 (``offload``'s policy), 1, 2, ... and keeps the fastest, per step size
(``--moe-cpu-share N`` fixes it instead). A host with more memory bandwidth per PCIe byte is where a share pays;
the native kernel (:mod:`ferrylm.experts.cpu_kernel`) is what gives the CPU a chance at all (figures:
docs/BENCHMARKS.md, "The figures behind choices in the code").

Steps without prefetch (large steps, ``prefetch`` off) split their misses at the layer by the measured rates
(:func:`split_misses`): fetch ``n`` of the ``m``, minimising ``max(n * S / B_pcie, (m - n) * S / B_cpu_eff)`` with
``B_cpu_eff`` the CPU's rate while the copies run (the DMA reads the same host memory as the CPU): measured by
``ferry bench bw`` into the machine profile, else estimated as ``min(B_cpu, B_host - B_pcie)``; both sides finishing
together. When the CPU is host-bandwidth bound the continuous optimum is ``n* = m * B_pcie / B_host``, FreeToken's
q* policy. The misses with the most tokens are the ones fetched (the device is far faster at multi-token GEMMs),
and fetches never exceed the unpinned slots (the overflow goes to the CPU).
"""

from __future__ import annotations

import time

from ferrylm.experts.cached import CachedExecutor
from ferrylm.experts.options import Bandwidths
from ferrylm.experts.share_tuner import FixedShare, ShareTuner
from ferrylm.experts.stats import ExpertReport
from ferrylm.experts.work import LayerWork


def cpu_effective_rate(bw: Bandwidths) -> float:
    """The CPU expert rate beside the copies, bytes/s: measured (``bw.cpu_with_copies``, the machine profile) or
    estimated as ``min(B_cpu, B_host - B_pcie)``; floored at 5 % of ``B_cpu`` (a host rate measured below the PCIe
    rate would otherwise make the estimate zero or negative)."""
    rate = bw.cpu_with_copies if bw.cpu_with_copies is not None else min(bw.cpu, bw.host - bw.pcie)
    return max(rate, 0.05 * bw.cpu)


def split_misses(m: int, bw: Bandwidths) -> int:
    """How many of ``m`` misses to fetch (the rest go to the CPU): the ``n`` in ``[0, m]`` minimising
    ``max(n / B_pcie, (m - n) / B_cpu_eff)`` (both sides finish together), ties to the larger ``n`` (fetched
    experts stay cached)."""
    if m <= 0:
        return 0
    cpu = cpu_effective_rate(bw)
    return min(range(m + 1), key=lambda n: (max(n / bw.pcie, (m - n) / cpu), -n))


class HybridExecutor(CachedExecutor):
    """See the module docstring and :class:`~ferrylm.experts.cached.CachedExecutor` (arguments)."""

    name = "hybrid"
    uses_cpu = True
    min_slots = 0
    default_prefetch = True
    stages = True  # a layer without CPU work goes to the decode graph

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._planned: dict[int, set[int]] = {}  # layer -> predicted misses planned for the CPU
        self._tuners: dict[int, ShareTuner | FixedShare] = {}  # step tokens -> its CPU share chooser
        self._step_start: float | None = None
        self._first, self._last = self.banks.layers[0], self.banks.layers[-1]

    def _dispatch(self, work: LayerWork, hits: list[tuple[int, int]], misses: list[int]) -> None:
        if work.layer == self._first:
            self._step_start = time.perf_counter()
        self._dispatch_layer(work, hits, misses)
        if work.layer == self._last and self._step_start is not None:
            tuner = self._tuners.get(work.hidden.shape[0])
            if tuner is not None:  # a step that planned CPU shares: time it
                tuner.step_done(time.perf_counter() - self._step_start)
            self._step_start = None

    def _dispatch_layer(self, work: LayerWork, hits: list[tuple[int, int]], misses: list[int]) -> None:
        planned = self._planned.pop(work.layer, set())
        to_cpu = [e for e in misses if e in planned]
        rest = [e for e in misses if e not in planned]
        if not rest:
            n = 0
        elif self.prefetches(work.hidden.shape[0]):  # the planned share is the CPU's part
            n = min(len(rest), self.cache.evictable())
        else:
            n = min(split_misses(len(rest), self.bandwidths()), self.cache.evictable())
        by_load = sorted(rest, key=lambda e: -work.spans[e][1])
        fetched = self._fetch(work.layer, by_load[:n])
        handle = self._submit_cpu(work, sorted(to_cpu + by_load[n:]))
        self._maybe_prefetch(work)
        self._compute_slots(work, hits + fetched)
        self._collect_cpu(work, handle)

    def _maybe_prefetch(self, work: LayerWork) -> None:
        """Plan the tuner's share of the next layer's predicted misses for the CPU and copy the others."""
        plan = self._prefetch_plan(work)
        if plan is None:
            self._planned.pop(self._next.get(work.layer), None)
            return
        nxt, todo, room = plan
        tokens = work.hidden.shape[0]
        tuner = self._tuners.get(tokens)
        if tuner is None:
            fixed = self.options.cpu_share
            tuner = self._tuners[tokens] = ShareTuner() if fixed is None else FixedShare(fixed)
        load = work.predicted or {}
        by_load = sorted(todo, key=lambda e: -load.get(e, 0))  # stable: ascending id among equal loads
        keep = len(by_load) - min(tuner.share, len(by_load))
        self._planned[nxt] = set(by_load[keep:])  # the least loaded go to the CPU
        fetch = by_load[:keep][:room]  # predicted misses beyond the free slots are fetched when needed
        if fetch:
            self._fetch(nxt, fetch, prefetch=True)

    def stats(self) -> ExpertReport:
        """:meth:`CachedExecutor.stats` plus ``cpu_share``: per step size (tokens), the CPU share in use and the
        one the last climb settled on (None while the first climb runs)."""
        report = super().stats()
        report.cpu_share = {t: {"share": tu.share, "settled": tu.settled} for t, tu in list(self._tuners.items())}
        return report
