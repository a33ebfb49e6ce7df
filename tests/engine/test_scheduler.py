"""Scheduler + paged KV invariants, admission, preemption and no head-of-line blocking (fake model, CPU)."""

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
from ferrylm.engine.sampling_params import SamplingParams
from tests.engine.fake_model import FakeModel, fake_config


def make_engine(num_pages=64, page_size=4, max_running=4, budget=16, max_len=512, eos=0):
    cfg = fake_config(max_len=max_len, eos=eos)
    ec = EngineConfig(device="cpu", page_size=page_size, num_pages=num_pages, max_running_requests=max_running,
                      max_prefill_length=budget, check_invariants=True)
    return engine_for_model(FakeModel(cfg), cfg, ec, device=torch.device("cpu"), dtype=torch.float32)


def run_all(engine: Engine, max_steps=10_000) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not engine.has_work(), "engine did not drain"
    return outs


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_allocator_invariants():
    a = PageAllocator(4)
    p = a.allocate(3)
    with pytest.raises(OutOfPages):
        a.allocate(2)
    assert a.num_free == 1
    a.check([p])
    a.free(p)
    a.check([])
    with pytest.raises(AssertionError):
        a.check([[0], [0]])


def test_prompt_larger_than_pool_rejected_and_next_served():
    eng = make_engine(num_pages=16, page_size=4)  # 64 tokens
    eng.add_request("big", list(range(1, 101)), greedy(4))
    eng.add_request("small", list(range(1, 21)), greedy(4))
    outs = run_all(eng)
    assert outs["big"][0].error_code == "context_length_exceeded"
    assert outs["big"][0].error_message.startswith("This model's maximum context length is 512 tokens.")
    assert "64" in outs["big"][0].error_message and "--num-tokens" in outs["big"][0].error_message
    assert sum(len(o.new_token_ids) for o in outs["small"]) == 4
    assert outs["small"][-1].finish_reason == "length"


def test_context_length_rejection_and_default_max_tokens():
    eng = make_engine(max_len=40, num_pages=64)
    eng.add_request("a", list(range(1, 31)), greedy(20))
    eng.add_request("b", list(range(1, 31)), SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    outs = run_all(eng)
    assert outs["a"][0].error_code == "context_length_exceeded"
    assert sum(len(o.new_token_ids) for o in outs["b"]) == 10  # up to the context


def test_chunked_prefill_and_preemption_match_solo_runs():
    prompts = [[random.Random(i).randrange(1, 32) for _ in range(n)] for i, n in enumerate([5, 23, 9, 40, 3])]
    solo = {}
    for i, p in enumerate(prompts):
        e = make_engine(num_pages=64, budget=512)
        e.add_request(str(i), p, greedy(12))
        solo[str(i)] = [t for o in run_all(e)[str(i)] for t in o.new_token_ids]
    # tiny budget forces chunked prefill; a tiny pool (14 pages x 4 = 56 tokens) forces preemption
    e = make_engine(num_pages=14, budget=7, max_running=5)
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, greedy(12))
    together = {k: [t for o in v for t in o.new_token_ids] for k, v in run_all(e).items()}
    assert together == solo
    assert e.scheduler.num_preemptions > 0


def test_a_pool_smaller_than_the_running_set_does_not_ping_pong():
    """Four requests of 50 tokens on a 64-token pool (one at a time fits, two do not): a preempted request comes
    back only with room to go on, so the requests take turns instead of preempting each other at every page (32
    preemptions, each a full recompute, before the rule; 5 after), and each still gets its solo tokens."""
    prompts = {str(i): [random.Random(i).randrange(1, 32) for _ in range(20)] for i in range(4)}
    solo = {}
    for rid, p in prompts.items():
        e = make_engine(num_pages=16, budget=16)
        e.add_request(rid, p, greedy(30))
        solo[rid] = [t for o in run_all(e)[rid] for t in o.new_token_ids]
    e = make_engine(num_pages=16, budget=16, max_running=4)
    for rid, p in prompts.items():
        e.add_request(rid, p, greedy(30))
    together = {k: [t for o in v for t in o.new_token_ids] for k, v in run_all(e).items()}
    assert together == solo
    assert 0 < e.scheduler.num_preemptions <= 2 * len(prompts)


def test_waiting_request_does_not_block_smaller_ones():
    eng = make_engine(num_pages=10, page_size=4, budget=64, max_running=4)  # 40 tokens
    eng.add_request("a", list(range(1, 25)), greedy(8))   # 24 + 8 tokens: takes most of the pool
    eng.step()
    # 29 tokens: fits the pool, not the free pages now (no prefix shared with a: nothing maps from the cache)
    eng.add_request("b", list(range(2, 31)), greedy(2))
    eng.add_request("c", list(range(1, 5)), greedy(2))    # small: must run while b waits
    seen_c_before_b_started = False
    for _ in range(200):
        for o in eng.step():
            if o.request_id == "c" and o.finish_reason and eng.requests.get("b") is not None \
                    and eng.requests["b"].num_computed_tokens == 0:
                seen_c_before_b_started = True
        if not eng.has_work():
            break
    assert seen_c_before_b_started
    assert not eng.has_work()


def test_abort_frees_pages_within_one_step():
    eng = make_engine(num_pages=32)
    eng.add_request("a", list(range(1, 20)), greedy(50))
    eng.step()
    assert eng.pool.allocator.num_used > 0
    eng.abort("a")
    outs = eng.step()
    assert eng.pool.allocator.num_used == 0
    assert outs[-1].finish_reason == "abort"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_traffic_invariants(data):
    page_size = data.draw(st.sampled_from([1, 2, 4]))
    num_pages = data.draw(st.integers(2, 40))
    eng = make_engine(num_pages=num_pages, page_size=page_size, budget=data.draw(st.integers(1, 24)),
                      max_running=data.draw(st.integers(1, 5)), max_len=64)
    pool = num_pages * page_size
    n_req = data.draw(st.integers(1, 8))
    arrivals = {}
    for i in range(n_req):
        arrivals.setdefault(data.draw(st.integers(0, 10)), []).append(
            (str(i), data.draw(st.integers(1, 50)), data.draw(st.integers(1, 12))))
    aborts = {data.draw(st.integers(0, 30)): str(data.draw(st.integers(0, n_req - 1))) for _ in range(2)}
    ended: dict[str, str] = {}
    for step in range(3000):
        for rid, plen, mt in arrivals.get(step, []):
            eng.add_request(rid, [1 + (j % 30) for j in range(plen)], greedy(mt))
        if step in aborts:
            eng.abort(aborts[step])
        idle_with_waiting = not eng.scheduler.running and bool(eng.scheduler.waiting)
        outs = eng.step()
        for o in outs:
            if o.finished:
                ended[o.request_id] = o.error_code or o.finish_reason
        # liveness: a step that starts with nothing running and something admissible waiting makes progress
        if idle_with_waiting:
            assert eng.scheduler.running or any(o.new_token_ids for o in outs), "waiting request not admitted"
        if step > 10 and not eng.has_work():
            break
    assert not eng.has_work()
    for i in range(n_req):
        rid = str(i)
        assert rid in ended, f"request {rid} never ended"
    for step_reqs in arrivals.values():
        for rid, plen, mt in step_reqs:
            if plen + 1 > pool or plen + mt > 64:
                assert ended[rid] == "context_length_exceeded"


def test_queue_timeout_fails_only_the_waiting_request(monkeypatch):
    import time as _time

    cfg = fake_config()
    ec = EngineConfig(device="cpu", page_size=4, num_pages=8, max_running_requests=1, max_prefill_length=64,
                      check_invariants=True, queue_timeout=5.0)
    eng = engine_for_model(FakeModel(cfg), cfg, ec, device=torch.device("cpu"), dtype=torch.float32)
    clock = [1000.0]
    monkeypatch.setattr(_time, "monotonic", lambda: clock[0])
    eng.add_request("running", [1, 2, 3], greedy(30))
    eng.step()
    eng.add_request("queued", [1, 2, 3], greedy(3))  # max_running_requests=1: must wait
    eng.step()
    clock[0] += 6.0
    outs = {o.request_id: o for o in eng.step()}
    assert outs["queued"].error_code == "queue_timeout" and "--queue-timeout 5" in outs["queued"].error_message
    assert "running" in eng.requests
    done = run_all(eng)
    assert done["running"][-1].finish_reason == "length"


def test_engine_ends_requests_past_their_deadline_and_frees_their_pages():
    """Issue 15: past its server-side deadline a request (running or still waiting) ends with request_timeout
    and its KV pages return to the pool; a request without a deadline is untouched."""
    import time

    import torch

    from ferrylm.config import EngineConfig
    from ferrylm.engine.boot import engine_for_model
    from ferrylm.engine.engine import Engine
    from ferrylm.engine.sampling_params import SamplingParams
    from tests.engine.fake_model import FakeModel, fake_config

    mcfg = fake_config()
    eng = engine_for_model(FakeModel(mcfg), mcfg, EngineConfig(device="cpu", num_pages=64, page_size=4, max_running_requests=1),
                 device=torch.device("cpu"), dtype=torch.float32)
    soon = time.monotonic() + 0.05
    greedy = dict(ignore_eos=True, temperature=0.0)
    eng.add_request("late", [1, 2, 3], SamplingParams(max_tokens=50, deadline=soon, **greedy))
    eng.add_request("queued", [4, 5], SamplingParams(max_tokens=50, deadline=soon, **greedy))  # waits behind it
    eng.add_request("free", [6, 7], SamplingParams(max_tokens=2, **greedy))
    assert not any(o.error_code for o in eng.step())
    time.sleep(0.06)
    outs = []
    for _ in range(10):
        outs += eng.step()
    assert {o.request_id: o.error_code for o in outs if o.error_code} == {"late": "request_timeout",
                                                                         "queued": "request_timeout"}
    assert any(o.request_id == "free" and o.finish_reason == "length" for o in outs)
    assert eng.pool.allocator.num_used == 0 and not eng.requests


def test_cpu_default_chunk_lets_a_running_stream_step_during_a_long_prefill():
    """On a CPU a prefill chunk takes seconds: the default chunk is small enough that a running stream gets a token
    at least every 512 prompt tokens of another request (fresh-user report: 2048-token chunks stalled streams ~20 s)."""
    cfg = fake_config(max_len=4096)
    ec = EngineConfig(device="cpu", page_size=16, num_pages=512, max_running_requests=4)
    eng = engine_for_model(FakeModel(cfg), cfg, ec, device=torch.device("cpu"), dtype=torch.float32)
    eng.add_request("stream", [1, 2, 3], greedy(64))
    eng.step()
    eng.add_request("long", [random.Random(7).randrange(1, 32) for _ in range(3000)], greedy(1))
    long = eng.requests["long"]
    steps = 0
    while long.num_computed_tokens < 3000:
        before = long.num_computed_tokens
        outs = eng.step()
        steps += 1
        assert [o for o in outs if o.request_id == "stream"], "the running stream got no token in this step"
        assert long.num_computed_tokens - before <= 512
    assert steps >= 3000 // 512
