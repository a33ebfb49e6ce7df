"""Expert-cache policies beyond LRU (experts/cache.py: LayerLRFUPolicy, make_policy) and the cache-policy
simulator (bench/cache_policy.py) on routing-model traces."""

from __future__ import annotations

import json
import random

import pytest

from ferrylm.bench.cache_policy import LayerLFUPolicy, make_trace, simulate
from ferrylm.config import CACHE_POLICIES, EngineConfig
from ferrylm.experts.cache import LayerLRFUPolicy, LayerLRUPolicy, LRUPolicy, SlotCache, make_policy
from ferrylm.experts.options import ExpertOptions
from ferrylm.synthetic.routing_stats import lru_hit_rate


def _drive(cache: SlotCache, accesses, seed: int = 0) -> list:
    """Run ``accesses`` (keys) through ``cache`` one at a time; returns the evicted keys in order."""
    evicted = []
    for key in accesses:
        if cache.lookup(key) is None:
            _, gone = cache.admit(key)
            evicted.append(gone)
        cache.check()
    return evicted


def _random_accesses(n: int, layers: int, experts: int, seed: int) -> list:
    rng = random.Random(seed)
    return [(rng.randrange(layers), min(int(rng.paretovariate(1.2)) - 1, experts - 1)) for _ in range(n)]


def test_lrfu_with_a_tiny_half_life_is_lru_and_a_huge_one_is_lfu():
    acc = _random_accesses(3000, layers=3, experts=40, seed=1)
    lru = _drive(SlotCache(24, LayerLRUPolicy(8)), acc)
    assert _drive(SlotCache(24, LayerLRFUPolicy(8, half_life=1e-3)), acc) == lru
    lfu_cache, blend_cache = SlotCache(24, LayerLFUPolicy(8)), SlotCache(24, LayerLRFUPolicy(8, half_life=1e12))
    lfu = _drive(lfu_cache, acc)
    _drive(blend_cache, acc)   # ties among equal counts fall by age here, by recency order in LFU: nearly equal
    assert abs(sum(blend_cache.hits.values()) - sum(lfu_cache.hits.values())) <= 0.01 * len(acc)
    assert lfu != lru


def test_lrfu_blends_frequency_and_recency():
    # layer 0, quota 2: expert 1 used 4 times long ago, expert 2 once just now; a third expert must evict one
    def victim(half_life):
        cache = SlotCache(2, LayerLRFUPolicy(2, half_life=half_life))
        for key in [(0, 1)] * 4 + [(0, 2)]:
            if cache.lookup(key) is None:
                cache.admit(key)
        return cache.admit((0, 3))[1]
    assert victim(100.0) == (0, 2)   # long memory: the frequent one stays
    assert victim(0.1) == (0, 1)     # short memory: the recent one stays (LRU)


def test_lrfu_keeps_per_layer_shares_and_never_evicts_pinned():
    cache = SlotCache(4, LayerLRFUPolicy(2, half_life=50))
    for key in [(0, 1), (0, 2), (1, 1), (1, 2)]:
        cache.admit(key)
    for _ in range(5):
        cache.lookup((1, 1))      # layer 1's experts are used a lot, layer 0's little
    _, gone = cache.admit((0, 3))
    assert gone[0] == 0           # layer 0 holds its quota: its own expert goes, not layer 1's
    cache.pin((0, 3))
    cache.pin((0, 2) if (0, 2) in cache else (0, 1))
    _, gone = cache.admit((0, 4))  # both layer-0 experts pinned: the lowest of the over-quota rest
    assert gone not in cache.pinned
    cache.check()


def test_lrfu_history_outlives_eviction_and_half_life_follows_the_quota():
    pol = LayerLRFUPolicy(4)
    assert pol.effective_half_life == 4
    pol.quota = 10   # the elastic cache changes the quota (experts/cached.py _set_quota)
    assert pol.effective_half_life == 10
    pol.insert((0, 1))
    pol.touch((0, 1))
    pol.remove((0, 1))
    pol.insert((0, 1))
    assert pol.score((0, 1)) > 2.0   # three uses, barely decayed
    with pytest.raises(ValueError):
        LayerLRFUPolicy(4, half_life=0)
    with pytest.raises(ValueError):
        LayerLRFUPolicy(4, half_life_slots=-1)


def test_make_policy_and_the_flag():
    assert isinstance(make_policy("layer-lru", 64, 8), LayerLRUPolicy)
    assert type(make_policy("lru", 64, 8)) is LRUPolicy
    lrfu = make_policy("layer-lrfu", 64, 8)
    assert isinstance(lrfu, LayerLRFUPolicy) and lrfu.quota == 8
    assert set(CACHE_POLICIES) == {"layer-lru", "lru", "layer-lrfu"}
    with pytest.raises(ValueError, match="unknown expert cache policy"):
        make_policy("arc", 64, 8)
    with pytest.raises(ValueError, match="--moe-cache-policy"):
        ExpertOptions(backend="offload", cache_policy="arc").validate()
    ExpertOptions(backend="offload", cache_policy="layer-lrfu").validate()
    assert EngineConfig().moe_cache_policy == "layer-lru"


def test_cli_parses_moe_cache_policy():
    from ferrylm.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "x", "--moe-cache-policy", "layer-lrfu"])
    assert args.moe_cache_policy == "layer-lrfu"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "x", "--moe-cache-policy", "nope"])


# --- the simulator -------------------------------------------------------------------------------------------

def test_simulated_lru_matches_the_trace_statistic():
    tr = make_trace("qwen3", 128, 8, layers=1, batch=1, steps=256)
    ids = tr.route[0, :, 0, :]
    for c in (16, 51):
        assert simulate(tr, "layer-lru", c).hit_rate == pytest.approx(lru_hit_rate(ids, c), abs=1e-12)


def test_opt_bounds_every_policy_and_locality_beats_uniform():
    tr = make_trace("qwen3", 128, 8, layers=1, batch=2, steps=200)
    opt = simulate(tr, "opt", 40).hit_rate
    for pol in ("lru", "layer-lru", "layer-lfu", "layer-lrfu", "layer-lrfu-q4"):
        assert simulate(tr, pol, 40).hit_rate <= opt + 1e-9, pol
    uni = make_trace("uniform", 128, 8, layers=1, batch=2, steps=200)
    assert simulate(uni, "layer-lru", 40).hit_rate < simulate(tr, "layer-lru", 40).hit_rate - 0.3


def test_prefetch_figures():
    tr = make_trace("qwen3", 128, 8, layers=3, batch=1, steps=160)
    base = simulate(tr, "layer-lru", 32)
    pf = simulate(tr, "layer-lru", 32, prefetch=True, expert_bytes=1000)
    assert 0.6 < pf.recall <= 1 and pf.precision == pytest.approx(pf.recall)  # k predicted, k chosen (batch 1)
    assert pf.hit_rate > base.hit_rate
    assert pf.wasted_bytes_per_token == pytest.approx(pf.prefetch_wasted_per_token * 1000)
    uni = simulate(make_trace("uniform", 128, 8, layers=3, batch=1, steps=160), "layer-lru", 32, prefetch=True)
    assert uni.recall < 0.2


def test_bench_cli_writes_json(tmp_path, capsys):
    from ferrylm.cli import main

    out = tmp_path / "cp.json"
    assert main(["bench", "cache-policy", "--profiles", "qwen3", "--batches", "1", "--policies",
                 "layer-lru,layer-lrfu,opt", "--layers", "2", "--steps", "96", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    curve = res["curves"]["qwen3"]["c1"]
    assert set(curve) == {"layer-lru", "layer-lrfu", "opt"} and "51" in curve["layer-lru"]
    assert all(curve["opt"][c] >= curve["layer-lru"][c] - 0.02 for c in curve["opt"])
    assert "recall" in res["prefetch"]["qwen3"]["c1"]["51"]
    assert "| layer-lru |" in capsys.readouterr().out
