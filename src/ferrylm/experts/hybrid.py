"""The ``hybrid`` backend: per layer, part of the misses is fetched to the device and the rest is computed on the
CPU at the same time, split so that both sides finish together.

Split (bytes model, per layer and step; ``m`` misses of ``S`` bytes each): fetching ``n`` takes
``n * S / B_pcie``; computing the other ``m - n`` on the CPU takes ``(m - n) * S / B_cpu_eff``, where the CPU's
effective rate ``B_cpu_eff = min(B_cpu, B_host - B_pcie)`` accounts for the DMA reading the same host memory as the
CPU. ``n`` is the integer in ``[0, m]`` minimising the larger of the two (ties: fetch more, since fetched experts
stay cached). With a CPU that is host-bandwidth bound (``B_cpu >= B_host - B_pcie``) the continuous optimum is
``n* = m * B_pcie / B_host``, FreeToken's q* policy. The misses with the most tokens are the ones fetched (the
device is far faster at multi-token GEMMs); fetches never exceed the unpinned slots, the overflow goes to the CPU.

Prefetch (on by default, as for ``offload``): every predicted miss of the next layer is copied ahead (Eliseev &
Mazur 2023), so the split above applies to the misses the prediction got wrong. NOTE: splitting the predicted
misses too (measured on the H200, 2026-11-30) turned ~65 of them per step into demand misses, on the critical path
of their layer, because the per-layer split of one or two misses picks the copy: the prefetch is off the critical
path while the copy stream has slack (it was busy 62 % of the time), so it should take all the predicted work.
Measured again with decode CUDA graphs (H200, 2026-11-30, docs/BENCHMARKS.md): planning the split-off predicted
misses for the CPU at the next layer (none fetched on demand) ran at 9.0 tok/s against 19.0 for prefetching them
all: a CPU expert costs ~1 ms of the layer's critical path at batch 1 (the CPU can only start once the layer's
router has run, and the next layer waits for it), a prefetched one ~0.17 ms of copy time off it.
"""

from __future__ import annotations

from ferrylm.experts.cached import CachedExecutor
from ferrylm.experts.work import LayerWork
from ferrylm.experts.options import Bandwidths


def cpu_effective_rate(bw: Bandwidths) -> float:
    """``min(B_cpu, B_host - B_pcie)`` bytes/s, floored at 5 % of ``B_cpu`` (a host rate measured below the
    PCIe rate would otherwise make it zero or negative)."""
    return max(min(bw.cpu, bw.host - bw.pcie), 0.05 * bw.cpu)


def split_misses(m: int, bw: Bandwidths) -> int:
    """How many of ``m`` misses to fetch (the rest go to the CPU); see the module docstring."""
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
    stages = True  # a layer without CPU work (every miss predicted and prefetched) goes to the decode graph

    def _dispatch(self, work: LayerWork, hits: list[tuple[int, int]], misses: list[int]) -> None:
        n = min(split_misses(len(misses), self.bandwidths()), self.cache.evictable()) if misses else 0
        by_load = sorted(misses, key=lambda e: -work.spans[e][1])
        fetched = self._fetch(work.layer, by_load[:n])
        handle = self._submit_cpu(work, sorted(by_load[n:]))
        self._maybe_prefetch(work)
        self._compute_slots(work, hits + fetched)
        self._collect_cpu(work, handle)
