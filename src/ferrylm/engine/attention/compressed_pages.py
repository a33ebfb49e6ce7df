"""DeepSeek-V4's caches in the paged KV pool: :class:`~ferrylm.models.compressed_attention.SequenceState` over one
sequence's slots.

Per layer a token keeps its window row ``[1, D]`` in the pool's ``k`` (``KVLayout(k_heads=1, k_dim=D,
v_heads=0)``, as MLA's latent rows); a compressing layer keeps per block of ``m`` tokens (``BlockSpec``) its entry
(``compressor`` ``[D]``, ``indexer`` ``[Di]``, the model dtype) and the pools after the last token written in that
block (``compressor_carry`` / ``indexer_carry``: ``lse [2, D]`` then ``val [2, D]``, float32). Block ``w``'s row is
``slot(w m) // m``: on the page of its tokens, so a full page holds only finished blocks and is shared by the
prefix cache like any page, and a sequence resumed at a block boundary reads the pools it needs from the row of
the block before.
"""

from __future__ import annotations

import torch

from ferrylm.engine.cache.kv_pool import KVPool
from ferrylm.models.compressed_attention import Carry


class PagedSequenceState:
    """One sequence's rows of one layer in ``pool``; ``slots [L]`` int64 the cache slots of its positions
    ``0 .. L - 1`` (every position this step reads or writes). ``rates``: name -> the layer's block rate."""

    def __init__(self, pool: KVPool, layer: int, slots: torch.Tensor, rates: dict[str, int]):
        self.pool, self.layer, self.slots, self.rates = pool, layer, slots, rates

    def write_window(self, start: int, rows: torch.Tensor) -> None:
        self.pool.store(self.layer, self.slots[start:start + rows.shape[0]], rows[:, None, :])

    def window_rows(self, lo: int, hi: int) -> torch.Tensor:
        return self.pool.keys(self.layer, self.slots[lo:hi], self.pool.dtype)[:, 0]

    def _rows(self, name: str, blocks: torch.Tensor) -> torch.Tensor:
        """Row indices of the blocks ``blocks`` of the layer's ``name`` cache."""
        m = self.rates[name]
        return self.slots[blocks * m] // m

    def carry(self, name: str, start: int, dim: int) -> Carry:
        if start == 0:
            return Carry.empty(dim, self.slots.device)
        row = self._rows(name, torch.tensor([(start - 1) // self.rates[name]], device=self.slots.device))
        t = self.pool.blocks[(self.layer, f"{name}_carry")][row[0]].view(2, 2, dim)
        return Carry(t[0].clone(), t[1].clone())

    def write_entries(self, name: str, first: int, entries: torch.Tensor, end: int, carry: Carry) -> None:
        dev = self.slots.device
        if entries.shape[0]:
            rows = self._rows(name, torch.arange(first, first + entries.shape[0], device=dev))
            self.pool.blocks[(self.layer, name)].index_copy_(0, rows, entries.to(self.pool.blocks[(self.layer,
                                                                                                  name)].dtype))
        row = self._rows(name, torch.tensor([(end - 1) // self.rates[name]], device=dev))
        self.pool.blocks[(self.layer, f"{name}_carry")][row[0]] = torch.stack((carry.lse, carry.val)).flatten()

    def entries(self, name: str, count: int) -> torch.Tensor:
        rows = self._rows(name, torch.arange(count, device=self.slots.device))
        return self.pool.blocks[(self.layer, name)][rows]
