"""The offload backend's device expert table path (``experts/slot_table.py`` has the protocol): decode steps of up
to ``TABLE_MAX_TOKENS`` tokens run one fused MoE launch per layer from the table, hits and misses alike; the misses
are installed in the layer's slot pool by the GPU inside the step (``experts/device_pools.py``), so the whole step is
one CUDA graph and the host only keeps its books between steps (:meth:`TableDecode.begin_step`). Table steps do
not prefetch the next layer's experts: measured against installing each layer's misses on demand, it lost
(docs/BENCHMARKS.md, session 21).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferrylm.experts.cache import Key
from ferrylm.experts.slot_table import SlotTable
from ferrylm.triton_util import triton_available

if TYPE_CHECKING:  # device_pools imports Triton, which a CPU-only install lacks: loaded once the table can run
    from ferrylm.experts.device_pools import DevicePools, PoolPlan

log = logging.getLogger("ferrylm.experts")


# NOTE: decode steps (and chunks) of at most this many tokens run from the device table; each needed expert is read
# about once per launch up to here (one 16- or 64-row block per expert), so the kernel moves the bytes streaming
# would, with no host decision inside the step
TABLE_MAX_TOKENS = 256


class TableDecode:
    """The offload backend's graph-safe path (``experts/slot_table.py`` has the protocol): mixed into
    :class:`~ferrylm.experts.offload.OffloadExecutor`, which is a :class:`~ferrylm.experts.cached.CachedExecutor`.

    Attributes:
        table: the :class:`SlotTable` (None until a reserve, or when the table cannot run here).
    """

    #: run the table path on the CPU too (tests, through Triton's interpreter)
    table_on_cpu = False
    table: SlotTable | None = None
    pools: "DevicePools | None" = None
    _device_moved = False  # a table step ran since the host last read the device's installs
    _table_stale = False  # the cache changed outside the table's bookkeeping: rebuild before the next table step

    @property
    def graph_safe(self) -> bool:
        """Decode steps make no host decision inside the step (the table path): each is one CUDA graph."""
        return self.table is not None and self.device.type == "cuda"

    def _table_possible(self) -> str | None:
        """None when the table path can run here, else why not."""
        if not self.options.decode_table:
            return "the device table is off (decode_table=False)"
        if self.device.type != "cuda":
            return None if self.table_on_cpu and triton_available() else "not on a CUDA device"
        if not triton_available():
            return "Triton is not importable"
        if not self.banks.pinned:
            return "the expert banks are not page-locked (the kernel reads misses from mapped host memory)"
        return None

    def table_bytes(self) -> int:
        """Device bytes the table path holds besides the slots (bytes): its reference row (one expert row), the
        ``[L, E + 1]`` int64 table and the pools' five rows like it, the ``[256, L, k <= 32]`` int64 routing buffer
        (an upper bound); 0 when the table cannot run here."""
        if self._table_possible() is not None:
            return 0
        layers = len(self.banks.layers)
        return self.layout.nbytes + 6 * layers * (self.num_experts + 1) * 8 + TABLE_MAX_TOKENS * layers * 32 * 8

    def table_step(self, num_tokens: int) -> bool:
        """A step of ``num_tokens`` tokens runs from the device table (one fused launch per layer, no host decision
        inside the step); otherwise the host-planned or streamed paths. (A graph replay of such a step counts
        nothing: :meth:`begin_step` opened its counters.)"""
        table = self.table
        return table is not None and 1 <= num_tokens <= table.max_tokens

    def _table_serves(self, num_tokens: int) -> bool:
        return self.table_step(num_tokens)

    def _cache_changed(self) -> None:
        self._table_stale = True

    def slot_offsets(self) -> dict[Key, int]:
        """``(layer, expert) -> byte offset`` of every cached expert's slot row from the table's reference row."""
        ref = self.table.ref.data_ptr()
        return {key: self.slots.row(slot).data_ptr() - ref for key, slot in self.cache.placements()}

    def _drop_device_memory(self) -> None:
        super()._drop_device_memory()
        self.table = self.pools = None
        self._device_moved = False

    def _init_table(self) -> None:
        why = self._table_possible()
        if why is not None:
            log.info("%s experts: decode steps planned on the host (%s)", self.name, why)
            return
        try:
            self.table = SlotTable(self.banks.packed, self.layout, self.device, TABLE_MAX_TOKENS)
        except RuntimeError as e:
            log.warning("%s experts: decode steps planned on the host (%s)", self.name, e)
            return
        from ferrylm.experts.device_pools import DevicePools
        from ferrylm.experts.kernels.installs import demand_programs

        t = self.table
        self.pools = DevicePools(t.table, t.home, t.ref, self.layout.nbytes)
        self._programs = demand_programs(self.device)
        self._reset_table()

    def _reset_table(self) -> None:
        """Rebuild the table and the device pools from the host cache; the copies host paths queued finish before
        the next step reads the slots."""
        table, ref = self.table, self.table.ref.data_ptr()
        table.reset(self.slot_offsets())
        self.pools.reset(self._pool_plan(), lambda slot: self.slots.row(slot).data_ptr() - ref)
        self.copier.wait(self.copier.fence())
        table.publish()
        self._table_stale = False

    def _pool_plan(self) -> "PoolPlan":
        """Each MoE layer's pool: the slots holding its experts, then free slots, fewest first, up to its fair share
        (``N // L``, at most ``E``), then the rest round-robin up to ``E``."""
        cache, table = self.cache, self.table
        members: list[list] = [[] for _ in table.layers]
        for (layer, e), slot in cache.placements():
            members[table.index[layer]].append((slot, e))
        free = cache.free_slots()[::-1]
        e_max = self.num_experts
        quota = min(e_max, cache.num_slots // max(1, len(members)))
        for target in (quota, e_max):
            progress = True
            while free and progress:
                progress = False
                for row in sorted(members, key=len):
                    if free and len(row) < target:
                        row.append((free.pop(), None))
                        progress = True
        from ferrylm.experts.device_pools import PoolPlan

        return PoolPlan(members)

    def _run_table(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
        """One layer of a table step: the layer's installs, then the fused kernel over the layer's row offsets. No
        host decision, no sync: capturable."""
        from ferrylm.experts.kernels.fused_moe import fused_moe

        table, pools = self.table, self.pools
        i, offsets = table.layer_inputs(layer_idx)
        self._device_moved = True  # eager runs (warmups) install too; graph replays are marked by begin_step
        pools.install(i, topk_ids, self._programs)
        table.record(i, topk_ids)
        v = table.views
        return fused_moe(hidden, v.gate, v.up, v.down, topk_ids, topk_weights, row_offset=offsets,
                         math=self.math.get(layer_idx))

    def begin_step(self, num_tokens: int) -> None:
        """Between steps, before a step of ``num_tokens`` tokens is launched (the model runner calls it for every
        step): count the previous table step's hits and misses from its routing, bring the host cache in step with
        the device's installs, rebuild the table when a host path changed the cache, open the new step's counters
        when it runs from the table. Host work and one small device->host read."""
        table = self.table
        if table is None or self.cache is None:
            return
        routing = table.take_routing()
        changes = self.pools.changes() if self._device_moved else []
        if routing is not None:
            self._count(np.clip(routing, 0, self.num_experts - 1), changes)
        self._apply(changes)
        self._device_moved = False
        if self._table_stale:
            self._reset_table()
        if self.table_step(num_tokens):
            self._fold_copy_times()
            self.counters.open_step(num_tokens)
            table.recorded = num_tokens
            self._device_moved = True

    def settle_device(self) -> None:
        """Bring the host cache in step with the device's installs now (before a host path changes the cache
        between steps: a shrink after a failed step, say)."""
        if self._device_moved and self.pools is not None:
            self._apply(self.pools.changes())
            self._device_moved = False

    def _count(self, ids: np.ndarray, changes: list[tuple[int, int, int, int]]) -> None:
        """Count a finished table step (``ids [T, L, k]``) against the cache as it was before the step. A needed
        expert not resident then is a miss, read from its slot when the step installed it and from its mapped bank
        row otherwise; every install is a fetched expert."""
        cache, step, per = self.cache, self.counters.step, self.layout.nbytes
        installed: list[set[int]] = [set() for _ in self.table.layers]
        for i, _, _, new in changes:
            installed[i].add(new)
        for i, layer in enumerate(self.table.layers):
            used = set(np.unique(ids[:, i, :]).tolist())
            misses = {e for e in used if cache.slot_of((layer, e)) is None}
            mapped = len(misses - installed[i])
            step.needed += len(used)
            step.hits += len(used) - len(misses)
            step.misses += len(misses)
            step.mapped += mapped
            step.bytes_mapped += mapped * per
            step.fetched += len(installed[i])
            step.bytes_copied += len(installed[i]) * per

    def _apply(self, changes: list[tuple[int, int, int, int]]) -> None:
        """Record the device's installs ``(layer row, slot, old, new)`` in the host cache: every changed slot is
        emptied first, then filled (an expert may have moved between slots over several device steps)."""
        cache = self.cache
        for _, slot, _, _ in changes:
            key = cache.key_of(slot)
            if key is not None:
                cache.evict(key)
                self._prefetched.discard(key)
            self._ready.pop(slot, None)
            self._last_use.pop(slot, None)
        for i, slot, _, new in changes:
            cache.place((self.table.layers[i], new), slot)
