"""The common base of the offloading backends (offload, cpu, hybrid): host banks + a device slot cache.

Per MoE layer and step (:meth:`CachedExecutor.run`):
  1. group the step's assignments by expert (one device->host sync for the per-expert counts);
  2. large chunks (prefill) go through the two-layer double buffer (:mod:`ferrylm.experts.stream`);
  3. otherwise each needed expert is a cache hit (pinned for this layer; never evicted while pinned) or a miss,
     and the backend's :meth:`CachedExecutor._dispatch` decides where each miss is computed;
  4. the weighted outputs are summed per token as the resident backend sums them (:mod:`ferrylm.experts.work`),
     so the backends agree to the last bit wherever their expert kernels do.

Device memory (``reserve``): ``N`` slots of one expert row each, shared by all layers, plus, with prefill
streaming, two layer buffers. ``--moe-cache-size`` fixes ``N``; otherwise ``N`` fills the budget.

Elastic slots: the slots live in separately freeable *blocks* (``[b, S]`` tensors of ``block_slots`` slots, the
last one possibly smaller); slot id ``s`` is row ``s % block_slots`` of block ``s // block_slots``. Between steps
the OOM guard (``memory/guard.py``) may :meth:`CachedExecutor.shrink_slots` (whole blocks dropped, their experts
evicted, nothing copied, so shrinking needs no extra memory) and later :meth:`CachedExecutor.grow_slots` (new
blocks, their slots free).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch

from ferrylm.errors import InsufficientMemory
from ferrylm.experts.banks import HostBanks
from ferrylm.experts.cache import Key, LayerLRUPolicy, SlotCache, make_policy
from ferrylm.experts.cpu_pool import CpuExpertPool, CpuJob
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.experts.options import Bandwidths, ExpertOptions
from ferrylm.experts.stats import ExpertStats
from ferrylm.experts.stream import LayerStreamer
from ferrylm.experts.transfer import make_copy_engine
from ferrylm.experts.work import LayerWork, group_by_expert, is_small_step
from ferrylm.triton_util import use_triton
from ferrylm.faults import NO_FAULTS

log = logging.getLogger("ferrylm.experts")

MAX_BLOCK_SLOTS = 4  # automatic block size cap (slots): the granularity at which the OOM guard can free memory

Router = Callable[[torch.Tensor], torch.Tensor]  # hidden [T, H] -> predicted topk_ids [T, k]


class CachedExecutor(ExpertExecutor):
    """Host banks + device slot cache + copy engine; subclasses implement :meth:`_dispatch`.

    Args:
        banks: all routed experts in host memory.
        device: the compute device (the slot cache lives there; on the CPU it is host memory).
        options: see :class:`~ferrylm.experts.options.ExpertOptions`.

    Class attributes: ``name`` (backend name), ``default_prefetch``, ``uses_cpu`` (owns a CPU expert pool),
    ``min_slots`` (slots it cannot work without), ``faults`` (the fault injector, point ``expert_fetch`` at demand
    fetches and prefill staging; the engine sets it).
    """

    name = "cached"
    block_slots: int | None = None  # slots per block; None: max(1, min(MAX_BLOCK_SLOTS, N // 8)) at reserve
    default_prefetch = False
    uses_cpu = False
    min_slots = 0
    faults = NO_FAULTS

    def __init__(self, banks: HostBanks, device: torch.device | str, options: ExpertOptions):
        self.banks = banks
        self.device = torch.device(device)
        self.options = options
        self.layout = banks.layout
        self.num_experts = banks.num_experts
        self.math = {i: m.to(self.device) for i, m in banks.math.items()}  # layer -> ExpertMath (gpt-oss)
        layers = banks.layers
        self._next = dict(zip(layers, layers[1:]))
        self._routers: dict[int, Router] = {}
        self.copier = make_copy_engine(self.device)
        self.cpu_pool = (CpuExpertPool(self.layout, options.cpu_threads, options.cpu_kernel) if self.uses_cpu
                         else None)
        self.prefetch = self.default_prefetch if options.prefetch is None else bool(options.prefetch)
        self._bandwidths = options.bandwidths
        self.counters = ExpertStats(layers)
        self.cache: SlotCache | None = None
        self._blocks: dict[int, torch.Tensor] = {}  # block id -> [b, S] slot rows on the device
        self._block_views: dict = {}                 # block id -> LayerExperts views of the block
        self._row_of: dict[int, torch.Tensor] = {}   # slot -> its [S] row (a view of its block)
        self._block_size = 1                         # slots per block (fixed at reserve)
        self.streamer: LayerStreamer | None = None
        self._ready: dict[int, object] = {}     # slot -> copy fence still to wait for
        self._last_use: dict[int, object] = {}  # slot -> compute fence of its last read
        self._prefetched: set[Key] = set()      # prefetched and not yet used
        self._copy_mark = (0.0, 0.0)
        self.table = None           # a SlotTable (experts/slot_table.py) when decode steps run from device tables
        self._table_stale = False   # the cache changed outside the table's bookkeeping: rebuild before next use

    # --- memory -----------------------------------------------------------------------------------------------
    @property
    def expert_bytes(self) -> int:
        return self.layout.nbytes

    def table_bytes(self) -> int:
        """Device bytes of the device-side expert table when this backend builds one (0 here; see
        ``experts/offload.py``), set aside before the slots are sized."""
        return 0

    def stream_bytes(self) -> int:
        """Device bytes of the prefill double buffer (0 when streaming is off)."""
        return 2 * self.num_experts * self.layout.nbytes if self.options.stream_prefill else 0

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

    def reserve(self, budget_bytes: int | None = None) -> int:
        """Allocate the slot cache (and stream buffers) within ``budget_bytes`` and warm it; returns ``N``.
        Called by the boot (engine/boot.py) once the weights and KV pool are placed; otherwise on the first run with
        no budget. Re-reserving drops the cache first."""
        self._drop_device_memory()
        n = self.plan_slots(budget_bytes)
        b = self.block_slots if self.block_slots else max(1, min(MAX_BLOCK_SLOTS, n // 8))
        self._block_size = int(b)
        for blk in range(-(-n // b)):
            self._new_block(blk, min(b, n - blk * b))
        policy = make_policy(self.options.cache_policy, n, len(self.banks.layers))
        self.cache = SlotCache(n, policy)
        if self.options.stream_prefill:
            self.streamer = LayerStreamer(self.banks, self.device, self.copier)
        self._warm_fill()
        self._init_table()
        log.info("%s experts: %d slots x %.1f MiB = %.2f GiB on %s (of %d experts)%s", self.name, n,
                 self.layout.nbytes / 2**20, n * self.layout.nbytes / 2**30, self.device,
                 len(self.banks.layers) * self.num_experts,
                 f", prefill buffers {self.streamer.nbytes / 2**30:.2f} GiB" if self.streamer else "")
        return n

    # --- slot blocks --------------------------------------------------------------------------------------------
    def _new_block(self, blk: int, size: int) -> None:
        """Allocate block ``blk`` of ``size`` slots (raises torch.OutOfMemoryError when the device is full)."""
        t = torch.empty(size, self.layout.numel, dtype=self.layout.row_dtype, device=self.device)
        self._blocks[blk] = t
        self._block_views[blk] = self.layout.layer_views(t)  # gate/up [b, I, H], down [b, H, I] views
        for i, row in enumerate(t.unbind(0)):  # slot -> [S] row view, made once (not one select per use)
            self._row_of[blk * self._block_size + i] = row

    def _block_slot_ids(self, blk: int) -> list[int]:
        return [blk * self._block_size + i for i in range(self._blocks[blk].shape[0])]

    def _slot_row(self, slot: int) -> torch.Tensor:
        """The ``[S]`` device row of ``slot``."""
        return self._row_of[slot]

    def slot_storage_bytes(self) -> int:
        """Device bytes held by the slot blocks now (the stream buffers not included)."""
        return sum(t.nbytes for t in list(self._blocks.values()))  # list(): stats() may read from another thread

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
            rank = {k: i for i, k in enumerate(cache.policy.keys())}  # LRU policies: oldest first

            def age(blk: int) -> tuple:
                ranks = [rank.get(cache.key_of(s), -1) for s in self._block_slot_ids(blk)
                         if cache.key_of(s) is not None]
                return (max(ranks, default=-1), len(ranks), -blk)

            drop, count, left = [], 0, cache.num_slots
            for blk in sorted(self._blocks, key=age):
                if count >= n:
                    break
                size = self._blocks[blk].shape[0]
                if left - size < self.min_slots:
                    continue
                drop.append(blk)
                count += size
                left -= size
            if not drop:
                return 0
            self.copier.synchronize()  # no queued copy may still write into a block about to go
            slots = [s for blk in drop for s in self._block_slot_ids(blk)]
            evicted = cache.remove_slots(slots)
            for k in evicted:
                self._prefetched.discard(k)
            for s in slots:
                self._ready.pop(s, None)
                self._last_use.pop(s, None)
            freed = 0
            for s in slots:
                self._row_of.pop(s, None)
            for blk in drop:
                self._block_views.pop(blk, None)
                freed += self._blocks.pop(blk).nbytes
            self._set_quota()
            self._table_stale = True
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
        added = 0
        blk = 0
        while added < n:
            while blk in self._blocks:
                blk += 1
            size = min(self._block_size, n - added)
            try:
                self._new_block(blk, size)
            except (torch.OutOfMemoryError, MemoryError) as e:
                log.info("%s experts: growing the slot cache stopped after %d of %d slots: %s", self.name, added,
                         n, str(e).split("\n")[0][:200])
                break
            cache.add_slots(self._block_slot_ids(blk))
            added += size
        if added:
            self._set_quota()
            log.info("%s experts: cache grew by %d slots, %d slots now", self.name, added, cache.num_slots)
        return added

    def _warm_fill(self) -> None:
        """Fill the empty cache layer-round-robin (expert 0 of every layer, then expert 1 ...), so the first steps
        are not all misses and every layer gets an equal share; not counted in the stats."""
        layers = self.banks.layers
        for i in range(self.cache.num_slots):
            layer, e = layers[i % len(layers)], i // len(layers)
            slot, _ = self.cache.admit((layer, e))
            self.copier.copy(self._slot_row(slot), self.banks.row(layer, e))
        self.copier.synchronize()
        self.copier.harvest()
        self._copy_mark = (self.copier.copy_time_s, self.copier.exposed_s)

    def _init_table(self) -> None:
        """Build the device-side expert table after a reserve (backends that decode from it override this)."""

    def slot_offsets(self) -> dict[Key, int]:
        """``(layer, expert) -> byte offset`` of every cached expert's slot row from the table's reference row."""
        ref = self.table.ref.data_ptr()
        return {key: self._slot_row(slot).data_ptr() - ref for key, slot in self.cache._slot_of.items()}

    def _drop_device_memory(self) -> None:
        self.copier.synchronize()
        self.table = None
        self._blocks.clear()
        self._block_views.clear()
        self._row_of.clear()
        self.cache = None
        self.streamer = None
        self._ready.clear()
        self._last_use.clear()
        self._prefetched.clear()

    def close(self) -> None:
        self._drop_device_memory()
        self.copier.close()
        if self.cpu_pool is not None:
            self.cpu_pool.close()

    # --- hooks ------------------------------------------------------------------------------------------------
    def register_router(self, layer_idx: int, route: Router) -> None:
        self._routers[layer_idx] = route

    def bandwidths(self) -> Bandwidths:
        """The rates: the options', else the machine profile's or measured, once, on first need
        (:func:`~ferrylm.experts.bandwidth.machine_bandwidths`)."""
        if self._bandwidths is None:
            from ferrylm.experts.bandwidth import machine_bandwidths

            self._bandwidths = machine_bandwidths(self.device, self.layout, pinned=self.banks.pinned,
                                                  pool=self.cpu_pool, threads=self.options.cpu_threads)
        return self._bandwidths

    # --- the step ---------------------------------------------------------------------------------------------
    def next_layer_predictor(self, layer_idx: int, num_tokens: int) -> Router | None:
        """See :meth:`ExpertExecutor.next_layer_predictor`: the next MoE layer's router when prefetch is on, the
        layer has a successor and the step is small enough to be planned on the host."""
        nxt = self._next.get(layer_idx)
        if nxt is None or not is_small_step(num_tokens) or not self.prefetches(num_tokens):
            return None
        return self._routers.get(nxt)

    def prefetches(self, num_tokens: int) -> bool:
        """Steps of ``num_tokens`` tokens predict and prefetch the next MoE layer's experts: prefetch is on,
        routers are registered, and the step has at most ``prefetch_max_tokens`` tokens."""
        return self.prefetch and bool(self._routers) and num_tokens <= self.options.prefetch_max_tokens

    def run(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
            ids_and_predicted: torch.Tensor | None = None, stage=None) -> torch.Tensor | None:
        """See :meth:`ExpertExecutor.run` (backends with ``stages``: a small step's experts, once resident, are
        stacked into ``stage.rows`` instead of computed). Raises KeyError for a layer without experts."""
        if layer_idx not in self.banks:
            raise KeyError(f"layer {layer_idx} has no routed experts (MoE layers: {list(self.banks.layers)})")
        if self.cache is None:
            self.reserve(None)
        t = hidden.shape[0]
        if self.table is not None and self.table_step(t):
            return self._run_table(layer_idx, hidden, topk_ids, topk_weights)
        if self.counters.starts_step(layer_idx):
            self._fold_copy_times()
            self.counters.open_step(t)
        if t == 0:
            return torch.zeros_like(hidden)
        streams = self._streams(t, topk_ids.shape[1])
        if not streams and is_small_step(t):
            work = self._plan_small(layer_idx, hidden, topk_ids, topk_weights, ids_and_predicted)
            work.stage = stage if self.stages else None
        else:
            work = LayerWork(layer_idx, hidden, topk_ids, group_by_expert(topk_ids, topk_weights, self.num_experts),
                             topk_weights=topk_weights, math=self.math.get(layer_idx))
        try:
            if streams:
                self._run_streamed(work)
            else:
                self._run_cached(work)
        finally:
            self.cache.unpin_all()
        return None if work.staged else work.combine()

    def _plan_small(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, ids_and_predicted: torch.Tensor | None = None) -> LayerWork:
        """Read the step's expert ids to the host (ONE device->host sync per layer; with prefetch on, the next
        layer's predicted ids, computed first or given in ``ids_and_predicted``, come along in the same read) and
        plan the layer on the host.

        Raises:
            ValueError: an expert id outside ``[0, E)``.
        """
        t = hidden.shape[0]
        if ids_and_predicted is None or ids_and_predicted.shape[0] <= t:
            route = self.next_layer_predictor(layer_idx, t)
            ids_and_predicted = topk_ids if route is None else torch.cat([topk_ids, route(hidden)])
        host = ids_and_predicted.tolist()
        work = LayerWork.from_host_ids(layer_idx, hidden, topk_ids, topk_weights, host[:t], self.num_experts,
                                       math=self.math.get(layer_idx))
        if len(host) > t:
            load = Counter(e for row in host[t:] for e in row)
            work.predicted = {e: load[e] for e in sorted(load)}
        return work

    def table_step(self, num_tokens: int) -> bool:
        """A step of ``num_tokens`` tokens runs from the device table (backends with one: one fused launch per
        layer, no host decision inside the step); otherwise the host-planned or streamed paths."""
        table = self.table
        return table is not None and self.table_min_tokens <= num_tokens <= table.max_tokens

    @property
    def table_min_tokens(self) -> int:
        """The smallest step that runs from the device table (backends without one: never)."""
        return 1

    def _run_table(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _streams(self, num_tokens: int, top_k: int) -> bool:
        if self.streamer is None:
            return False
        if self.options.stream_min_tokens is not None:
            return num_tokens >= self.options.stream_min_tokens
        return num_tokens * top_k >= self.num_experts

    def _classify(self, work: LayerWork) -> tuple[list[tuple[int, int]], list[int]]:
        """Split the needed experts into pinned hits ``(expert, slot)`` and misses; count them."""
        hits, misses = [], []
        step = self.counters.step
        for e in work.needed:
            key = (work.layer, e)
            slot = self.cache.lookup(key)
            if slot is None:
                misses.append(e)
                continue
            self.cache.pin(key)
            hits.append((e, slot))
            if key in self._prefetched:
                self._prefetched.discard(key)
                step.prefetch_hits += 1
        step.needed += len(work.needed)
        step.hits += len(hits)
        step.misses += len(misses)
        return hits, misses

    def _run_cached(self, work: LayerWork) -> None:
        hits, misses = self._classify(work)
        self._dispatch(work, hits, misses)

    def _dispatch(self, work: LayerWork, hits: list[tuple[int, int]], misses: list[int]) -> None:
        """Compute every needed expert into ``work.parts``: ``hits`` are pinned in their slots; ``misses`` are
        not cached."""
        raise NotImplementedError

    # --- building blocks for the backends ---------------------------------------------------------------------
    def _fetch(self, layer: int, experts: list[int], *, prefetch: bool = False) -> list[tuple[int, int]]:
        """Admit ``experts`` of ``layer`` into slots (evicting unpinned LRU ones) and enqueue their copies.
        Demand fetches are pinned; prefetches are not. Returns ``(expert, slot)`` pairs.

        Raises whatever admitting or queuing raises (CacheFull, an injected or real OOM at ``expert_fetch``, a
        copy error); the expert being admitted is then evicted again, so the cache never maps an expert to a slot
        whose copy was never queued, and the copies already queued are fenced as usual."""
        check = self.faults.enabled and bool(experts) and not prefetch
        step = self.counters.step
        items = []
        self._table_stale = True  # admissions outside the table's planning
        try:
            with self.copier.batch():
                self._fetch_each(layer, experts, prefetch, check, items)
        finally:
            if items:
                fence = self.copier.fence()
                for _, slot in items:
                    self._ready[slot] = fence
        if items:
            step.bytes_copied += len(items) * self.layout.nbytes
            if prefetch:
                step.prefetched += len(items)
            else:
                step.fetched += len(items)
        return items

    def _fetch_each(self, layer: int, experts: list[int], prefetch: bool, check: bool,
                    items: list[tuple[int, int]]) -> None:
        """Admit and enqueue one by one, appending ``(expert, slot)`` to ``items`` (see :meth:`_fetch`)."""
        step = self.counters.step
        for e in experts:
            key = (layer, e)
            slot, evicted = self.cache.admit(key)
            try:
                if evicted is not None and evicted in self._prefetched:
                    self._prefetched.discard(evicted)
                    step.prefetch_wasted += 1
                if check:  # the staging of this fetch: checked once per fetch, after its first admit
                    check = False
                    self.faults.check("expert_fetch", nbytes=len(experts) * self.layout.nbytes)
                self.copier.copy(self._slot_row(slot), self.banks.row(layer, e),
                                 after=self._last_use.pop(slot, None))
            except BaseException:
                self.cache.evict(key)  # admitted, never copied: must not look cached
                raise
            items.append((e, slot))
            if prefetch:
                self._prefetched.add(key)
            else:
                self.cache.pin(key)

    def _wait_slots(self, items: list[tuple[int, int]]) -> None:
        seen = set()
        for _, slot in items:
            fence = self._ready.pop(slot, None)
            if fence is not None and id(fence) not in seen:
                seen.add(id(fence))
                self.copier.wait(fence)

    def _compute_slots(self, work: LayerWork, items: list[tuple[int, int]]) -> None:
        """Compute ``(expert, slot)`` items on the device (after their copies landed), then unpin them."""
        if not items:
            return
        items = sorted(items)
        self._wait_slots(items)
        b = self._block_size
        blocks = {slot // b for _, slot in items}
        experts = [e for e, _ in items]
        if work.can_stage(experts):  # the caller's graph computes them from the stage
            torch.stack([self._slot_row(slot) for _, slot in items], out=work.stage.rows[:len(items)])
            work.stage_into(experts)
        elif len(blocks) == 1:
            blk = blocks.pop()
            work.compute([e for e, _ in items], self._block_views[blk], [slot % b for _, slot in items])
        elif work.batched:  # one batched call across blocks (as the resident backend computes the layer)
            rows = torch.stack([self._slot_row(slot) for _, slot in items])
            work.compute([e for e, _ in items], self.layout.layer_views(rows), None)
        else:  # one GEMM chain per expert, straight from its slot (no gather)
            views = [self._block_views[slot // b] for _, slot in items]
            work.compute_each([e for e, _ in items], [(v.gate[slot % b], v.up[slot % b], v.down[slot % b])
                                                      for v, (_, slot) in zip(views, items)])
        fence = self.copier.compute_fence()
        for e, slot in items:
            if fence is not None:
                self._last_use[slot] = fence
            self.cache.unpin((work.layer, e))

    def _maybe_prefetch(self, work: LayerWork) -> None:
        """Predict the next MoE layer's experts by applying its router to this layer's hidden state (Eliseev &
        Mazur 2023, §3.2) and copy the uncached ones into slots no pinned or just-predicted expert occupies."""
        plan = self._prefetch_plan(work)
        if plan is not None:
            nxt, todo, room = plan
            if todo and room:
                self._fetch(nxt, todo[:room], prefetch=True)

    def _prefetch_plan(self, work: LayerWork) -> tuple[int, list[int], int] | None:
        """``(next MoE layer, its predicted experts not cached, evictable slots left for them)``, or None when
        there is nothing to predict (prefetch off, last layer, a large step). The predicted experts already
        cached are touched (kept from eviction by the copies that follow)."""
        nxt = self._next.get(work.layer)
        route = self._routers.get(nxt) if nxt is not None else None
        if route is None or not self.prefetches(work.hidden.shape[0]):
            return None
        predicted = work.predicted
        if predicted is None:
            predicted = torch.unique(route(work.hidden)).tolist()
        todo, kept = [], 0
        for e in predicted:
            key = (nxt, int(e))
            if key in self.cache:
                self.cache.touch(key)
                kept += 1
            else:
                todo.append(int(e))
        return nxt, todo, max(0, self.cache.evictable() - kept)

    def _submit_cpu(self, work: LayerWork, experts: list[int]):
        """Start the CPU job for ``experts`` (activations go to the host). Returns a handle for
        :meth:`_collect_cpu`, or None when ``experts`` is empty."""
        if not experts:
            return None
        x, w = work.gather_inputs(experts)
        x, w = x.to("cpu"), w.to("cpu")
        items, start = [], 0
        for e in experts:
            n = work.spans[e][1]
            items.append((e, self.banks.row(work.layer, e), start, n))
            start += n
        step = self.counters.step
        step.cpu_experts += len(experts)
        if self.device.type != "cpu":
            step.bytes_activations += 2 * x.numel() * x.element_size()
        math = self.banks.math.get(work.layer)  # host copies: the CPU computes these experts
        return experts, self.cpu_pool.submit(CpuJob(x=x, weights=w, items=items, out_dtype=work.hidden.dtype,
                                                    math=math))

    def _collect_cpu(self, work: LayerWork, handle) -> None:
        """Wait for the CPU job and place its outputs (moved to the device) into ``work.parts``."""
        if handle is None:
            return
        experts, future = handle
        outs, seconds = future.result()
        self.counters.step.cpu_expert_time_s += seconds
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        work.put(experts, out.to(self.device) if self.device.type != "cpu" else out)

    def _run_streamed(self, work: LayerWork) -> None:
        """Prefill: hits from their slots, everything else from the layer buffer; start copying the next MoE
        layer (minus its cache hits) into the other buffer before computing."""
        hits, rest = self._classify(work)
        if self.faults.enabled and rest:
            self.faults.check("expert_fetch", nbytes=len(rest) * self.layout.nbytes)
        step = self.counters.step
        idx, copied = self.streamer.acquire(work.layer, rest)
        nxt = self._next.get(work.layer)
        if nxt is not None:
            copied += self.streamer.prefetch(nxt, [e for e in range(self.num_experts) if (nxt, e) not in self.cache])
        step.streamed += copied
        step.bytes_copied += copied * self.layout.nbytes
        if use_triton(work.hidden):
            self._run_streamed_fused(work, hits, idx, rest)
            return
        self._compute_slots(work, hits)
        if rest:
            self.copier.wait(self.streamer.ready[idx])
            work.compute(rest, self.layout.layer_views(self.streamer.buffers[idx]), rest)
            self.streamer.done_reading(idx, self.copier.compute_fence())

    def _run_streamed_fused(self, work: LayerWork, hits: list[tuple[int, int]], idx: int, rest: list[int]) -> None:
        """The streamed layer on CUDA: the cache hits join the layer buffer by device-to-device copies (a few
        microseconds each, against a PCIe copy), then ONE fused MoE call computes the whole layer from the buffer
        (``experts/kernels/fused_moe.py``) instead of a GEMM chain per expert."""
        from ferrylm.experts.kernels.fused_moe import fused_moe

        buf = self.streamer.buffers[idx]
        if rest:
            self.copier.wait(self.streamer.ready[idx])
        items = sorted(hits)
        self._wait_slots(items)
        for e, slot in items:
            buf[e].copy_(self._slot_row(slot))
        self.streamer.have[idx].update(e for e, _ in items)
        v = self.layout.layer_views(buf)
        work.output = fused_moe(work.hidden, v.gate, v.up, v.down, work.topk_ids, work.topk_weights,
                                math=work.math)
        fence = self.copier.compute_fence()
        for e, slot in items:
            if fence is not None:
                self._last_use[slot] = fence
            self.cache.unpin((work.layer, e))
        self.streamer.done_reading(idx, fence)

    # --- stats ------------------------------------------------------------------------------------------------
    def _fold_copy_times(self) -> None:
        self.copier.harvest()
        ct, ex = self.copier.copy_time_s, self.copier.exposed_s
        self.counters.step.copy_time_s += ct - self._copy_mark[0]
        self.counters.step.copy_exposed_s += ex - self._copy_mark[1]
        self._copy_mark = (ct, ex)

    def sync_stats(self) -> None:
        """Fold finished copy timings into the current step now (call from the thread that runs the model;
        otherwise they are folded at each step boundary)."""
        self._fold_copy_times()

    def stats(self) -> dict:
        """Counters (see :class:`~ferrylm.experts.stats.Counters`), the last step's, per-layer hits and misses,
        and the cache shape (``num_slots``, ``expert_bytes``, ``pinned`` banks). Read-only, so the engine's
        heartbeat thread may call it while a step runs; copy timings lag by up to one step
        (:meth:`sync_stats`)."""
        cache = self.cache
        d = self.counters.snapshot(cache.hits if cache else {}, cache.misses if cache else {})
        d.update(backend=self.name, num_slots=cache.num_slots if cache else 0, expert_bytes=self.layout.nbytes,
                 slot_blocks=len(self._blocks), slot_bytes=self.slot_storage_bytes(),
                 pinned=self.banks.pinned, prefetch=self.prefetch,
                 cpu_threads=self.cpu_pool.threads if self.cpu_pool else 0,
                 cpu_kernel=self.cpu_pool.kernel_name if self.cpu_pool else None)
        return d
