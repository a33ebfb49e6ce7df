"""The slot cache's device memory: expert rows in separately freeable blocks (:class:`SlotBlocks`), and the
offloading backends' slot sizing and elastic shrink / grow (:class:`ElasticSlots`).

``N`` slots of one expert row each live in *blocks* (``[b, S]`` tensors of ``block_size`` slots, the last one
possibly smaller); slot id ``s`` is row ``s % block_size`` of block ``s // block_size``. The OOM guard gives memory
back by whole blocks (``CachedExecutor.shrink_slots``: the blocks dropped, their experts evicted, nothing copied, so
shrinking needs no extra memory) and takes it again by new blocks (``CachedExecutor.grow_slots``). Which expert
sits in which slot is :class:`~ferrylm.experts.cache.SlotCache`'s bookkeeping, not this file's.
"""

from __future__ import annotations

import logging

import torch

from ferrylm.errors import InsufficientMemory
from ferrylm.experts.cache import LayerLRUPolicy, SlotCache
from ferrylm.experts.executor import ExpertNeeds

log = logging.getLogger("ferrylm.experts")

MAX_BLOCK_SLOTS = 4  # automatic block size cap (slots): the granularity at which the OOM guard can free memory


class SlotBlocks:
    """The device rows of the slots.

    Args:
        layout: the :class:`~ferrylm.experts.executor.ExpertLayout` of one row.
        device: where the rows live (on the CPU: host memory).

    Attributes:
        blocks: block id -> ``[b, S]`` rows. views: block id -> its :class:`~ferrylm.experts.executor.LayerExperts`
            views (gate/up ``[b, I, H]``, down ``[b, H, I]``). block_size: slots per block (fixed by
            :meth:`allocate`).
    """

    def __init__(self, layout, device: torch.device):
        self.layout = layout
        self.device = device
        self.blocks: dict[int, torch.Tensor] = {}
        self.views: dict = {}
        self._row_of: dict[int, torch.Tensor] = {}  # slot -> its [S] row (a view of its block)
        self.block_size = 1

    def allocate(self, n: int, block_slots: int | None) -> None:
        """Drop every block, then make ``n`` slots in blocks of ``block_slots`` (None: ``max(1, min(4, n // 8))``).
        Raises torch.OutOfMemoryError when the device is full."""
        self.clear()
        b = block_slots if block_slots else max(1, min(MAX_BLOCK_SLOTS, n // 8))
        self.block_size = int(b)
        for blk in range(-(-n // b)):
            self.new_block(blk, min(b, n - blk * b))

    def new_block(self, blk: int, size: int) -> None:
        """Allocate block ``blk`` of ``size`` slots (raises torch.OutOfMemoryError when the device is full)."""
        t = torch.empty(size, self.layout.numel, dtype=self.layout.row_dtype, device=self.device)
        self.blocks[blk] = t
        self.views[blk] = self.layout.layer_views(t)
        for i, row in enumerate(t.unbind(0)):  # slot -> [S] row view, made once (not one select per use)
            self._row_of[blk * self.block_size + i] = row

    def add_block(self, size: int) -> list[int]:
        """A new block of ``size`` slots under the lowest free block id; returns its slot ids. Raises
        torch.OutOfMemoryError / MemoryError when it does not fit."""
        blk = 0
        while blk in self.blocks:
            blk += 1
        self.new_block(blk, size)
        return self.slot_ids(blk)

    def slot_ids(self, blk: int) -> list[int]:
        return [blk * self.block_size + i for i in range(self.blocks[blk].shape[0])]

    def row(self, slot: int) -> torch.Tensor:
        """The ``[S]`` device row of ``slot``."""
        return self._row_of[slot]

    def locate(self, slot: int) -> tuple[int, int]:
        """``(block id, row in the block)`` of ``slot``."""
        return slot // self.block_size, slot % self.block_size

    @property
    def nbytes(self) -> int:
        """Device bytes the blocks hold now."""
        return sum(t.nbytes for t in list(self.blocks.values()))  # list(): stats() may read from another thread

    def choose_drop(self, cache: SlotCache, n: int, min_slots: int) -> tuple[list[int], int]:
        """The blocks to drop for at least ``n`` slots: those whose residents were least recently used first (empty
        blocks before all), skipping a block that would leave fewer than ``min_slots``. Returns ``(block ids,
        their slots)``."""
        rank = {k: i for i, k in enumerate(cache.policy.keys())}  # LRU policies: oldest first

        def age(blk: int) -> tuple:
            ranks = [rank.get(cache.key_of(s), -1) for s in self.slot_ids(blk) if cache.key_of(s) is not None]
            return (max(ranks, default=-1), len(ranks), -blk)

        drop, count, left = [], 0, cache.num_slots
        for blk in sorted(self.blocks, key=age):
            if count >= n:
                break
            size = self.blocks[blk].shape[0]
            if left - size < min_slots:
                continue
            drop.append(blk)
            count += size
            left -= size
        return drop, count

    def drop(self, blks: list[int]) -> int:
        """Release blocks ``blks`` (their slots must be out of the cache); returns the device bytes freed."""
        freed = 0
        for blk in blks:
            for s in self.slot_ids(blk):
                self._row_of.pop(s, None)
            self.views.pop(blk, None)
            freed += self.blocks.pop(blk).nbytes
        return freed

    def clear(self) -> None:
        self.blocks.clear()
        self.views.clear()
        self._row_of.clear()


class ElasticSlots:
    """The slot cache's memory side of :class:`~ferrylm.experts.cached.CachedExecutor` (mixed into it): what the
    memory plan sets aside, how many slots a budget holds, the warm fill after a reserve, and the OOM guard's
    shrink / grow between steps. Uses the executor's ``banks``, ``layout``, ``options``, ``cache``, ``slots``,
    ``copier`` and its fence maps."""

    @property
    def slot_bytes(self) -> int:
        return self.layout.nbytes

    @property
    def num_slots(self) -> int:
        cache = self.cache
        return cache.num_slots if cache is not None else 0

    def slot_needs(self) -> ExpertNeeds:
        """See :meth:`ExpertExecutor.slot_needs`: the stream buffers and the device table are its fixed bytes."""
        return ExpertNeeds(slot_bytes=self.layout.nbytes, fixed_bytes=self.stream_bytes() + self.table_bytes(),
                           total_experts=len(self.banks.layers) * self.num_experts, min_slots=self.min_slots,
                           backend=self.name)

    def plan_slots(self, budget_bytes: int | None) -> int:
        """Slots for ``budget_bytes`` of device memory (None: no budget): as many as fit after the stream buffers,
        at most ``--moe-cache-size`` when given, at most every expert. (The memory plan checks an explicit
        ``--moe-cache-size`` against the device and reports it; here the budget simply wins.)

        Raises:
            InsufficientMemory: the budget cannot hold the backend's minimum slots.
        """
        total = len(self.banks.layers) * self.num_experts
        per = self.layout.nbytes
        fixed = self.stream_bytes() + self.table_bytes()
        n = total if self.options.cache_size is None else min(self.options.cache_size, total)
        if budget_bytes is not None:
            n = min(n, max(0, (budget_bytes - fixed) // per))
        if n < self.min_slots:
            raise InsufficientMemory(
                f"the {self.name} backend needs >= {self.min_slots} expert slot(s) of {per / 2**20:.1f} MiB "
                f"(+ {fixed / 2**30:.2f} GiB prefill buffers) but the device budget for experts is "
                f"{(budget_bytes or 0) / 2**30:.2f} GiB")
        return int(n)

    # --- elastic slots (between steps, for the OOM guard) -------------------------------------------------------
    def slot_storage_bytes(self) -> int:
        """Device bytes held by the slot blocks now (the stream buffers not included)."""
        return self.slots.nbytes

    def _set_quota(self) -> None:
        policy = self.cache.policy
        if isinstance(policy, LayerLRUPolicy):
            policy.quota = max(1, self.cache.num_slots // len(self.banks.layers))

    def shrink_slots(self, n: int) -> int:
        """Give up at least ``n`` slots (rounded up to whole blocks) and release their device memory; for the OOM
        guard, between steps. The blocks whose residents were least recently used go first (empty blocks before
        all); their experts are evicted, nothing is copied. Never goes below ``min_slots`` (a block that would
        cross it is skipped, so fewer than ``n`` slots may go). Refuses (returns 0) while any expert is pinned,
        i.e. inside a step. Never raises (an unexpected error is logged and 0 returned).

        Args:
            n: slots wanted back (slots).

        Returns:
            device bytes actually released by dropped blocks (0: nothing could go). On CUDA the memory returns to
            the caching allocator (reused by the retried step; ``torch.cuda.empty_cache`` hands it to the driver).
        """
        try:
            cache = self.cache
            if cache is None or n <= 0 or cache.num_slots <= self.min_slots:
                return 0
            if cache.pinned:
                log.warning("expert cache shrink refused: %d experts pinned (called inside a step)",
                            len(cache.pinned))
                return 0
            self.settle_device()
            drop, count = self.slots.choose_drop(cache, n, self.min_slots)
            if not drop:
                return 0
            self.copier.synchronize()  # no queued copy may still write into a block about to go
            slots = [s for blk in drop for s in self.slots.slot_ids(blk)]
            evicted = cache.remove_slots(slots)
            for k in evicted:
                self._prefetched.discard(k)
            for s in slots:
                self._ready.pop(s, None)
                self._last_use.pop(s, None)
            freed = self.slots.drop(drop)
            self._set_quota()
            self._cache_changed()
            log.warning("%s experts: cache shrunk by %d slots in %d blocks (%.1f MiB released, %d experts "
                        "evicted), %d slots left", self.name, count, len(drop), freed / 2**20, len(evicted),
                        cache.num_slots)
            return freed
        except Exception:  # noqa: BLE001 - the OOM ladder must go on to its next rung
            log.exception("%s experts: shrinking the slot cache failed", self.name)
            return 0

    def grow_slots(self, n: int) -> int:
        """Add up to ``n`` empty slots (slots) in new blocks of ``block_slots``, never more slots than experts;
        stops at the first allocation failure (torch.OutOfMemoryError / MemoryError, logged) and keeps what was
        added. Call between steps.

        Returns:
            slots added (0 when nothing fits, the cache is not reserved, or every expert already has a slot).
        """
        cache = self.cache
        if cache is None or n <= 0:
            return 0
        n = min(n, len(self.banks.layers) * self.num_experts - cache.num_slots)
        self.settle_device()
        added = 0
        while added < n:
            size = min(self.slots.block_size, n - added)
            try:
                ids = self.slots.add_block(size)
            except (torch.OutOfMemoryError, MemoryError) as e:
                log.info("%s experts: growing the slot cache stopped after %d of %d slots: %s", self.name, added,
                         n, str(e).split("\n")[0][:200])
                break
            cache.add_slots(ids)
            added += size
        if added:
            self._set_quota()
            self._cache_changed()
            log.info("%s experts: cache grew by %d slots, %d slots now", self.name, added, cache.num_slots)
        return added

    def _warm_fill(self) -> None:
        """Fill the empty cache layer-round-robin (expert 0 of every layer, then expert 1 ...), so the first steps
        are not all misses and every layer gets an equal share; not counted in the stats."""
        layers = self.banks.layers
        for i in range(self.cache.num_slots):
            layer, e = layers[i % len(layers)], i // len(layers)
            slot, _ = self.cache.admit((layer, e))
            self.copier.copy(self.slots.row(slot), self.banks.row(layer, e))
        self.copier.synchronize()
        self.copier.harvest()
        self._copy_mark = (self.copier.copy_time_s, self.copier.exposed_s)
