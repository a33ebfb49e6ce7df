"""Fairness of the scheduler (issue 18): a request that fits the pool is scheduled within a bounded number of
steps however many smaller requests keep arriving (aging), and an isolated request runs alone.

The scheduler is driven directly over a page allocator (no model): each step "computes" its plan (counters
advance, a sampling chunk appends one token, ``max_tokens`` finishes a request), as the engine would."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ferrylm.engine.cache.page_allocator import PageAllocator
from ferrylm.engine.request import Request
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.scheduler import Scheduler, SchedulerConfig

PAGE = 4
POOL_PAGES = 64          # 256 tokens
BUDGET = 256             # tokens per step (the big prompt fits one chunk)
RUNNING = 8
BIG_PROMPT = 200         # 50 pages: fits the pool, never the pages left while small requests run
MAX_SMALL_PROMPT = 40
MAX_SMALL_TOKENS = 12


def _req(rid: str, prompt: int, max_tokens: int, isolate: bool = False) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), isolate=isolate)


def _advance(sched: Scheduler, step: int, first_step: dict[str, int]) -> None:
    """Compute one planned step: counters catch up, sampling chunks produce a token, finished requests leave."""
    batch = sched.schedule()
    for s in batch.seqs:
        first_step.setdefault(s.request.request_id, step)
    for s in batch.seqs:
        r = s.request
        r.num_computed_tokens += s.num_tokens
        if s.sample:
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.params.max_tokens:
                sched.finish(r, "length")
    sched.check_invariants()


@dataclass
class Wait:
    """How the big request fared: ``steps`` from its arrival to its first step (None: not within the run),
    ``ahead`` requests waiting or running when it arrived, ``overtakes`` requests that arrived after it and were
    scheduled before it."""

    steps: int | None
    ahead: int
    overtakes: int


def wait_of_big(arrivals: list[list[tuple[int, int]]], aging_rounds: int, max_steps: int = 400,
                warm_steps: int = 6) -> Wait:
    """Run the scheduler while ``arrivals[i % len]`` (prompt, max_tokens) small requests arrive at every step
    ``i``; the big request arrives at step ``warm_steps``, when the small ones fill the pool."""
    sched = Scheduler(SchedulerConfig(RUNNING, BUDGET, PAGE, aging_rounds=aging_rounds), PageAllocator(POOL_PAGES))
    ids = itertools.count()
    first_step: dict[str, int] = {}
    arrived: dict[str, int] = {}
    ahead = 0
    for step in range(max_steps):
        for p, m in arrivals[step % len(arrivals)]:
            rid = f"s{next(ids)}"
            arrived[rid] = step
            sched.add(_req(rid, p, m))
        if step == warm_steps:
            ahead = len(sched.waiting) + len(sched.running)
            arrived["big"] = step
            sched.add(_req("big", BIG_PROMPT, 4))
        _advance(sched, step, first_step)
        if "big" in first_step:
            break
    end = first_step.get("big")
    later = [r for r, t in arrived.items() if r != "big" and t > warm_steps]   # same step: added before it
    overtakes = sum(1 for r in later if r in first_step and (end is None or first_step[r] <= end))
    return Wait(None if end is None else end - warm_steps, ahead, overtakes)


PER_REQUEST = -(-MAX_SMALL_PROMPT // BUDGET) + MAX_SMALL_TOKENS   # steps a small request needs once running


def check_bounded(w: Wait, aging_rounds: int) -> None:
    """The fairness property: at most ``(aging_rounds + 1) x RUNNING`` later arrivals overtake the big request,
    and its wait is bounded by the work of the requests ahead of it and of those overtakes, whatever else keeps
    arriving."""
    assert w.steps is not None, w
    assert w.overtakes <= (aging_rounds + 1) * RUNNING, w
    assert w.steps <= aging_rounds + 2 * (w.ahead + w.overtakes + RUNNING) * PER_REQUEST, w


small = st.tuples(st.integers(8, MAX_SMALL_PROMPT), st.integers(1, MAX_SMALL_TOKENS))
HEAVY = [[(40, 12), (36, 12), (40, 10)]] * 3 + [[(32, 12), (40, 12)]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(st.lists(small, min_size=1, max_size=4), min_size=1, max_size=8),
       aging_rounds=st.integers(0, 24))
@example(arrivals=HEAVY, aging_rounds=16)
def test_an_admissible_request_is_scheduled_within_a_bounded_wait(arrivals, aging_rounds):
    check_bounded(wait_of_big(arrivals, aging_rounds), aging_rounds)


def test_without_aging_the_heavy_stream_starves_the_big_request():
    # the scenario above is a real one: with aging off the big request is passed over for the whole run
    starved = wait_of_big(HEAVY, aging_rounds=10**9)
    assert starved.steps is None and starved.overtakes > 100, starved
    check_bounded(wait_of_big(HEAVY, aging_rounds=16), 16)


def test_an_isolated_request_waits_for_the_running_ones_then_runs_alone():
    sched = Scheduler(SchedulerConfig(RUNNING, BUDGET, PAGE), PageAllocator(POOL_PAGES))
    first_step: dict[str, int] = {}
    sched.add(_req("a", 8, 3))
    sched.add(_req("b", 8, 3))
    _advance(sched, 0, first_step)
    sched.add(_req("suspect", 8, 3, isolate=True))
    sched.add(_req("c", 8, 3))
    step = 1
    while sched.has_work():
        plan_running = [r.request_id for r in sched.running]
        _advance(sched, step, first_step)
        if any(r.request_id == "suspect" for r in sched.running):
            assert [r.request_id for r in sched.running] == ["suspect"], plan_running
        step += 1
        assert step < 100
    assert first_step["suspect"] > max(first_step["a"], first_step["b"])
    assert first_step["c"] > first_step["suspect"]   # nothing passed it, nothing ran beside it
