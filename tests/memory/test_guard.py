"""OOM containment in-process (CPU, tiny Mixtral with the offload backend): for every engine-side fault point,
one injected failure is survived with the same greedy output, and a failure at every try fails only that request
with insufficient_memory while the next request is served; then each rung of the ladder on its own."""

from __future__ import annotations

import time

import pytest
import torch

from ferrylm.memory.guard import GuardConfig, OomGuard
from tests.memory.conftest import LONG, MID, SHORT, drain, greedy, make_engine, run

ENGINE_POINTS = ["prefill_workspace", "attention_scratch", "expert_fetch", "kv_page_alloc", "logits"]


@pytest.mark.parametrize("point", ENGINE_POINTS)
def test_inject_once_same_greedy_output(offload_model, reference, point):
    eng = make_engine(offload_model, f"{point}:times=1")
    res = run(eng, {"long": LONG})
    assert eng.faults.fired(point) == 1, f"{point} was never reached"
    assert res["long"]["error"] is None and res["long"]["tokens"] == reference["long"]
    assert eng.stats()["oom_recoveries"] == {"retry": 1}


@pytest.mark.parametrize("point", ENGINE_POINTS)
def test_inject_always_fails_only_that_request(offload_model, reference, point):
    eng = make_engine(offload_model, f"{point}:min_prompt=150")   # every try of the 200-token request fails
    t0 = time.monotonic()
    res = run(eng, {"long": LONG})
    assert res["long"]["error"] == "insufficient_memory" and res["long"]["seconds"] < 30
    msg = res["long"]["message"]
    assert "out of memory" in msg and "failed allocation" in msg and "tried: retry" in msg
    assert eng.faults.fired(point) >= 2
    nxt = drain_one(eng, "short", SHORT, t0)                     # the engine keeps serving
    assert nxt["error"] is None and nxt["tokens"] == reference["short"]
    s = eng.stats()
    assert s["memory"]["oom_failed_requests"] == 1 and s["oom_recoveries"]["fail"] == 1


def drain_one(eng, rid, ids, t0):
    eng.add_request(rid, ids, greedy())
    return drain(eng, t0)[rid]


def test_halve_the_chunk_then_restore_the_budget(offload_model, reference):
    guard = OomGuard(torch.device("cpu"), _NoCache(), prefill_limit=256, config=GuardConfig(restore_after_steps=2))
    eng = make_engine(offload_model, "prefill_workspace:times=2", guard=guard)
    t0 = time.monotonic()
    eng.add_request("long", LONG, greedy())
    eng.step()                                   # fails twice: retry, then the 200-token chunk halved to 128
    assert eng.stats()["oom_recoveries"] == {"retry": 1, "halve": 1}
    assert eng.scheduler.prefill_budget == 128 and eng.requests["long"].num_computed_tokens == 128
    res = drain(eng, t0)
    assert res["long"]["tokens"] == reference["long"]
    assert eng.scheduler.prefill_budget == 256 and eng.stats()["oom_recoveries"]["restore"] >= 1


def _no_shrink_guard() -> OomGuard:
    """The ladder without the shrink rung (the shared model's cache size depends on the tests before)."""
    return OomGuard(torch.device("cpu"), _NoCache(), prefill_limit=256)


def test_decode_oom_preempts_the_newest(offload_model, reference):
    eng = make_engine(offload_model, "logits:phase=decode:times=2", guard=_no_shrink_guard())
    res = run(eng, {"long": LONG, "mid": MID, "short": SHORT})
    assert eng.stats()["oom_recoveries"] == {"retry": 1, "preempt": 1}
    assert eng.scheduler.num_preemptions == 1
    assert {k: v["tokens"] for k, v in res.items()} == reference and not any(v["error"] for v in res.values())


def test_prefill_oom_defers_the_prefill_and_the_decodes_go_on(offload_model, reference):
    eng = make_engine(offload_model, "prefill_workspace:min_prompt=90:times=2", guard=_no_shrink_guard())
    t0 = time.monotonic()
    eng.add_request("short", SHORT, greedy())
    out = eng.step()                             # "short" prefilled, decoding from now on
    assert out and out[0].new_token_ids
    eng.add_request("mid", MID, greedy())        # 100 tokens (<= the floor): retry, then defer its prefill
    out2 = eng.step()
    assert eng.stats()["oom_recoveries"] == {"retry": 1, "defer": 1}
    assert [o.request_id for o in out2] == ["short"] and out2[0].new_token_ids   # the decode was not held back
    assert eng.requests["mid"].num_computed_tokens == 0 and eng.requests["mid"].page_table   # deferred, kept
    assert eng.scheduler.num_preemptions == 0
    res = {"short": {"tokens": list(out[0].new_token_ids) + list(out2[0].new_token_ids), "error": None,
                     "message": "", "finish": None}}
    res = drain(eng, t0, res=res)
    assert res["mid"]["tokens"] == reference["mid"] and res["short"]["tokens"] == reference["short"]


class _NoCache:
    num_slots = 0
    slot_bytes = 0
    min_slots = 0

    def shrink(self, n):
        return 0

    def grow(self, n):
        return 0


class FakeSlots:
    """An ElasticCache of ``n`` slots of 1 MiB."""

    def __init__(self, n: int):
        self.num_slots, self.slot_bytes, self.min_slots = n, 1 << 20, 1
        self.calls: list[tuple[str, int]] = []

    def shrink(self, n):
        n = min(n, self.num_slots - self.min_slots)
        self.num_slots -= n
        self.calls.append(("shrink", n))
        return n * self.slot_bytes

    def grow(self, n):
        self.num_slots += n
        self.calls.append(("grow", n))
        return n


def test_shrink_the_expert_cache_then_grow_back(offload_model, reference):
    now, free = [100.0], [0]
    cache = FakeSlots(8)
    guard = OomGuard(torch.device("cpu"), cache, prefill_limit=256, reserve_bytes=1 << 20,
                     config=GuardConfig(grow_interval_s=5.0, shrink_margin_bytes=0), read_free=lambda: free[0],
                     clock=lambda: now[0])
    eng = make_engine(offload_model, "attention_scratch:times=2:bytes=2097152", guard=guard)
    res = run(eng, {"short": SHORT})             # 20 tokens (<= the floor): retry, then shrink 2 slots (2 MiB)
    assert res["short"]["tokens"] == reference["short"]
    assert eng.stats()["oom_recoveries"] == {"retry": 1, "shrink": 1} and cache.calls == [("shrink", 2)]
    assert eng.stats()["memory"]["expert_slots"] == 6 and guard.shrunk_slots == 2
    now[0] += 10
    guard.tick()                                 # memory still short: no growth
    assert cache.num_slots == 6
    free[0] = 64 << 20
    now[0] += 10
    guard.tick()
    assert cache.num_slots == 8 and guard.shrunk_slots == 0 and guard.recoveries["grow"] == 1


def test_a_large_cache_gives_back_the_planned_workspace_before_the_chunk_is_halved(offload_model, reference):
    """Field report (issue 15): halving the chunk first and shrinking the cache a few slots at a time kept the engine
    at the edge of OOM. Now one shrink returns the workspace + margin and the chunk keeps its size."""
    cache = FakeSlots(400)
    guard = OomGuard(torch.device("cpu"), cache, prefill_limit=256,
                     config=GuardConfig(workspace_bytes=100 << 20, shrink_margin_bytes=28 << 20))
    eng = make_engine(offload_model, "prefill_workspace:times=2:bytes=1048576", guard=guard)
    res = run(eng, {"long": LONG})              # a 200-token prefill fails twice: retry, then ONE shrink
    assert res["long"]["tokens"] == reference["long"]
    assert eng.stats()["oom_recoveries"] == {"retry": 1, "shrink": 1}
    assert cache.calls == [("shrink", 128)]     # (100 + 28) MiB of 1 MiB slots, not the 1 MiB that failed
    assert eng.scheduler.prefill_budget == 256  # the chunk was not halved


def test_unexpected_errors_are_not_swallowed(offload_model):
    eng = make_engine(offload_model)
    eng.add_request("x", SHORT, greedy())
    real = eng.model.forward
    eng.model.forward = lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug"))
    try:
        with pytest.raises(ValueError, match="a bug"):
            eng.step()
    finally:
        eng.model.forward = real
