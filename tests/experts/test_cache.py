"""The slot cache: LRU order, pins, counters; a hypothesis property test drives it the way the executors do."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.experts.cache import CacheFull, LayerLRUPolicy, LRUPolicy, SlotCache


def test_lru_evicts_least_recently_used_unpinned():
    c = SlotCache(3)
    for e in range(3):
        c.admit((0, e))
    assert c.lookup((0, 0)) is not None  # 0 is now the most recent; 1 the oldest
    c.pin((0, 1))
    slot, evicted = c.admit((1, 7))
    assert evicted == (0, 2) and c.slot_of((1, 7)) == slot
    c.unpin_all()
    assert c.admit((1, 8))[1] == (0, 1)
    assert c.hits == {0: 1} and c.misses == {}
    assert c.lookup((5, 5)) is None and c.misses == {5: 1}
    c.check()


def test_all_pinned_raises_and_pinned_cannot_be_evicted():
    c = SlotCache(2)
    c.admit((0, 0))
    c.admit((0, 1))
    c.pin((0, 0))
    c.pin((0, 1))
    assert c.evictable() == 0
    with pytest.raises(CacheFull):
        c.admit((0, 2))
    with pytest.raises(ValueError, match="pinned"):
        c.evict((0, 0))
    with pytest.raises(ValueError, match="already cached"):
        c.admit((0, 1))
    with pytest.raises(KeyError):
        c.pin((3, 3))
    c.unpin((0, 1))
    assert c.evict((0, 1)) in (0, 1) and c.evictable() == 1
    c.check()


def test_zero_slots():
    c = SlotCache(0)
    assert c.evictable() == 0 and c.lookup((0, 0)) is None
    with pytest.raises(CacheFull):
        c.admit((0, 0))
    with pytest.raises(ValueError):
        SlotCache(-1)


def test_lru_policy_victim_skips_pinned():
    p = LRUPolicy()
    for k in [(0, 0), (0, 1), (0, 2)]:
        p.insert(k)
    p.touch((0, 0))
    assert p.victim(set()) == (0, 1)
    assert p.victim({(0, 1), (0, 2)}) == (0, 0)
    assert p.victim({(0, 0), (0, 1), (0, 2)}) is None


layer_needs = st.lists(st.tuples(st.integers(0, 3), st.sets(st.integers(0, 7), min_size=1, max_size=8)),
                       min_size=1, max_size=40)


def _expected_victim(policy, cached: dict, pinned, incoming, slots):
    """Reference eviction rule: ``cached`` maps key -> last use time."""
    if len(cached) < slots:
        return None
    free = [k for k in cached if k not in pinned]
    oldest = lambda ks: min(ks, key=cached.get) if ks else None  # noqa: E731
    if isinstance(policy, LayerLRUPolicy):
        count = {}
        for k in cached:
            count[k[0]] = count.get(k[0], 0) + 1
        if count.get(incoming[0], 0) >= policy.quota and oldest([k for k in free if k[0] == incoming[0]]):
            return oldest([k for k in free if k[0] == incoming[0]])
        over = [k for k in free if count[k[0]] > policy.quota]
        if over:
            return oldest(over)
    return oldest(free)


def test_layer_lru_keeps_a_share_per_layer_under_cyclic_access():
    """Layers visited in a cycle, the same 2 experts each: one global LRU over 6 slots thrashes (8 needed per
    cycle, 0 hits); with per-layer shares a layer at its share evicts its own experts first, so the others keep
    theirs (here layers 1 and 2 keep both: 4 hits per cycle after the first)."""
    for policy, want_hits in ((LRUPolicy(), 0), (LayerLRUPolicy(quota=6 // 4), 4 * 9)):
        c = SlotCache(6, policy)
        for _ in range(10):
            for layer in range(4):
                for e in (0, 1):
                    if c.lookup((layer, e)) is None:
                        c.admit((layer, e))
        assert sum(c.hits.values()) == want_hits, type(policy).__name__
        c.check()


@settings(max_examples=120, deadline=None)
@given(slots=st.integers(1, 10), steps=layer_needs, layered=st.booleans())
def test_cache_property_pins_respected_counts_add_up(slots, steps, layered):
    """Drive the cache as ``OffloadExecutor`` does (hits pinned, misses admitted in waves of what is evictable,
    everything unpinned after each wave) against a reference model of the policy (LRU or per-layer LRU)."""
    policy = LayerLRUPolicy(quota=max(1, slots // 4)) if layered else LRUPolicy()
    c = SlotCache(slots, policy)
    clock, last_used = 0, {}  # reference model: key -> last use time
    lookups: dict[int, int] = {}
    for layer, needed in steps:
        pending = []
        for e in sorted(needed):
            key = (layer, e)
            lookups[layer] = lookups.get(layer, 0) + 1
            clock += 1
            if c.lookup(key) is not None:
                c.pin(key)
                last_used[key] = clock
            else:
                pending.append(key)
        while True:
            room = c.evictable()
            batch, pending = pending[:room], pending[room:]
            for key in batch:
                pinned = c.pinned
                expect = _expected_victim(policy, last_used, pinned, key, slots)
                _, evicted = c.admit(key)
                assert evicted not in pinned, "evicted an expert pinned for this step"
                assert evicted == expect, "not the expert the policy should evict"
                if evicted is not None:
                    del last_used[evicted]
                clock += 1
                last_used[key] = clock
                c.pin(key)
            assert set(c.pinned) <= set(last_used) and len(c) <= slots
            c.check()
            c.unpin_all()
            if not pending:
                break
        assert set(last_used) == {c.key_of(s) for s in range(slots)} - {None}
    assert sum(c.hits.values()) + sum(c.misses.values()) == sum(lookups.values())
    for layer, n in lookups.items():
        assert c.hits.get(layer, 0) + c.misses.get(layer, 0) == n
