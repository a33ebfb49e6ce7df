"""Prefill layer streaming: two layer-sized device buffers, layer L+1 copying while layer L computes
(:class:`LayerStreamer`), and the offloading backends' streamed layer (:class:`StreamedPrefill`).

A prefill chunk of many tokens touches nearly every expert of every layer, so per-expert cache decisions buy
nothing: the whole layer has to cross PCIe anyway. Each buffer is ``[E, S]`` (one layer's expert rows) and
remembers which layer and which experts it holds. While layer L computes from one buffer, the other receives layer
L+1's experts, except those already in the slot cache (cache hits are not re-copied), one copy per run of
consecutive experts (a layer's bank rows and the buffer's rows are both in expert order); on CUDA the fused kernel
reads the hits from their slots and the rest from the buffer through a table of row offsets. A buffer is only
overwritten after the compute that read it (a compute fence), and is only read after its copies landed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ferrylm.experts.banks import HostBanks
from ferrylm.experts.transfer import CopyEngine
from ferrylm.triton_util import use_triton


def expert_runs(experts: list[int]) -> list[tuple[int, int]]:
    """Ascending distinct expert ids as ``[lo, hi)`` runs of consecutive ids: ``[1, 2, 3, 7]`` -> ``[(1, 4), (7,
    8)]``."""
    runs: list[tuple[int, int]] = []
    for e in experts:
        if runs and runs[-1][1] == e:
            runs[-1] = (runs[-1][0], e + 1)
        else:
            runs.append((e, e + 1))
    return runs


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
        todo = sorted({e for e in experts if e not in self.have[idx]})
        after = self.last_use[idx]
        for lo, hi in expert_runs(todo):   # one copy per run of consecutive experts (bank and buffer rows follow)
            self.copier.copy(self.buffers[idx][lo:hi], self.banks.rows(layer, lo, hi), after=after)
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

    def refill(self, idx: int, layer: int, experts: Iterable[int]) -> int:
        """Start copying ``experts`` of ``layer`` into buffer ``idx``, whose reads were just enqueued (the copies
        wait on :meth:`done_reading`'s fence). Returns experts copied."""
        return self._load(idx, layer, experts)

    def done_reading(self, idx: int, fence) -> None:
        """Record the compute fence after the reads of buffer ``idx``."""
        self.last_use[idx] = fence


class StreamedPrefill:
    """The streamed layer of the offloading backends (module docstring): mixed into
    :class:`~ferrylm.experts.cached.CachedExecutor`, whose slot cache, copy engine and counters it uses."""

    def stream_bytes(self) -> int:
        """Device bytes of the prefill double buffer (0 when streaming is off)."""
        return 2 * self.num_experts * self.layout.nbytes if self.options.stream_prefill else 0

    def _streams(self, num_tokens: int, top_k: int) -> bool:
        """A step of ``num_tokens`` tokens choosing ``top_k`` experts each streams its layers."""
        if self.streamer is None:
            return False
        if self.options.stream_min_tokens is not None:
            return num_tokens >= self.options.stream_min_tokens
        return num_tokens * top_k >= self.num_experts

    def _run_streamed(self, work) -> None:
        """Prefill: hits from their slots, everything else from the layer buffer. The next MoE layer (minus its
        cache hits) is already copying into the other buffer (started here only at a step's first streamed layer);
        once this layer's compute is enqueued, the layer after next starts copying into this buffer behind it, so
        the copy stream has its next layer queued while the host is still launching this one's successor."""
        hits, rest = self._classify(work)
        if self.faults.enabled and rest:
            self.faults.check("expert_fetch", nbytes=len(rest) * self.layout.nbytes)
        idx, copied = self.streamer.acquire(work.layer, rest)
        nxt = self._next.get(work.layer)
        if nxt is not None:
            copied += self.streamer.prefetch(nxt, self._uncached(nxt))
        if use_triton(work.hidden):
            self._run_streamed_fused(work, hits, idx, rest)
        else:
            self._compute_slots(work, hits)
            if rest:
                self.copier.wait(self.streamer.ready[idx])
                work.compute(rest, self.layout.layer_views(self.streamer.buffers[idx]), rest)
                self.streamer.done_reading(idx, self.copier.compute_fence())
        after = self._next.get(nxt) if nxt is not None else None
        if after is not None:
            copied += self.streamer.refill(idx, after, self._uncached(after))
        step = self.counters.step
        step.streamed += copied
        step.bytes_copied += copied * self.layout.nbytes

    def _uncached(self, layer: int) -> list[int]:
        return [e for e in range(self.num_experts) if (layer, e) not in self.cache]

    def _run_streamed_fused(self, work, hits: list[tuple[int, int]], idx: int, rest: list[int]) -> None:
        """The streamed layer on CUDA: ONE fused MoE call computes the whole layer (``experts/kernels/fused_moe.py``)
        instead of a GEMM chain per expert, reading each expert where it is: the cache hits from their slot rows,
        the rest from the layer buffer, through a table of row offsets (one small host-to-device copy a layer; no
        device-to-device copy of a hit)."""
        from ferrylm.experts.kernels.fused_moe import fused_moe

        buf = self.streamer.buffers[idx]
        if rest:
            self.copier.wait(self.streamer.ready[idx])
        self._wait_slots(hits)
        v = self.layout.layer_views(buf)
        offsets = None
        if hits:
            row_bytes = buf.stride(0) * buf.element_size()
            table = [e * row_bytes for e in range(self.num_experts)]
            base = buf.data_ptr()
            for e, slot in hits:
                table[e] = self.slots.row(slot).data_ptr() - base
            # a pageable source is staged at once: no device sync
            offsets = torch.tensor(table, dtype=torch.int64).to(buf.device, non_blocking=True)
        work.output = fused_moe(work.hidden, v.gate, v.up, v.down, work.topk_ids, work.topk_weights,
                                row_offset=offsets, math=work.math)
        self.streamer.done_reading(idx, self._release_slots(work, hits))
