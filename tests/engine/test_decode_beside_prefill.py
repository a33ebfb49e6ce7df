"""Long prompts beside running streams (issue 23): every running request with one token to compute gets it in
every step, whatever long prompts are being prefilled beside it, and a step never exceeds the token budget.
The scheduler is driven directly over a page allocator, as in test_fairness.py."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrylm.engine.cache.page_allocator import PageAllocator
from ferrylm.engine.request import Request, Status
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.scheduler import Scheduler, SchedulerConfig

PAGE = 4
BUDGET = 32


def _step(sched: Scheduler) -> None:
    decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens == 1]
    batch = sched.schedule()
    planned = {id(s.request) for s in batch.seqs}
    for r in decoding:
        if r.status == Status.RUNNING:
            assert id(r) in planned, f"{r.request_id} (decoding) left out of a step"
    assert batch.num_tokens <= BUDGET
    for s in batch.seqs:
        r = s.request
        r.num_computed_tokens += s.num_tokens
        if s.sample:
            r.output_token_ids.append(3)
            if r.num_output_tokens >= r.params.max_tokens:
                sched.finish(r, "length")
    sched.check_invariants()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 120), st.integers(1, 20)), min_size=1,
                         max_size=12), order_long_first=st.booleans())
def test_decodes_run_in_every_step_beside_long_prefills(arrivals, order_long_first):
    sched = Scheduler(SchedulerConfig(6, BUDGET, PAGE), PageAllocator(200))
    arrivals = sorted(arrivals, key=lambda a: (a[0], -a[1] if order_long_first else a[1]))
    k = 0
    for step in range(400):
        while k < len(arrivals) and arrivals[k][0] <= step:
            _, prompt, mt = arrivals[k]
            sched.add(Request(f"r{k}", [1 + (k + j) % 20 for j in range(prompt)],
                              SamplingParams(max_tokens=mt, temperature=0.0)))
            k += 1
        if k == len(arrivals) and not sched.has_work():
            break
        _step(sched)
    assert not sched.has_work()


def test_a_long_prefill_ahead_in_the_running_list_leaves_room_for_decodes():
    alloc = PageAllocator(200)
    sched = Scheduler(SchedulerConfig(4, BUDGET, PAGE), alloc)
    long_ = Request("long", [5] * 300, SamplingParams(max_tokens=2, temperature=0.0))
    streams = [Request(f"s{i}", [i + 1] * 3, SamplingParams(max_tokens=50, temperature=0.0)) for i in range(3)]
    for r in streams:
        r.num_computed_tokens = 2     # as if their prompts were computed but the last token: one to compute each
        r.page_table = alloc.allocate(1)
    sched.running = [long_] + streams   # the long prompt first in line (e.g. admitted earlier)
    for r in sched.running:
        r.status = Status.RUNNING
    steps = 0
    while long_.num_computed_tokens < 300:
        rest = 300 - long_.num_computed_tokens
        batch = sched.schedule()
        assert {s.request.request_id for s in batch.seqs} >= {"s0", "s1", "s2"}
        assert batch.num_tokens == min(BUDGET, rest + 3), "the chunk fills what the decodes leave"
        for s in batch.seqs:
            s.request.num_computed_tokens += s.num_tokens
            if s.sample:
                s.request.output_token_ids.append(3)
        sched.check_invariants()
        steps += 1
    assert steps == -(-300 // (BUDGET - 3))
