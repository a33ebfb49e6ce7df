"""Prefill layer streaming: two layer-sized device buffers, layer L+1 copying while layer L computes.

A prefill chunk of many tokens touches nearly every expert of every layer, so per-expert cache decisions buy
nothing: the whole layer has to cross PCIe anyway. Each buffer is ``[E, S]`` (one layer's expert rows) and
remembers which layer and which experts it holds. While layer L computes from one buffer, the other receives layer
L+1's experts, except those already in the slot cache (cache hits are not re-copied). A buffer is only
overwritten after the compute that read it (a compute fence), and is only read after its copies landed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ferrylm.experts.banks import HostBanks
from ferrylm.experts.transfer import CopyEngine


class LayerStreamer:
    """Two-layer double buffer on ``device``.

    Args:
        banks: host expert rows. device: where the buffers live. copier: the executor's copy engine.

    Memory: ``2 * E * S`` elements (:attr:`nbytes` bytes), allocated at construction.
    """

    def __init__(self, banks: HostBanks, device: torch.device, copier: CopyEngine):
        self.banks = banks
        self.copier = copier
        e, s = banks.num_experts, banks.layout.numel
        self.buffers = [torch.empty(e, s, dtype=banks.layout.row_dtype, device=device) for _ in range(2)]
        self.layer: list[int | None] = [None, None]
        self.have: list[set[int]] = [set(), set()]
        self.ready: list = [None, None]     # copy fence covering everything enqueued into the buffer
        self.last_use: list = [None, None]  # compute fence of the last read
        self.current: int | None = None     # buffer the running layer computes from

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def _index_for(self, layer: int) -> int:
        for i in (0, 1):
            if self.layer[i] == layer:
                return i
        return 1 - self.current if self.current is not None else 0

    def _load(self, idx: int, layer: int, experts: Iterable[int]) -> int:
        if self.layer[idx] != layer:
            self.layer[idx] = layer
            self.have[idx] = set()
        todo = [e for e in experts if e not in self.have[idx]]
        after = self.last_use[idx]
        for e in todo:
            self.copier.copy(self.buffers[idx][e], self.banks.row(layer, e), after=after)
            after = None  # one wait is enough: the copy stream is FIFO
        if todo:
            self.ready[idx] = self.copier.fence()
            self.have[idx].update(todo)
        return len(todo)

    def acquire(self, layer: int, experts: Iterable[int]) -> tuple[int, int]:
        """Make ``experts`` of ``layer`` present in a buffer (copying those missing) and mark that buffer as
        the one being computed from. Returns ``(buffer index, experts copied now)``; wait on ``ready[index]``
        before reading it."""
        idx = self._index_for(layer)
        n = self._load(idx, layer, experts)
        self.current = idx
        return idx, n

    def prefetch(self, layer: int, experts: Iterable[int]) -> int:
        """Start copying ``experts`` of ``layer`` into the buffer not being computed from. Returns experts
        copied (0 when ``layer`` is the one computing)."""
        idx = self._index_for(layer)
        if idx == self.current:
            return 0
        return self._load(idx, layer, experts)

    def done_reading(self, idx: int, fence) -> None:
        """Record the compute fence after the reads of buffer ``idx``."""
        self.last_use[idx] = fence
