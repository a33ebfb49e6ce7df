"""Bookkeeping of the device slot cache: which ``(layer, expert)`` sits in which of ``N`` slots.

The slots themselves (device blocks of a few ``[S]`` rows each, shared by all MoE layers) belong to the
executor; this module only decides. Slot ids are arbitrary non-negative ints (the executor derives them from its
blocks); the set of slots can change between steps (:meth:`SlotCache.add_slots`, :meth:`SlotCache.remove_slots`:
the elastic cache of the OOM guard). Pure Python, no tensors, so the policy is cheap to property-test.

Rules:
  * An expert the current layer still needs is *pinned*; eviction never picks a pinned expert
    (:class:`CacheFull` when every occupied slot is pinned and no slot is free).
  * Among unpinned experts the :class:`EvictionPolicy` picks the victim. :class:`LRUPolicy` is plain least
    recently used over all layers. :class:`LayerLRUPolicy` (the executors' default) is LRU within per-layer fair
    shares, like the per-layer LRU caches of Eliseev & Mazur 2023 ("Fast Inference of Mixture-of-Experts Language
    Models with Offloading", §3.1): layers are visited in a fixed cycle every step, and one global LRU over a cache
    smaller than the per-step working set evicts each expert just before its layer comes round again (hit rate 0
    when routing repeats); with shares, every layer keeps its most recent ``N / L`` experts.
    :class:`LayerLRFUPolicy` keeps the shares and evicts by a decaying use count (an LRU/LFU blend,
    ``--moe-cache-policy layer-lrfu``); :func:`make_policy` maps the flag's names to policies. Hit rates of each
    on routing-model traces: docs/ROUTING.md.
  * :meth:`SlotCache.lookup` counts a hit or a miss for the expert's layer (per-layer counters).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Container, Iterable

Key = tuple[int, int]  # (decoder layer index, expert id)


class CacheFull(RuntimeError):
    """No slot can be given out: every slot holds a pinned expert (or the cache has no slots)."""


class EvictionPolicy(ABC):
    """Orders the cached keys by how cheaply each can go. The cache tells it every insert / use / removal."""

    @abstractmethod
    def insert(self, key: Key) -> None:
        """``key`` entered the cache."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """``key`` was used (a hit)."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """``key`` left the cache."""

    @abstractmethod
    def victim(self, pinned: Container[Key], incoming: Key | None = None) -> Key | None:
        """The key to evict next to make room for ``incoming``, never one in ``pinned``; None when every cached
        key is pinned."""

    @abstractmethod
    def keys(self) -> list[Key]:
        """Every key the policy tracks (for invariant checks)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first. ``insert``/``touch``/``remove`` are O(1); ``victim`` skips pinned keys from
    the old end, O(number of pinned keys) (at most one layer's needs)."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        del self._order[key]

    def victim(self, pinned: Container[Key], incoming: Key | None = None) -> Key | None:
        for key in self._order:
            if key not in pinned:
                return key
        return None

    def keys(self) -> list[Key]:
        return list(self._order)


class LayerLRUPolicy(LRUPolicy):
    """LRU within per-layer shares of ``quota`` slots (see the module docstring).

    Victim for an expert of layer ``l``: the least recently used unpinned expert of layer ``l`` when ``l`` already
    holds ``quota`` or more; else the least recently used unpinned expert of a layer holding more than ``quota``;
    else the global least recently used unpinned expert.

    Args:
        quota: slots per layer, ``max(1, N // num_moe_layers)`` for ``N`` slots.
    """

    def __init__(self, quota: int) -> None:
        super().__init__()
        self.quota = max(1, quota)
        self._layers: dict[int, OrderedDict[Key, None]] = {}

    def insert(self, key: Key) -> None:
        super().insert(key)
        own = self._layers.setdefault(key[0], OrderedDict())
        own[key] = None
        own.move_to_end(key)

    def touch(self, key: Key) -> None:
        super().touch(key)
        self._layers[key[0]].move_to_end(key)

    def remove(self, key: Key) -> None:
        super().remove(key)
        del self._layers[key[0]][key]

    def victim(self, pinned: Container[Key], incoming: Key | None = None) -> Key | None:
        if incoming is not None:
            own = self._layers.get(incoming[0], ())
            if len(own) >= self.quota:
                for key in own:
                    if key not in pinned:
                        return key
        for key in self._order:
            if key not in pinned and len(self._layers[key[0]]) > self.quota:
                return key
        return super().victim(pinned)


class ScoredLayerPolicy(LayerLRUPolicy):
    """:class:`LayerLRUPolicy`'s per-layer shares, with the victim inside the chosen group picked by the lowest
    :meth:`score` instead of the oldest use (ties: the least recently used of a layer; among layers over their
    share, the first layer listed). Subclasses define ``score`` and may hook every use (insert or hit) in
    ``_used``. ``victim`` is O(cached keys of the group)."""

    def _used(self, key: Key) -> None:
        """``key`` was inserted or hit."""

    def score(self, key: Key) -> float:
        """How much ``key`` is worth keeping (lowest goes first)."""
        raise NotImplementedError

    def insert(self, key: Key) -> None:
        super().insert(key)
        self._used(key)

    def touch(self, key: Key) -> None:
        super().touch(key)
        self._used(key)

    def _lowest(self, keys: Iterable[Key]) -> Key | None:
        best, best_score = None, 0.0
        for key in keys:          # oldest first, so a tie keeps the least recently used
            sc = self.score(key)
            if best is None or sc < best_score:
                best, best_score = key, sc
        return best

    def victim(self, pinned: Container[Key], incoming: Key | None = None) -> Key | None:
        if incoming is not None:
            own = self._layers.get(incoming[0], ())
            if len(own) >= self.quota:
                key = self._lowest(k for k in own if k not in pinned)
                if key is not None:
                    return key
        over = [own for own in self._layers.values() if len(own) > self.quota]
        key = self._lowest(k for own in over for k in own if k not in pinned)
        if key is not None:
            return key
        return self._lowest(k for k in self._order if k not in pinned)


class LayerLRFUPolicy(ScoredLayerPolicy):
    """LRU/LFU blend within per-layer shares: LRFU (Lee et al. 2001, "LRFU: A Spectrum of Policies that Subsumes
    the Least Recently Used and Least Frequently Used Policies", IEEE Trans. Computers 50(12)). Each expert has a
    *combined recency and frequency* value ``crf = sum over its uses of 2^(-age / half_life)``, ages counted in
    uses of its own layer (so the half-life means the same at every layer); the lowest ``crf`` goes first. A
    half-life near 0 is LRU, an infinite one LFU. The value outlives an eviction (an expert coming back keeps its
    decayed history). Measured against LRU / LFU on routing-model traces: docs/ROUTING.md.

    Args:
        quota: slots per layer (as :class:`LayerLRUPolicy`).
        half_life: uses of a layer after which an old use counts half (> 0); None: ``half_life_slots * quota``
            (the default ``--moe-cache-policy layer-lrfu``: a use counts half once the layer has seen as many
            uses as it has slots, so the memory scales with the cache).
        half_life_slots: the half-life in units of the quota when ``half_life`` is None (> 0).

    Raises:
        ValueError: a half-life <= 0.
    """

    def __init__(self, quota: int, half_life: float | None = None, half_life_slots: float = 1.0) -> None:
        if not (half_life is None or half_life > 0) or not half_life_slots > 0:
            raise ValueError(f"LRFU half-life must be > 0, got {half_life} / {half_life_slots} x quota")
        super().__init__(quota)
        self.half_life = None if half_life is None else float(half_life)
        self.half_life_slots = float(half_life_slots)
        self._clock: dict[int, int] = {}
        self._crf: dict[Key, tuple[float, int]] = {}   # key -> (crf at its last use, layer clock then)

    @property
    def effective_half_life(self) -> float:
        """The half-life in uses now (it follows the quota when given in slots)."""
        return self.half_life if self.half_life is not None else self.half_life_slots * self.quota

    def _used(self, key: Key) -> None:
        now = self._clock.get(key[0], 0) + 1
        self._clock[key[0]] = now
        crf, last = self._crf.get(key, (0.0, now))
        self._crf[key] = (crf * 2.0 ** (-(now - last) / self.effective_half_life) + 1.0, now)

    def score(self, key: Key) -> float:
        crf, last = self._crf.get(key, (0.0, 0))
        return crf * 2.0 ** (-(self._clock.get(key[0], 0) - last) / self.effective_half_life)


def make_policy(name: str, num_slots: int, num_layers: int) -> EvictionPolicy:
    """The policy of ``--moe-cache-policy name`` (``ferrylm.config.CACHE_POLICIES``) for ``num_slots`` slots
    shared by ``num_layers`` MoE layers: ``layer-lru`` (:class:`LayerLRUPolicy`, the default), ``lru``
    (:class:`LRUPolicy`), ``layer-lrfu`` (:class:`LayerLRFUPolicy`, half-life one quota of uses).

    Raises:
        ValueError: unknown name.
    """
    quota = num_slots // max(1, num_layers)
    if name == "layer-lru":
        return LayerLRUPolicy(quota)
    if name == "lru":
        return LRUPolicy()
    if name == "layer-lrfu":
        return LayerLRFUPolicy(quota)
    raise ValueError(f"unknown expert cache policy {name!r}; policies: layer-lru, lru, layer-lrfu")


class SlotCache:
    """``num_slots`` slots shared by all MoE layers; maps ``(layer, expert)`` to a slot index.

    Args:
        num_slots: ``N >= 0`` (0 is allowed for a backend that never caches, e.g. ``cpu`` with no room).
        policy: eviction order (default :class:`LRUPolicy`).

    Raises:
        ValueError: ``num_slots < 0``.
    """

    def __init__(self, num_slots: int, policy: EvictionPolicy | None = None):
        if num_slots < 0:
            raise ValueError(f"the expert cache needs >= 0 slots, got {num_slots}")
        self.num_slots = num_slots
        self.policy = policy or LRUPolicy()
        self._slot_of: dict[Key, int] = {}
        self._slots: set[int] = set(range(num_slots))               # every slot id that exists now
        self._key_of: dict[int, Key] = {}                            # occupied slot -> key
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._pinned: set[Key] = set()
        self.hits: dict[int, int] = {}
        self.misses: dict[int, int] = {}
        self.evictions = 0

    # --- queries ----------------------------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot_of(self, key: Key) -> int | None:
        """The slot holding ``key`` or None (no counting, no recency update)."""
        return self._slot_of.get(key)

    def placements(self) -> list[tuple[Key, int]]:
        """Every cached ``(key, slot)``, in key order."""
        return sorted(self._slot_of.items())

    def key_of(self, slot: int) -> Key | None:
        """The key in ``slot``, or None (free, or no such slot)."""
        return self._key_of.get(slot)

    @property
    def slot_ids(self) -> frozenset[int]:
        """Every slot id that exists now (``len == num_slots``)."""
        return frozenset(self._slots)

    @property
    def pinned(self) -> frozenset[Key]:
        return frozenset(self._pinned)

    def evictable(self) -> int:
        """Slots that :meth:`admit` can still hand out now: free ones plus those holding unpinned experts."""
        return len(self._free) + len(self._slot_of) - len(self._pinned)

    def lookup(self, key: Key) -> int | None:
        """The slot of ``key`` (a hit: recency updated) or None (a miss). Counts either for ``key[0]``'s layer."""
        slot = self._slot_of.get(key)
        layer = key[0]
        if slot is None:
            self.misses[layer] = self.misses.get(layer, 0) + 1
            return None
        self.hits[layer] = self.hits.get(layer, 0) + 1
        self.policy.touch(key)
        return slot

    # --- changes ----------------------------------------------------------------------------------------------
    def touch(self, key: Key) -> None:
        """Mark ``key`` (cached) as just used without counting a hit (e.g. it was predicted again)."""
        if key in self._slot_of:
            self.policy.touch(key)

    def pin(self, key: Key) -> None:
        """Protect the cached ``key`` from eviction until :meth:`unpin`. Raises KeyError if not cached."""
        if key not in self._slot_of:
            raise KeyError(f"cannot pin {key}: not cached")
        self._pinned.add(key)

    def unpin(self, key: Key) -> None:
        self._pinned.discard(key)

    def unpin_all(self, keys: Iterable[Key] | None = None) -> None:
        """Unpin ``keys`` (default: every pinned key)."""
        if keys is None:
            self._pinned.clear()
        else:
            self._pinned.difference_update(keys)

    def admit(self, key: Key) -> tuple[int, Key | None]:
        """Give ``key`` a slot: a free one, else the policy's unpinned victim's (evicted).

        Returns:
            ``(slot, evicted_key or None)``; the caller then fills the slot. ``key`` is not pinned.

        Raises:
            ValueError: ``key`` is already cached. CacheFull: no free slot and every cached key is pinned.
        """
        if key in self._slot_of:
            raise ValueError(f"{key} is already cached in slot {self._slot_of[key]}")
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = self.policy.victim(self._pinned, key)
            if evicted is None:
                raise CacheFull(f"all {self.num_slots} expert slots hold experts pinned for this step")
            slot = self._slot_of.pop(evicted)
            self.policy.remove(evicted)
            self.evictions += 1
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self.policy.insert(key)
        return slot, evicted

    def place(self, key: Key, slot: int) -> Key | None:
        """Put ``key`` in ``slot`` (an install the device decided): the slot's expert, if any, is evicted.

        Returns:
            the evicted key or None (the slot was free).

        Raises:
            KeyError: no such slot. ValueError: ``key`` is cached already, or the slot's expert is pinned.
        """
        if slot not in self._slots:
            raise KeyError(f"no such slot: {slot}")
        if key in self._slot_of:
            raise ValueError(f"{key} is already cached in slot {self._slot_of[key]}")
        old = self._key_of.get(slot)
        if old is None:
            self._free.remove(slot)
        else:
            if old in self._pinned:
                raise ValueError(f"cannot replace {old}: pinned for this step")
            del self._slot_of[old]
            self.policy.remove(old)
            self.evictions += 1
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self.policy.insert(key)
        return old

    def free_slots(self) -> list[int]:
        """The free slot ids, in the order :meth:`admit` hands them out."""
        return self._free[::-1]

    def evict(self, key: Key) -> int:
        """Drop the unpinned ``key``; return its freed slot. Raises KeyError (not cached) / ValueError (pinned)."""
        if key in self._pinned:
            raise ValueError(f"cannot evict {key}: pinned for this step")
        slot = self._slot_of.pop(key)
        self.policy.remove(key)
        del self._key_of[slot]
        self._free.append(slot)
        return slot

    def add_slots(self, slots: Iterable[int]) -> None:
        """New empty slots (ids not in use) join the free list; the lowest id is handed out first.

        Raises:
            ValueError: an id already exists, is negative, or is listed twice (nothing changes then).
        """
        new = list(slots)
        if len(set(new)) != len(new) or any(s < 0 or s in self._slots for s in new):
            raise ValueError(f"slot ids {new} clash with the existing slots or each other")
        self._slots.update(new)
        self._free.extend(sorted(new, reverse=True))
        self._free.sort(reverse=True)
        self.num_slots += len(new)

    def remove_slots(self, slots: Iterable[int]) -> list[Key]:
        """Take ``slots`` out of the cache; the experts in them are evicted (not counted in ``evictions``).

        Returns:
            the evicted keys.

        Raises:
            KeyError: an id is not a slot. ValueError: a slot holds a pinned expert (nothing changes then).
        """
        gone = set(slots)
        missing = gone - self._slots
        if missing:
            raise KeyError(f"no such slots: {sorted(missing)}")
        keys = [self._key_of[s] for s in gone if s in self._key_of]
        pinned = [k for k in keys if k in self._pinned]
        if pinned:
            raise ValueError(f"cannot remove slots holding experts pinned for this step: {pinned}")
        for k in keys:
            del self._slot_of[k]
            self.policy.remove(k)
        for s in gone:
            self._key_of.pop(s, None)
        self._free = [s for s in self._free if s not in gone]
        self._slots -= gone
        self.num_slots -= len(gone)
        return keys

    def check(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests; cheap enough for debug runs)."""
        assert len(self._slot_of) + len(self._free) == self.num_slots, "slots lost or double-counted"
        assert len(self._slots) == self.num_slots, "num_slots differs from the slot ids"
        assert len(set(self._free)) == len(self._free), "a free slot listed twice"
        assert set(self._free) | set(self._slot_of.values()) == self._slots, "a slot id is unknown or lost"
        assert set(self._key_of) == set(self._slot_of.values()), "occupied slots disagree"
        for key, slot in self._slot_of.items():
            assert self._key_of[slot] == key, f"slot {slot} maps back to {self._key_of[slot]}, not {key}"
            assert slot not in self._free, f"slot {slot} is both free and holds {key}"
        assert set(self.policy.keys()) == set(self._slot_of), "policy and cache disagree on the cached keys"
        assert self._pinned <= set(self._slot_of), "a pinned key is not cached"
