"""Prefix caching for hybrid models: snapshots of the recurrent state at named page boundaries.

A cached KV prefix of a model with linear-attention layers is only usable with the recurrent state of the sequence
right after that prefix (the KV pages alone give the full-attention layers their past; the linear layers keep none).
As in SGLang's cache for Mamba-style layers, the engine keeps copies of request states taken where a step ends on
a page boundary, keyed by the name of the page that ends there (``engine/cache/prefix_cache.py``: the name covers every
token up to the boundary, so equal names mean equal states). Admission maps the longest run of cached pages whose
last page has a snapshot and copies that snapshot into the request's state slot; the request continues from there.

- Saves: after every successful step, each sequence whose computed tokens now end on a page boundary
  (:meth:`StateSnapshots.save`, called by the engine): one device copy per linear layer and tensor. For the last
  full page of a prompt to be such a boundary, the scheduler ends prefill chunks on page boundaries (the prompt's
  final partial page then runs as a chunk of its own, one step later).
- Turn points: also at the end of each prompt and at the end of what a finished request computed (the end of an
  agent turn), named by the prefix cache's tail name when the point is inside a page (``point_name``): a turn re-sent
  with its history resumes there, and one whose template drops the earlier answer's reasoning resumes at the
  previous prompt's end.
- Capacity: ``capacity`` snapshots (the memory plan counts them beside the state slots). A new one evicts the least
  recently used page-boundary snapshot, or, when all are turn points, the least recently used turn point; a
  snapshot outlives its pages' names harmlessly (a lookup needs the pages too).
- The store lives in the engine process (a restart starts empty); the warmup runs with the prefix cache off.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ferrylm.engine.cache.state_pool import StatePool


class StateSnapshots:
    """``capacity`` copies of state slots, named by page names (module docstring).

    Memory: ``capacity * pool.layout.bytes_per_slot(dtype)`` bytes.

    Raises:
        ValueError: ``capacity < 1``.
    """

    def __init__(self, pool: StatePool, capacity: int):
        if capacity < 1:
            raise ValueError(f"the snapshot store needs at least one entry, got {capacity}")
        self.pool = pool
        self.capacity = capacity
        self.entries = [torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
                        for t in pool.tensors()]   # parallel to pool.tensors()
        self._by_name: OrderedDict[bytes, int] = OrderedDict()   # LRU: least recently used first
        self._turns: set[bytes] = set()                           # names of turn points (evicted last)
        self._free = list(range(capacity - 1, -1, -1))
        self.saves = 0
        self.restores = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._by_name)

    def has(self, name: bytes) -> bool:
        return name in self._by_name

    def usable(self, names: list[bytes], num_pages: int) -> int:
        """The most leading pages (``<= num_pages``) of a run named ``names`` whose last page has a snapshot
        (0: none)."""
        for j in range(min(num_pages, len(names)), 0, -1):
            if names[j - 1] in self._by_name:
                return j
        return 0

    def save(self, name: bytes, slot: int, *, turn: bool = False) -> None:
        """Copy state slot ``slot`` (the state right after the point named ``name``) into the store (a name stored
        already is only marked used: its state is the same). ``turn``: a turn point, evicted after every page
        boundary."""
        if turn:
            self._turns.add(name)
        if name in self._by_name:
            self._by_name.move_to_end(name)
            return
        idx = self._free.pop() if self._free else self._evict()
        for entry, t in zip(self.entries, self.pool.tensors()):
            entry[idx].copy_(t[slot])
        self._by_name[name] = idx
        self.saves += 1

    def _evict(self) -> int:
        """Drop the least recently used page-boundary snapshot (else turn point); return its entry."""
        victim = next((n for n in self._by_name if n not in self._turns), next(iter(self._by_name)))
        self._turns.discard(victim)
        self.evictions += 1
        return self._by_name.pop(victim)

    def restore(self, name: bytes, slot: int) -> None:
        """Copy the snapshot ``name`` into state slot ``slot``. Raises KeyError when it is not stored."""
        idx = self._by_name[name]
        self._by_name.move_to_end(name)
        for entry, t in zip(self.entries, self.pool.tensors()):
            t[slot].copy_(entry[idx])
        self.restores += 1

    def check(self) -> None:
        """Assert: names and entries one to one, stored + free = capacity. Raises AssertionError."""
        held = list(self._by_name.values())
        assert len(set(held)) == len(held), "a snapshot entry holds two names"
        assert not set(held) & set(self._free), "a snapshot entry is both stored and free"
        assert len(held) + len(self._free) == self.capacity, "snapshot entries leaked"
        assert self._turns <= self._by_name.keys(), "a turn point without a snapshot"

    def stats(self) -> dict:
        return {"stored": len(self._by_name), "turn_points": len(self._turns), "capacity": self.capacity, "saves": self.saves,
                "restores": self.restores, "evictions": self.evictions}
