"""The ``cpu`` backend: cache hits are computed on the device, misses on the CPU straight from the host banks.

Only activations cross PCIe (the missed experts' token rows down, their weighted outputs back). The CPU job
starts first and runs on the CPU expert pool (:mod:`ferrylm.experts.cpu_pool`) while the device computes the
hits. The slot cache is filled once (layer-round-robin, see ``CachedExecutor._warm_fill``) and never changes:
this backend never copies an expert (prefill chunks excepted, which stream through the layer double buffer when
``stream_prefill`` is on, because a CPU is far slower than the device at many-token GEMMs).
"""

from __future__ import annotations

from ferrylm.experts.cached import CachedExecutor
from ferrylm.experts.work import LayerWork


class CpuExecutor(CachedExecutor):
    """See the module docstring and :class:`~ferrylm.experts.cached.CachedExecutor` (arguments)."""

    name = "cpu"
    uses_cpu = True
    min_slots = 0

    def _dispatch(self, work: LayerWork, hits: list[tuple[int, int]], misses: list[int]) -> None:
        handle = self._submit_cpu(work, misses)
        self._compute_slots(work, hits)
        self._collect_cpu(work, handle)
