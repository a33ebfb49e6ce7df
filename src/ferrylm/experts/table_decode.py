"""The offload backend's device expert table path (``experts/slot_table.py`` has the protocol): decode steps of up
to ``TABLE_MAX_TOKENS`` tokens run one fused MoE launch per layer from the table, hits and misses alike, with every
host decision made between steps (:meth:`TableDecode.begin_step`), so the whole step is one CUDA graph.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ferrylm.experts.cache import Key
from ferrylm.experts.slot_table import FREQ_DECAY, SlotTable
from ferrylm.triton_util import triton_available

log = logging.getLogger("ferrylm.experts")


# NOTE: decode steps (and chunks) of at most this many tokens run from the device table; each needed expert is read
# about once per launch up to here (one 16- or 64-row block per expert), so the kernel moves the bytes streaming
# would, with no host decision inside the step
TABLE_MAX_TOKENS = 256
TABLE_MIN_TOKENS_PLAIN = 2  # bf16/fp16 experts: one-token steps keep the host-planned path (see graph_min_tokens)
ADMIT_MIN_USES = 1.0  # a missed expert is installed only if its decayed use count before this step was at least this
INSTALL_FRACTION = 8  # at most max(1, used // this) installs per layer and step (bounds churn under uniform routing)


class TableDecode:
    """The offload backend's graph-safe path (``experts/slot_table.py`` has the protocol): mixed into
    :class:`~ferrylm.experts.offload.OffloadExecutor`, which is a :class:`~ferrylm.experts.cached.CachedExecutor`.

    Attributes:
        table: the :class:`SlotTable` (None until a reserve, or when the table cannot run here).
    """

    #: run the table path on the CPU too (tests, through Triton's interpreter)
    table_on_cpu = False
    table: SlotTable | None = None
    _table_stale = False  # the cache changed outside the table's bookkeeping: rebuild before the next table step

    @property
    def graph_safe(self) -> bool:
        """Decode steps of at least :attr:`graph_min_tokens` sequences make no host decision inside the step (the
        table path): each is one CUDA graph. Smaller ones take the host-planned path (piecewise graphs)."""
        return self.table is not None and self.device.type == "cuda"

    @property
    def graph_min_tokens(self) -> int:
        """The smallest step run from the table: 1 for quantized experts; 2 for plain ones, whose one-token steps
        keep the host-planned path with next-layer prefetch by DMA (faster there; docs/BENCHMARKS.md). ``table_on_cpu``
        (tests) runs every size from the table."""
        if self.table_on_cpu or self.layout.quant is not None:
            return 1
        return TABLE_MIN_TOKENS_PLAIN

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
        ``[L, E]`` int64 table and the ``[256, L, k <= 32]`` int64 routing buffer (an upper bound); 0 when the table
        cannot run here."""
        if self._table_possible() is not None:
            return 0
        layers = len(self.banks.layers)
        return self.layout.nbytes + layers * self.num_experts * 8 + TABLE_MAX_TOKENS * layers * 32 * 8

    def table_step(self, num_tokens: int) -> bool:
        """A step of ``num_tokens`` tokens runs from the device table (one fused launch per layer, no host decision
        inside the step); otherwise the host-planned or streamed paths. (A graph replay of such a step counts
        nothing: :meth:`begin_step` opened its counters.)"""
        table = self.table
        return table is not None and self.graph_min_tokens <= num_tokens <= table.max_tokens

    def _table_serves(self, num_tokens: int) -> bool:
        return self.table_step(num_tokens)

    def _cache_changed(self) -> None:
        self._table_stale = True

    def slot_offsets(self) -> dict[Key, int]:
        """``(layer, expert) -> byte offset`` of every cached expert's slot row from the table's reference row."""
        ref = self.table.ref.data_ptr()
        return {key: self.slots.row(slot).data_ptr() - ref for key, slot in self.cache._slot_of.items()}

    def _drop_device_memory(self) -> None:
        super()._drop_device_memory()
        self.table = None

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
        self.table.reset(self.slot_offsets())
        self._table_stale = False
        self.table.publish(self.copier, {})

    def _run_table(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
        """One layer of a table step: the fused kernel over the layer's row offsets (hits from slots, misses read
        from the host banks by the kernel). No host decision, no sync: capturable."""
        from ferrylm.experts.kernels.fused_moe import fused_moe

        table = self.table
        i, offsets = table.layer_inputs(layer_idx)
        table.record(i, topk_ids)
        v = table.views
        return fused_moe(hidden, v.gate, v.up, v.down, topk_ids, topk_weights, row_offset=offsets,
                         math=self.math.get(layer_idx))

    def begin_step(self, num_tokens: int) -> None:
        """Between steps, before a step of ``num_tokens`` tokens is launched (the model runner calls it for every
        step): read the previous table step's routing, count its hits and misses, install the experts worth a slot,
        publish the table; open the new step's counters when it runs from the table. Host work only."""
        table = self.table
        if table is None or self.cache is None:
            return
        if self._table_stale:
            table.reset(self.slot_offsets())
            self._table_stale = False
        installs: dict[int, list] = {}
        ids = table.take_routing()
        if ids is not None:
            self._observe(np.clip(ids, 0, self.num_experts - 1), installs)
        if self.table_step(num_tokens):
            self._fold_copy_times()
            self.counters.open_step(num_tokens)
            table.recorded = num_tokens
        table.publish(self.copier, installs)
        if installs:
            fence = self.copier.fence()
            for items in installs.values():
                for slot, *_ in items:
                    self._ready[slot] = fence  # the host-planned and streamed paths wait for it

    def _observe(self, ids: np.ndarray, installs: dict[int, list]) -> None:
        """Count a finished table step (``ids [T, L, k]``) and choose its installs: per layer, the missed experts
        with the highest recent use count, at most ``max(1, used // INSTALL_FRACTION)``, each only if it was used
        at least ``ADMIT_MIN_USES`` times recently (decayed) and more than the layer-LRU victim it would replace
        (TinyLFU's admission, Einziger et al. 2017); free slots take any miss."""
        table, cache = self.table, self.cache
        prior = table.freq * np.float32(FREQ_DECAY)  # aged, this step's uses not yet counted
        table.decay(ids)
        freq = table.freq
        step = self.counters.step
        per = self.layout.nbytes
        ref = table.ref.data_ptr()
        for i, layer in enumerate(table.layers):
            used = np.unique(ids[:, i, :]).tolist()
            misses = [e for e in used if cache.lookup((layer, e)) is None]
            step.needed += len(used)
            step.hits += len(used) - len(misses)
            step.misses += len(misses)
            step.mapped += len(misses)
            step.bytes_mapped += len(misses) * per
            budget = max(1, len(used) // INSTALL_FRACTION)
            for e in sorted(misses, key=lambda e: -prior[i, e]):
                if budget == 0:
                    break
                key = (layer, e)
                if cache.num_slots - len(cache) <= 0:  # no free slot: admission against the victim
                    if prior[i, e] < ADMIT_MIN_USES:
                        break
                    victim = cache.policy.victim(cache.pinned, key)
                    if victim is None or freq[table.index[victim[0]], victim[1]] >= freq[i, e]:
                        continue
                slot, evicted = cache.admit(key)
                if evicted is not None:
                    table.set_home(*evicted)
                    if evicted in self._prefetched:
                        self._prefetched.discard(evicted)
                row = self.slots.row(slot)
                table.set_slot(layer, e, row.data_ptr() - ref)
                installs.setdefault(layer, []).append((slot, row, self.banks.row(layer, e),
                                                       self._last_use.pop(slot, None)))
                step.fetched += 1
                step.bytes_copied += per
                budget -= 1
