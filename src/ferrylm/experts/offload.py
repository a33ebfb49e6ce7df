"""The ``offload`` backend: every expert a step needs is made resident in the slot cache, then computed on the device.

Misses are copied host->device on the dedicated copy stream, then the layer's experts compute in one batch (so the
result equals the resident backend's bit for bit; under decode CUDA graphs the batch is staged into the next graph,
whose GEMM shapes are padded to ``min(B * k, E)`` experts and ``B`` tokens: equal to rounding). When one layer
needs more experts than there are unpinned slots, the layer runs in waves (fetch what fits, compute, unpin,
repeat), so any cache of at least one slot is correct.
Decode steps run from the device expert table where it can run (:mod:`ferrylm.experts.table_decode`: misses
installed on demand, no prefetch). Steps planned on the host prefetch when it is on (the default): layer L+1's likely
experts start copying while layer L computes, layer L+1's router applied to layer L's hidden state (Eliseev & Mazur
2023, "Fast Inference of Mixture-of-Experts Language Models with Offloading", §3.2). A wrong guess costs copy
bandwidth and a slot, never correctness.
"""

from __future__ import annotations

from ferrylm.experts.cached import CachedExecutor
from ferrylm.experts.table_decode import TableDecode
from ferrylm.experts.work import LayerWork


class OffloadExecutor(TableDecode, CachedExecutor):
    """See the module docstring and :class:`~ferrylm.experts.cached.CachedExecutor` (arguments)."""

    name = "offload"
    default_prefetch = True
    min_slots = 1
    stages = True  # a layer computed in one batch (no waves) can be handed to the decode graph

    def _dispatch(self, work: LayerWork, hits: list[tuple[int, int]], misses: list[int]) -> None:
        pending = list(misses)
        prefetched = False
        while True:
            room = self.cache.evictable()
            batch, pending = pending[:room], pending[room:]
            fetched = self._fetch(work.layer, batch)
            if not pending and not prefetched:
                self._maybe_prefetch(work)
                prefetched = True
            if pending:  # a wave: the hits compute while the copies land, then make room
                self._compute_slots(work, hits)
                self._compute_slots(work, fetched)
                hits = []
                continue
            self._compute_slots(work, hits + fetched)  # one batch, as the resident backend computes the layer
            return
