"""The common base of the offloading backends (offload, cpu, hybrid): host banks + a device slot cache.

Per MoE layer and step (:meth:`CachedExecutor.run`):
  1. group the step's assignments by expert (one device->host sync for the per-expert counts);
  2. large chunks (prefill) go through the two-layer double buffer (:mod:`ferrylm.experts.stream`);
  3. otherwise each needed expert is a cache hit (pinned for this layer; never evicted while pinned) or a miss,
     and the backend's :meth:`CachedExecutor._dispatch` decides where each miss is computed;
  4. the weighted outputs are summed per token as the resident backend sums them (:mod:`ferrylm.experts.work`),
     so the backends agree to the last bit wherever their expert kernels do.

Device memory (``reserve``): ``N`` slots of one expert row each, shared by all layers, plus, with prefill
streaming, two layer buffers. ``--moe-cache-size`` fixes ``N``; otherwise ``N`` fills the budget. The slots live
in separately freeable blocks (:mod:`ferrylm.experts.slots`): between steps the OOM guard (``memory/guard.py``) may
:meth:`CachedExecutor.shrink_slots` and later :meth:`CachedExecutor.grow_slots`.

Other rooms of these backends: :mod:`ferrylm.experts.stream` (the streamed prefill layer),
:mod:`ferrylm.experts.table_decode` (offload's device-table decode), :mod:`ferrylm.experts.cache` (which expert
sits in which slot).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

import torch

from ferrylm.experts.banks import HostBanks
from ferrylm.experts.cache import Key, SlotCache, make_policy
from ferrylm.experts.cpu_pool import CpuExpertPool, CpuJob
from ferrylm.experts.executor import ExpertExecutor, Router
from ferrylm.experts.options import Bandwidths, ExpertOptions
from ferrylm.experts.slots import ElasticSlots, SlotBlocks
from ferrylm.experts.stats import ExpertReport, ExpertStats, SlotCacheReport
from ferrylm.experts.stream import LayerStreamer, StreamedPrefill
from ferrylm.experts.transfer import make_copy_engine
from ferrylm.experts.work import LayerWork, group_by_expert, is_small_step

log = logging.getLogger("ferrylm.experts")


class CachedExecutor(ElasticSlots, StreamedPrefill, ExpertExecutor):
    """Host banks + device slot cache + copy engine; subclasses implement :meth:`_dispatch`.

    Args:
        banks: all routed experts in host memory.
        device: the compute device (the slot cache lives there; on the CPU it is host memory).
        options: see :class:`~ferrylm.experts.options.ExpertOptions`.

    Class attributes: ``name`` (backend name), ``default_prefetch``, ``uses_cpu`` (owns a CPU expert pool),
    ``stages`` (a small step's experts may be staged into the caller's decode graph), ``min_slots`` (slots it
    cannot work without); ``faults`` (point ``expert_fetch`` at demand fetches and prefill staging).
    """

    name = "cached"
    block_slots: int | None = None  # slots per block; None: max(1, min(4, N // 8)) at reserve (slots.py)
    default_prefetch = False
    uses_cpu = False
    stages = False

    def __init__(self, banks: HostBanks, device: torch.device | str, options: ExpertOptions):
        self.banks = banks
        self.device = torch.device(device)
        self.options = options
        self.layout = banks.layout
        self.num_experts = banks.num_experts
        self.math = {i: m.to(self.device) for i, m in banks.math.items()}  # layer -> ExpertMath (gpt-oss)
        self._host_math = {i: m.to("cpu") for i, m in banks.math.items()}  # the same for the CPU's jobs
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
        self.slots = SlotBlocks(self.layout, self.device)  # the slots' device rows
        self.streamer: LayerStreamer | None = None
        self._ready: dict[int, object] = {}     # slot -> copy fence still to wait for
        self._last_use: dict[int, object] = {}  # slot -> compute fence of its last read
        self._prefetched: set[Key] = set()      # prefetched and not yet used
        self._copy_mark = (0.0, 0.0)

    # --- memory -----------------------------------------------------------------------------------------------
    @property
    def expert_bytes(self) -> int:
        return self.layout.nbytes

    def reserve(self, budget_bytes: int | None = None) -> int:
        """Allocate the slot cache (and stream buffers) within ``budget_bytes`` and warm it; returns ``N``.
        Called by the boot (engine/boot.py) once the weights and KV pool are placed; otherwise on the first run with
        no budget. Re-reserving drops the cache first."""
        self._drop_device_memory()
        n = self.plan_slots(budget_bytes)
        self.slots.allocate(n, self.block_slots)
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

    def _drop_device_memory(self) -> None:
        self.copier.synchronize()
        self.slots.clear()
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

    # --- hooks of a device-table decode path (experts/table_decode.py) -----------------------------------------
    def table_bytes(self) -> int:
        """Device bytes of the device-side expert table, set aside before the slots are sized (0: none)."""
        return 0

    def _init_table(self) -> None:
        """Build the device-side expert table after a reserve (none here)."""

    def _cache_changed(self) -> None:
        """The slot cache changed outside a device table's own planning (nothing to mark here)."""

    def settle_device(self) -> None:
        """Bring the host cache in step with installs the device made inside steps (none here)."""

    def _table_serves(self, num_tokens: int) -> bool:
        """A step of ``num_tokens`` tokens runs from the device table (never here)."""
        return False

    def _run_table(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # --- wiring -----------------------------------------------------------------------------------------------
    def use_routers(self, routers: Mapping[int, Router]) -> None:
        self._routers = dict(routers)

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
        routers were handed over (``use_routers``), and the step has at most ``prefetch_max_tokens`` tokens."""
        return self.prefetch and bool(self._routers) and num_tokens <= self.options.prefetch_max_tokens

    @property
    def stage_layout(self):
        """See :meth:`ExpertExecutor.stage_layout`: the slot rows' layout for backends that stage."""
        return self.layout if self.stages else None

    def run(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
            ids_and_predicted: torch.Tensor | None = None, stage=None) -> torch.Tensor | None:
        """See :meth:`ExpertExecutor.run` (backends with ``stages``: a small step's experts, once resident, are
        stacked into ``stage.rows`` instead of computed). Raises KeyError for a layer without experts."""
        if layer_idx not in self.banks:
            raise KeyError(f"layer {layer_idx} has no routed experts (MoE layers: {list(self.banks.layers)})")
        if self.cache is None:
            self.reserve(None)
        t = hidden.shape[0]
        if self._table_serves(t):
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
        self._cache_changed()  # admissions outside a device table's planning
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
                self.copier.copy(self.slots.row(slot), self.banks.row(layer, e),
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
        where = [self.slots.locate(slot) for _, slot in items]  # (block, row in block)
        blocks = {blk for blk, _ in where}
        experts = [e for e, _ in items]
        if work.can_stage(experts):  # the caller's graph computes them from the stage
            torch.stack([self.slots.row(slot) for _, slot in items], out=work.stage.rows[:len(items)])
            work.stage_into(experts)
        elif len(blocks) == 1:
            work.compute(experts, self.slots.views[blocks.pop()], [r for _, r in where])
        elif work.batched:  # one batched call across blocks (as the resident backend computes the layer)
            rows = torch.stack([self.slots.row(slot) for _, slot in items])
            work.compute(experts, self.layout.layer_views(rows), None)
        else:  # one GEMM chain per expert, straight from its slot (no gather)
            views = [(self.slots.views[blk], r) for blk, r in where]
            work.compute_each(experts, [(v.gate[r], v.up[r], v.down[r]) for v, r in views])
        self._release_slots(work, items)

    def _release_slots(self, work: LayerWork, items: list[tuple[int, int]]):
        """After the compute that read ``(expert, slot)`` items: record its fence for each slot (a later copy into
        the slot waits for it) and unpin the experts. Returns the fence (None: nothing to wait for)."""
        fence = self.copier.compute_fence()
        for e, slot in items:
            if fence is not None:
                self._last_use[slot] = fence
            self.cache.unpin((work.layer, e))
        return fence

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
        math = self._host_math.get(work.layer)  # host copies: the CPU computes these experts
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

    def stats(self) -> ExpertReport:
        """See :meth:`ExpertExecutor.stats`: counters, per-layer hits and misses, and the cache's shape. Copy
        timings lag by up to one step (:meth:`sync_stats`)."""
        cache = self.cache
        report = self.counters.snapshot(self.name, cache.hits if cache else {}, cache.misses if cache else {},
                                        num_slots=cache.num_slots if cache else 0)
        report.cache = SlotCacheReport(
            expert_bytes=self.layout.nbytes, slot_blocks=len(self.slots.blocks), slot_bytes=self.slot_storage_bytes(),
            pinned=self.banks.pinned, prefetch=self.prefetch, cpu_threads=self.cpu_pool.threads if self.cpu_pool else 0,
            cpu_kernel=self.cpu_pool.kernel_name if self.cpu_pool else None)
        return report
