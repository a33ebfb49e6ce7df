"""Automatic prefix caching (issue 23): the allocator's states and LRU, the page names, and the engine with the
cache under random interleavings of arrivals with shared prefixes, aborts and preemptions (invariants after every
step; greedy outputs equal those of a cache-less engine)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.engine import Engine
from ferrylm.engine.cache.page_allocator import OutOfPages, PageAllocator
from ferrylm.engine.cache.prefix_cache import cache_seed, chain_hashes
from ferrylm.engine.sampling_params import SamplingParams
from tests.engine.fake_model import FakeModel, fake_config

PAGE = 4


def make_engine(*, caching=True, num_pages=64, max_running=4, budget=16, invariants=True):
    cfg = fake_config(max_len=512)
    ec = EngineConfig(device="cpu", page_size=PAGE, num_pages=num_pages, max_running_requests=max_running,
                      max_prefill_length=budget, check_invariants=invariants, enable_prefix_caching=caching)
    return engine_for_model(FakeModel(cfg), cfg, ec, device=torch.device("cpu"), dtype=torch.float32)


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def drain(eng: Engine, outs: dict | None = None, max_steps=5000) -> dict[str, list]:
    outs = {} if outs is None else outs
    for _ in range(max_steps):
        if not eng.has_work():
            return outs
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not drain")


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def cached(outs) -> int | None:
    vals = [o.num_cached_tokens for o in outs if o.num_cached_tokens is not None]
    assert len(vals) <= 1, "cached tokens reported more than once"
    return vals[0] if vals else None


# --- allocator -------------------------------------------------------------------------------------------------
def test_allocator_shares_named_pages_and_evicts_lru():
    a = PageAllocator(4)
    p = a.allocate(2)
    assert a.name(p[0], b"x") and a.name(p[1], b"y")
    assert not a.name(p[1], b"z"), "a page is named once"
    q = a.allocate(2)
    assert not a.name(q[0], b"x"), "a name maps to one page"
    a.acquire([p[0]])                       # a second request maps the cached page
    a.check([p, [p[0]], q])
    with pytest.raises(AssertionError):
        a.check([p, q])                     # reference count 2, held once
    a.free(reversed(p))                     # p[1] then p[0]: p[0] still held by the second request
    a.free(q)                               # unnamed: reused first
    a.check([[p[0]]])
    assert a.num_free == 3 and a.num_used == 1 and a.num_cached == 2
    assert sorted(a.allocate(2)) == sorted(q), "unnamed pages are handed out before cached ones"
    a.free([p[0]])
    assert a.lookup([b"x", b"y"]) == [p[0], p[1]]
    assert a.allocate(1) == [p[1]], "the least recently released cached page goes first"
    assert a.lookup([b"x", b"y"]) == [p[0]] and a.num_evictions == 1
    with pytest.raises(OutOfPages):
        a.allocate(2)


def test_allocator_check_catches_unnamed_sharing():
    a = PageAllocator(2)
    p = a.allocate(1)
    a.acquire(p)
    with pytest.raises(AssertionError, match="without a name"):
        a.check([p, p])


def test_page_names_chain_over_tokens_and_seed():
    s1, s2 = cache_seed("m", 1), cache_seed("m", 2)
    a: list[bytes] = []
    chain_hashes(s1, a, list(range(10)), PAGE)
    assert len(a) == 2                      # the partial third page has no name
    b: list[bytes] = []
    chain_hashes(s1, b, list(range(9)) + [99, 5, 6], PAGE)
    assert a == b[:2]
    c: list[bytes] = []
    chain_hashes(s1, c, [7] + list(range(1, 10)), PAGE)
    assert c[0] != a[0] and c[1] != a[1], "a change in page 0 renames every later page"
    d: list[bytes] = []
    chain_hashes(s2, d, list(range(10)), PAGE)
    assert not set(d) & set(a), "another seed shares nothing"
    e = a[:1]
    chain_hashes(s1, e, list(range(10)), PAGE)
    assert e == a, "extending a chain gives the same names"


# --- the engine with the cache -----------------------------------------------------------------------------------
def test_second_request_maps_the_first_ones_pages():
    prompt = [random.Random(1).randrange(1, 32) for _ in range(22)]
    ref = drain(_with(make_engine(caching=False), {"a": prompt}, 6))
    eng = make_engine()
    first = drain(_with(eng, {"a": prompt}, 6))
    assert cached(first["a"]) == 0
    second = drain(_with(eng, {"b": prompt}, 6))
    # 22 prompt tokens: 5 full pages and a's prompt-end tail (tokens 20, 21), all but the last token -> 21 cached
    assert cached(second["b"]) == 21
    assert tokens(second["b"]) == tokens(first["a"]) == tokens(ref["a"])
    st_ = eng.stats()["prefix_cache"]
    assert st_["queries"] == 44 and st_["hits"] == 21


def test_last_token_is_always_computed_and_partial_page_copied_not_shared():
    eng = make_engine()
    p = list(range(1, 17))                  # exactly 4 pages
    drain(_with(eng, {"a": p}, 3))
    out = drain(_with(eng, {"b": p}, 3))
    assert cached(out["b"]) == 12, "the page holding the last prompt token is recomputed"
    q = list(range(1, 15))                  # 3 full pages + a partial one
    drain(_with(eng, {"c": q}, 1))
    eng.add_request("d", q + [20, 21], greedy(2))
    outs = {o.request_id: [o] for o in eng.step()}
    d = eng.requests["d"]
    assert d.num_cached_tokens == 14, "c's prompt ends in page 3 (tokens 12, 13): a tail"
    assert eng.pool.allocator.name_of(d.page_table[3]) is None and eng.pool.allocator.refcount(d.page_table[3]) == 1
    out = drain(eng, outs)
    ref = drain(_with(make_engine(caching=False), {"d": q + [20, 21]}, 2))
    assert tokens(out["d"]) == tokens(ref["d"])


def test_off_reports_zero_and_keeps_nothing():
    eng = make_engine(caching=False)
    p = list(range(1, 23))
    drain(_with(eng, {"a": p}, 2))
    out = drain(_with(eng, {"b": p}, 2))
    assert cached(out["b"]) == 0 and "prefix_cache" not in eng.stats()
    assert eng.pool.allocator.num_cached == 0


def test_prompt_logprobs_requests_are_not_mapped():
    eng = make_engine()
    p = list(range(1, 23))
    drain(_with(eng, {"a": p}, 2))
    eng.add_request("b", p, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))
    out = drain(eng)
    assert cached(out["b"]) == 0
    first = next(o for o in out["b"] if o.prompt_logprobs is not None)
    assert len(first.prompt_logprobs) == len(p)


def test_cache_survives_preemption_and_eviction_keeps_outputs():
    """A pool too small for everything: requests are preempted and cached pages evicted, outputs unchanged."""
    rng = random.Random(3)
    system = [rng.randrange(1, 32) for _ in range(12)]
    prompts = {str(i): system + [rng.randrange(1, 32) for _ in range(rng.randrange(1, 12))] for i in range(8)}
    ref = drain(_with(make_engine(caching=False, num_pages=64, budget=512), prompts, 10))
    eng = make_engine(num_pages=14, budget=12)
    got = drain(_with(eng, prompts, 10))
    assert {k: tokens(v) for k, v in got.items()} == {k: tokens(v) for k, v in ref.items()}
    assert eng.scheduler.num_preemptions > 0
    assert eng.stats()["prefix_cache"]["hits"] > 0
    assert eng.pool.allocator.num_used == 0


def _with(eng: Engine, prompts: dict[str, list[int]], max_tokens: int) -> Engine:
    for rid, p in prompts.items():
        eng.add_request(rid, p, greedy(max_tokens))
    return eng


# --- property test -----------------------------------------------------------------------------------------------
PREFIXES = [[(7 * i + 3 * j) % 31 + 1 for j in range(10)] for i in range(3)]

arrival = st.tuples(st.integers(0, len(PREFIXES) - 1), st.integers(0, 10),
                    st.lists(st.integers(1, 31), min_size=1, max_size=9), st.integers(1, 6))
event = st.one_of(
    st.tuples(st.just("add"), arrival),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(event, min_size=1, max_size=40), pool_pages=st.integers(8, 40))
def test_random_interleavings_keep_invariants_and_outputs(events, pool_pages):
    eng = make_engine(num_pages=pool_pages, budget=8, max_running=3)
    outs: dict[str, list] = {}
    prompts: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    alloc = eng.pool.allocator
    for kind, arg in events:
        if kind == "add":
            pi, cut, suffix, mt = arg
            rid = f"r{len(prompts)}"
            prompts[rid] = (PREFIXES[pi][:cut] + suffix, mt)
            eng.add_request(rid, prompts[rid][0], greedy(mt))
        elif kind == "step":
            for _ in range(arg):
                for o in eng.step():          # check_invariants runs inside every step
                    outs.setdefault(o.request_id, []).append(o)
        elif kind == "abort" and eng.requests:
            rid = sorted(eng.requests)[arg % len(eng.requests)]
            eng.abort(rid)
            aborted.add(rid)
        elif kind == "preempt" and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.running[arg % len(eng.scheduler.running)])
        eng.scheduler.check_invariants()
        _check_names(eng)
    drain(eng, outs)
    eng.scheduler.check_invariants()
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_pages, "every page is free or cached at the end"
    # greedy outputs equal a cache-less engine's (one request at a time, nothing shared)
    for rid, (p, mt) in prompts.items():
        if rid in aborted or rid not in outs or any(o.error_code for o in outs[rid]):
            continue
        ref = drain(_with(make_engine(caching=False, num_pages=64, budget=512, invariants=False), {rid: p}, mt))
        assert tokens(outs[rid]) == tokens(ref[rid]), f"{rid}: output differs with the prefix cache"
        c = cached(outs[rid])
        assert c is not None and c < len(p)   # full pages and a tail: all but the last token at most


def _check_names(eng: Engine) -> None:
    """Every named page held by a request sits where that request's own page names say it should."""
    alloc = eng.pool.allocator
    for r in eng.scheduler.running:
        names: list[bytes] = []
        chain_hashes(eng.prefix_cache.seed, names, r.tokens(0, r.num_computed_tokens), PAGE)
        for i, page in enumerate(r.page_table):
            name = alloc.name_of(page)
            if name is not None:
                assert i < len(names) and names[i] == name, f"{r.request_id}: page {i} holds other tokens"


# --- the OOM ladder ---------------------------------------------------------------------------------------------
fault = st.tuples(st.sampled_from(["kv_page_alloc", "attention_scratch", "logits", "prefill_workspace"]),
                  st.integers(0, 12), st.integers(1, 6))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])   # each OOM runs gc.collect
@given(faults=st.lists(fault, min_size=1, max_size=3, unique_by=lambda f: f[0]),
       arrivals=st.lists(arrival, min_size=2, max_size=8))
def test_oom_ladder_keeps_the_cache_consistent(faults, arrivals):
    """Injected allocation failures at every site while cached prefixes are mapped: invariants hold after every
    step, requests that finish get the cache-less greedy output, failed ones hold nothing at the end."""
    from ferrylm.faults import FaultInjector

    spec = ",".join(f"{p}:after={a}:times={t}" for p, a, t in faults)
    cfg = fake_config(max_len=512)
    ec = EngineConfig(device="cpu", page_size=PAGE, num_pages=24, max_running_requests=3, max_prefill_length=8,
                      check_invariants=True)
    model = FakeModel(cfg)
    model.config = cfg   # the fault sites size their errors from it
    eng = engine_for_model(model, cfg, ec, device=torch.device("cpu"), dtype=torch.float32, faults=FaultInjector.parse(spec))
    prompts = {}
    for i, (pi, cut, suffix, mt) in enumerate(arrivals):
        prompts[f"r{i}"] = (PREFIXES[pi][:cut] + suffix, mt)
    outs: dict[str, list] = {}
    for i, (rid, (p, mt)) in enumerate(prompts.items()):
        eng.add_request(rid, p, greedy(mt))
        if i % 2:
            for o in eng.step():
                outs.setdefault(o.request_id, []).append(o)
            _check_names(eng)
    drain(eng, outs)
    alloc = eng.pool.allocator
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_pages
    for rid, (p, mt) in prompts.items():
        if any(o.error_code for o in outs[rid]):
            assert outs[rid][-1].error_code == "insufficient_memory"
            continue
        ref = drain(_with(make_engine(caching=False, num_pages=64, budget=512, invariants=False), {rid: p}, mt))
        assert tokens(outs[rid]) == tokens(ref[rid]), f"{rid}: output differs after OOM recoveries"
