"""The device slot table's installs, decided and done on the GPU inside the step (no host decision, no sync).

Each MoE layer owns a pool of cache slots (its fair share, as :class:`~ferrylm.experts.cache.LayerLRUPolicy` gives
on the host). Before a layer's fused MoE launch, :meth:`DevicePools.install`:

1. marks the experts the layer's tokens need; the resident ones (hits) get the step's stamp;
2. gives each missed expert a slot of the layer's pool, least recently stamped first (an empty slot before any
   occupied one; never one stamped in this step), evicting its expert (whose table entry points back at its host
   bank row);
3. copies the missed rows from the mapped host banks into their slots (the GPU reads host memory over PCIe) and
   points their table entries at the slots.

The fused kernel then reads every needed expert from device memory (a miss with no free victim, when a step needs
more experts than the pool holds, is read from its bank row over PCIe by the kernel itself). Each miss crosses PCIe
once, as with the host-planned path's copies, and becomes a hit for the next step: per-layer LRU, like the host
cache's default policy.

Each layer's work is two kernel launches of fixed shape (:mod:`ferrylm.experts.kernels.installs`), capturable in a
CUDA graph. The host keeps :class:`~ferrylm.experts.cache.SlotCache` in step with the device by
:meth:`DevicePools.changes` between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import triton

from ferrylm.experts.kernels.installs import copy_rows, item_dtype, plan_installs

NEVER = np.iinfo(np.int64).max  # stamp of a pool position with no slot: never a victim
EMPTY = -1                      # stamp of an empty slot: the first victim


@dataclass(frozen=True)
class PoolPlan:
    """Slots per MoE layer row: ``members[i] = [(slot id, expert or None), ...]`` (at most ``E`` entries)."""

    members: list[list[tuple[int, int | None]]]


class DevicePools:
    """Pools, stamps and owners on the device for the table ``table [L, E + 1]`` (module docstring).

    Args:
        table: ``[L, E + 1]`` int64 device tensor of byte offsets from ``base`` (the :class:`SlotTable`'s); column
            ``E`` is scratch.
        home: ``[L, E]`` int64 numpy: each expert's bank row offset.
        base: the table's reference row (a device tensor).
        row_bytes: bytes of one expert row.
    """

    def __init__(self, table: torch.Tensor, home: np.ndarray, base: torch.Tensor, row_bytes: int):
        self.device = table.device
        self.num_layers, self.num_experts = home.shape
        e1 = self.num_experts + 1
        dev = self.device
        self.table = table
        home_ext = np.zeros((self.num_layers, e1), dtype=np.int64)
        home_ext[:, :-1] = home
        self.home = torch.from_numpy(home_ext).to(dev)
        self.row_bytes = int(row_bytes)
        self.base = base
        self.slot_off = torch.zeros(self.num_layers, e1, dtype=torch.int64, device=dev)
        self.owner = torch.full((self.num_layers, e1), -1, dtype=torch.int64, device=dev)
        self.stamp = torch.full((self.num_layers, e1), NEVER, dtype=torch.int64, device=dev)
        self.pos_of = torch.full((self.num_layers, e1), -1, dtype=torch.int64, device=dev)
        self.now = torch.zeros(1, dtype=torch.int64, device=dev)
        self.sel = torch.empty(self.num_layers, self.num_experts, dtype=torch.int64, device=dev)
        self.count = torch.zeros(self.num_layers, 1, dtype=torch.int64, device=dev)
        self.scratch = torch.zeros(self.num_layers, 2, triton.next_power_of_2(e1), dtype=torch.int64, device=dev)
        self._rows = [dict(pos=self.pos_of[i], stamp=self.stamp[i], owner=self.owner[i], off=self.slot_off[i],
                           table=table[i], home=self.home[i]) for i in range(self.num_layers)]
        self.slot_ids = np.full((self.num_layers, self.num_experts), -1, dtype=np.int64)
        self.owners = np.full((self.num_layers, self.num_experts), -1, dtype=np.int64)  # host view, last settled
        # the base row seen as the copy's items, fixed for the table's life (captured graphs keep the launch):
        # slot rows are whole rows into allocator blocks, so the bank rows' alignment holds for them too
        self._items = base.view(-1).view(item_dtype(self.row_bytes, base.data_ptr(), home.ravel()))

    def reset(self, plan: PoolPlan, slot_offset: Callable[[int], int]) -> None:
        """Load the pools (``slot_offset(slot)``: byte offset of a slot row from ``base``). Stamps restart: occupied
        slots 0, empty ones first victims. The table itself is the caller's (it already points at the slots).

        Raises:
            ValueError: a slot row is not aligned to the copy's item size (fixed at construction).
        """
        e1 = self.num_experts + 1
        slot_off = np.zeros((self.num_layers, e1), dtype=np.int64)
        owner = np.full((self.num_layers, e1), -1, dtype=np.int64)
        stamp = np.full((self.num_layers, e1), NEVER, dtype=np.int64)
        pos_of = np.full((self.num_layers, e1), -1, dtype=np.int64)
        self.slot_ids[:] = -1
        for i, members in enumerate(plan.members):
            for p, (slot, e) in enumerate(members[:self.num_experts]):
                self.slot_ids[i, p] = slot
                slot_off[i, p] = slot_offset(slot)
                if e is None:
                    stamp[i, p] = EMPTY
                else:
                    owner[i, p], stamp[i, p], pos_of[i, e] = e, 0, p
        for dst, src in ((self.slot_off, slot_off), (self.owner, owner), (self.stamp, stamp), (self.pos_of, pos_of)):
            dst.copy_(torch.from_numpy(src))
        self.now.zero_()
        self.owners[:] = owner[:, :-1]
        item = self._items.element_size()
        if np.any(slot_off[:, :-1][self.slot_ids >= 0] % item):
            raise ValueError(f"a slot row is not aligned to {item} bytes (the install copy's item)")

    def install(self, i: int, topk_ids: torch.Tensor, programs: int) -> None:
        """Layer row ``i``'s installs for the routed (or predicted) ids ``topk_ids [T, k]`` (module docstring): two
        kernels on the current stream, no host sync; the copy on a persistent grid of ``programs``. The first row
        opens the step's stamp."""
        t, k = topk_ids.shape
        sel = self.sel[i, :min(t * k, self.num_experts)]
        plan_installs(topk_ids, self._rows[i], self.now, self.scratch[i], sel, self.count[i], bump=i == 0)
        copy_rows(self._items, sel, self.count[i], self.home[i], self.table[i], self.row_bytes, programs)

    def changes(self) -> list[tuple[int, int, int, int]]:
        """Read the device's owners back (a small device->host copy: call between steps) and return what the
        steps since the last call changed: ``(layer row, slot, old expert or -1, new expert)``."""
        owner = self.owner[:, :-1].cpu().numpy()
        rows, cols = np.nonzero(owner != self.owners)
        out = [(int(i), int(self.slot_ids[i, p]), int(self.owners[i, p]), int(owner[i, p]))
               for i, p in zip(rows.tolist(), cols.tolist())]
        self.owners[:] = owner
        return out
