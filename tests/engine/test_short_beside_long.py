"""A short prompt that arrives during a long prompt's prefill starts in the next step, not after the whole prompt;
the long prompt loses at most one step to it (issue 47 item 5)."""

from __future__ import annotations

from ferrylm.engine.cache.page_allocator import PageAllocator
from ferrylm.engine.request import Request
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.scheduler import Scheduler, SchedulerConfig

BUDGET = 2048
PAGE = 16


def _req(rid: str, prompt: int, max_tokens: int = 1) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def _run(arrivals: dict[int, list[Request]], steps: int = 40) -> dict[str, list[int]]:
    """Drive the scheduler (counters catch up as the engine's would); the steps each request computed in."""
    sched = Scheduler(SchedulerConfig(8, BUDGET, PAGE), PageAllocator(4096))
    seen: dict[str, list[int]] = {}
    for step in range(steps):
        for r in arrivals.get(step, []):
            sched.add(r)
        batch = sched.schedule()
        assert batch.num_tokens <= BUDGET
        for s in batch.seqs:
            r = s.request
            seen.setdefault(r.request_id, []).append(step)
            r.num_computed_tokens += s.num_tokens
            if s.sample:
                r.output_token_ids.append(7)
                if r.num_output_tokens >= r.params.max_tokens:
                    sched.finish(r, "length")
        sched.check_invariants()
        if not sched.has_work():
            break
    return seen


def test_a_short_prompt_starts_in_the_step_after_it_arrives():
    seen = _run({0: [_req("long", 7500)], 1: [_req("short", 20)]})
    assert seen["short"][0] == 1                      # was: after the long prompt's last chunk (step 3)
    alone = _run({0: [_req("long", 7500)]})
    assert seen["long"][-1] - alone["long"][-1] <= 1  # the long prompt loses at most one step


def test_a_waiting_long_prompt_does_not_slice_the_running_one():
    seen = _run({0: [_req("a", 7500)], 1: [_req("b", 4000)]})
    alone = _run({0: [_req("a", 7500)]})
    assert seen["a"] == alone["a"]                    # b (over a quarter of the budget) waits for a's chunks
    assert seen["b"][0] > alone["a"][-1] - 1


def test_short_prompts_share_a_quarter_of_the_budget():
    shorts = [_req(f"s{i}", 300) for i in range(4)]
    seen = _run({0: [_req("long", 7500)], 1: shorts})
    started = sorted(seen[f"s{i}"][0] for i in range(4))
    assert started[0] == 1 and started[1] == 2       # 512 tokens a step: one 300-token prompt per step
