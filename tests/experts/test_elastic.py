"""The elastic expert slot cache (issue 7, rung 2 of the OOM ladder): ``shrink_slots`` drops whole slot blocks and
really releases them, ``grow_slots`` adds blocks back, outputs stay the resident backend's, a failure between
admitting an expert and queuing its copy never leaves it looking cached, and the engine's OOM guard shrinks the
cache for a failing step and grows it back later. Tiny Mixtral on the CPU."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from tests.experts.helpers import greedy_trace, options
from tests.models.hf_checkpoints import token_ids

from ferrylm.bench.decode import swap_executor
from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.experts import build_from_banks
from ferrylm.faults import FaultInjector
from ferrylm.memory.guard import GuardConfig, OomGuard, elastic_cache_of
from ferrylm.checkpoints.loader import load_model

TOL = 1e-4
NEW = 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ckpt(expert_checkpoints):
    return expert_checkpoints("mixtral")


@pytest.fixture(scope="module")
def prompt(ckpt):
    return token_ids(12, ckpt.vocab_size, seed=5).tolist()


@pytest.fixture(scope="module")
def reference(ckpt, prompt):
    loaded = load_model(ckpt.path, moe_backend=options("offload", 2))
    ref = greedy_trace(swap_executor(loaded.model, build_from_banks("resident", loaded.executor.banks, "cpu")),
                       prompt, NEW)
    loaded.executor.close()
    return ref


def _load(ckpt, backend: str, size: int, block: int, **kw):
    loaded = load_model(ckpt.path, moe_backend=options(backend, size, **kw))
    ex = loaded.executor
    ex.block_slots = block
    ex.reserve(None)
    return loaded, ex


def _same(ref, got, label):
    assert got[0] == ref[0], f"{label}: greedy tokens differ from resident"
    err = max((a - b).abs().max().item() for a, b in zip(got[1], ref[1]))
    assert err <= TOL, f"{label}: logits differ by {err:.2e}"


@pytest.mark.parametrize("backend", ["offload", "cpu", "hybrid"])
def test_shrink_then_grow_keeps_resident_outputs(ckpt, prompt, reference, backend):
    loaded, ex = _load(ckpt, backend, 6, 2)
    try:
        per = ex.layout.nbytes
        _same(reference, greedy_trace(loaded.model, prompt, NEW), f"{backend} 6 slots")
        assert ex.slot_storage_bytes() == 6 * per and len(ex.slots.blocks) == 3
        freed = ex.shrink_slots(3)                 # rounded up to whole blocks of 2
        assert freed == 4 * per and ex.cache.num_slots == 2 and ex.slot_storage_bytes() == 2 * per
        ex.cache.check()
        assert ex.stats().num_slots == 2 and ex.stats().cache.slot_bytes == 2 * per
        _same(reference, greedy_trace(loaded.model, prompt, NEW), f"{backend} shrunk to 2")
        assert ex.grow_slots(3) == 3 and ex.cache.num_slots == 5 and ex.slot_storage_bytes() == 5 * per
        ex.cache.check()
        _same(reference, greedy_trace(loaded.model, prompt, NEW), f"{backend} grown to 5")
        ex.cache.check()
    finally:
        ex.close()


def test_shrink_really_releases_the_blocks_and_prefers_lru(ckpt):
    loaded, ex = _load(ckpt, "offload", 6, 2)
    try:
        cache = ex.cache
        # make block 0's residents the most recently used: it must survive a one-block shrink
        for s in ex.slots.slot_ids(0):
            cache.touch(cache.key_of(s))
        survivors = {cache.key_of(s) for s in ex.slots.slot_ids(0)}
        refs = {b: weakref.ref(t) for b, t in ex.slots.blocks.items()}
        freed = ex.shrink_slots(1)
        gc.collect()
        assert freed == 2 * ex.layout.nbytes and 0 in ex.slots.blocks and len(ex.slots.blocks) == 2
        dead = [b for b, r in refs.items() if r() is None]
        assert len(dead) == 1 and dead[0] != 0, "the dropped block's tensor is still referenced"
        assert all(k in cache for k in survivors)
        cache.check()
        # min_slots (1 for offload) is kept: 4 slots -> at most 3 can go, so 1 block of 2 goes, then none
        assert ex.shrink_slots(100) == 2 * ex.layout.nbytes and cache.num_slots == 2
        assert ex.shrink_slots(100) == 0 and cache.num_slots == 2
        # never more slots than experts; a grow that runs out of memory keeps what it added
        calls = {"n": 0}
        real = ex.slots.new_block

        def flaky(blk, size):
            calls["n"] += 1
            if calls["n"] == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            real(blk, size)

        ex.slots.new_block = flaky
        assert ex.grow_slots(4) == 2 and cache.num_slots == 4
        ex.slots.new_block = real
        total = len(ex.banks.layers) * ex.num_experts
        assert ex.grow_slots(10 * total) == total - 4 and cache.num_slots == total
        cache.check()
    finally:
        ex.close()


def test_shrink_refuses_while_experts_are_pinned(ckpt):
    loaded, ex = _load(ckpt, "offload", 4, 1)
    try:
        key = next(iter(ex.cache._slot_of))
        ex.cache.pin(key)                       # as inside a step
        assert ex.shrink_slots(2) == 0 and ex.cache.num_slots == 4
        with pytest.raises(ValueError):
            ex.cache.remove_slots([ex.cache.slot_of(key)])
        ex.cache.unpin_all()
        assert ex.shrink_slots(2) == 2 * ex.layout.nbytes and ex.cache.num_slots == 2
        ex.cache.check()
    finally:
        ex.close()


def test_fetch_failure_after_admit_leaves_nothing_cached(ckpt, prompt, reference):
    loaded, ex = _load(ckpt, "offload", 2, 1, stream_prefill=False, prefetch=False)
    try:
        ex.faults = FaultInjector.parse("expert_fetch:times=1")
        before = dict(ex.cache._slot_of)
        with pytest.raises(torch.OutOfMemoryError):
            greedy_trace(loaded.model, prompt, NEW)
        assert ex.faults.fired("expert_fetch") == 1
        ex.cache.check()
        assert not ex.cache.pinned
        # every cached expert either was cached before (copied at warm fill) or had its copy queued
        for key, slot in ex.cache._slot_of.items():
            assert before.get(key) == slot, f"{key} looks cached in slot {slot} but was never copied"
        _same(reference, greedy_trace(loaded.model, prompt, NEW), "after a failed fetch")
    finally:
        ex.close()


def _engine(loaded, spec, guard=None):
    cfg = EngineConfig(device="cpu", page_size=16, num_pages=16, max_running_requests=2, max_prefill_length=64,
                       check_invariants=True)
    return engine_for_model(loaded.model, loaded.config, cfg, device=torch.device("cpu"), dtype=torch.float32,
                  expert_executor=loaded.executor, faults=FaultInjector.parse(spec), guard=guard)


def _run(eng, prompt):
    eng.add_request("r", prompt, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    toks, err = [], None
    for _ in range(100):
        if not eng.has_work():
            break
        for o in eng.step():
            toks += o.new_token_ids
            err = err or o.error_code
    return toks, err


def test_engine_oom_ladder_shrinks_then_grows_back(ckpt, prompt):
    loaded, ex = _load(ckpt, "offload", 4, 1)
    try:
        ref, err = _run(_engine(loaded, None), prompt)
        assert err is None and len(ref) == NEW
        # two failures at the expert fetch of a 12-token prefill (below the halving floor): retry, then shrink
        eng = _engine(loaded, "expert_fetch:times=2")
        toks, err = _run(eng, prompt)
        assert err is None and toks == ref
        assert eng.stats()["oom_recoveries"] == {"retry": 1, "shrink": 1}
        assert ex.cache.num_slots < 4 and eng.guard.shrunk_slots == 4 - ex.cache.num_slots
        assert eng.stats()["memory"]["expert_slots"] == ex.cache.num_slots
        ex.grow_slots(4 - ex.cache.num_slots)
        assert ex.cache.num_slots == 4
        # memory returns: a guard that may grow at once and sees plenty free grows the cache back between steps
        guard = OomGuard(torch.device("cpu"), elastic_cache_of(ex), prefill_limit=64,
                         config=GuardConfig(grow_interval_s=0.0), read_free=lambda: 1 << 40)
        eng = _engine(loaded, "expert_fetch:times=2", guard=guard)
        toks, err = _run(eng, prompt)
        assert err is None and toks == ref
        rec = eng.stats()["oom_recoveries"]
        assert rec.get("shrink") == 1 and rec.get("grow", 0) >= 1
        assert guard.shrunk_slots == 0 and ex.cache.num_slots == 4
        ex.cache.check()
    finally:
        ex.close()
