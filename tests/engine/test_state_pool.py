"""The recurrent-state pool of hybrid models: admission waits for a free slot, finish / abort / preemption give
the slot back through the scheduler's release path, the invariants catch a slot owned twice. (The engine surviving
an OOM inside the Gated DeltaNet scratch is in tests/models/test_qwen3_next.py, beside the checkpoints.)"""

from __future__ import annotations

import pytest
import torch

from ferrylm.engine.cache.page_allocator import PageAllocator
from ferrylm.engine.request import Request, Status
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.scheduler import Scheduler, SchedulerConfig
from ferrylm.engine.cache.state_pool import StateLayout, StatePool

LAYOUT = StateLayout(layers=(0, 2), conv_channels=8, conv_kernel=4, heads=2, key_dim=4, value_dim=4)


def _req(rid: str, n: int = 6) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def _scheduler(slots: int, pages: int = 64, running: int = 4) -> Scheduler:
    pool = StatePool(LAYOUT, slots, torch.float32, "cpu")
    return Scheduler(SchedulerConfig(max_running_requests=running, max_prefill_length=64, page_size=4),
                     PageAllocator(pages), state_pool=pool)


def test_pool_sizes_and_bytes():
    pool = StatePool(LAYOUT, 3, torch.bfloat16, "cpu")
    assert pool.conv[0].shape == (4, 3, 8) and pool.rec[2].shape == (4, 2, 4, 4) and 1 not in pool.conv
    assert LAYOUT.bytes_per_slot(torch.bfloat16) == 2 * (3 * 8 * 2 + 2 * 4 * 4 * 4)
    assert pool.nbytes == 4 * LAYOUT.bytes_per_slot(torch.bfloat16)   # three slots + the scratch slot
    assert pool.scratch == 3
    taken = [pool.allocate() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(Exception, match="taken"):
        pool.allocate()
    pool.free(1)
    with pytest.raises(AssertionError):
        pool.free(1)


def test_a_full_state_pool_makes_requests_wait_not_fail():
    sched = _scheduler(slots=2)
    reqs = [_req(f"r{i}") for i in range(3)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert [s.request.request_id for s in batch.seqs] == ["r0", "r1"]
    assert reqs[2].status is Status.WAITING and reqs[2].state_slot is None and not reqs[2].page_table
    sched.check_invariants()
    sched.finish(reqs[0], "stop")              # its slot comes back: the waiting request gets it next plan
    assert reqs[0].state_slot is None
    for s in batch.seqs:
        s.request.num_computed_tokens += s.num_tokens
    batch = sched.schedule()
    assert "r2" in [s.request.request_id for s in batch.seqs] and reqs[2].state_slot is not None
    sched.check_invariants()


def test_slots_come_back_on_abort_and_preemption():
    sched = _scheduler(slots=3)
    reqs = [_req(f"r{i}") for i in range(3)]
    for r in reqs:
        sched.add(r)
    sched.schedule()
    assert sched.state_pool.num_free == 0
    sched.preempt(reqs[2])
    assert reqs[2].state_slot is None and reqs[2].num_computed_tokens == 0 and sched.state_pool.num_free == 1
    sched.finish(reqs[1], "abort")
    assert sched.state_pool.num_free == 2
    sched.check_invariants()
    sched.finish(reqs[2], "abort")              # a waiting (preempted) request holds nothing to give back
    sched.finish(reqs[0], "length")
    assert sched.state_pool.num_free == 3
    sched.check_invariants()


def test_invariants_catch_a_slot_owned_twice_and_a_running_request_without_one():
    sched = _scheduler(slots=3)
    a, b = _req("a"), _req("b")
    sched.add(a)
    sched.add(b)
    sched.schedule()
    b_slot, b.state_slot = b.state_slot, a.state_slot
    with pytest.raises(AssertionError, match="twice"):
        sched.check_invariants()
    b.state_slot = None
    with pytest.raises(AssertionError, match="no state slot"):
        sched.check_invariants()
    b.state_slot = b_slot
    sched.check_invariants()


def test_page_shortage_preemption_releases_the_state_slot():
    """Few pages: growing the running requests preempts the newest, whose slot goes back with its pages."""
    sched = _scheduler(slots=3, pages=5, running=3)
    reqs = [_req(f"r{i}", n=6) for i in range(3)]
    for r in reqs:
        sched.add(r)
    for _ in range(12):
        batch = sched.schedule()
        for s in batch.seqs:
            s.request.num_computed_tokens += s.num_tokens
            if s.sample:
                s.request.output_token_ids.append(1)
        sched.check_invariants()
        if sched.num_preemptions:
            break
    assert sched.num_preemptions > 0
    for r in sched.waiting:
        assert r.state_slot is None
    assert sched.state_pool.num_free == 3 - len(sched.running)



def test_the_plan_counts_one_state_slot_per_running_request():
    """The recurrent state comes out of the budget before the KV pool: (max_running_requests + 1) slots, shown in
    the plan's table; a state that does not fit is a boot error naming it."""
    from tests.memory.test_plan import inputs

    from ferrylm.memory.budget import MemoryPlanError
    from ferrylm.memory.plan import plan_memory
    from ferrylm.memory.probe import GiB, MiB

    per_slot = LAYOUT.bytes_per_slot(torch.bfloat16) * 100_000           # ~ 16 MiB, a real model's size
    base = plan_memory(inputs(num_tokens=None))
    with_state = plan_memory(inputs(state_slot_bytes=per_slot))
    assert with_state.state_slots == 17 and with_state.state_bytes == 17 * per_slot
    assert with_state.kv_bytes + with_state.state_bytes <= base.kv_bytes
    assert base.kv_bytes - with_state.kv_bytes >= with_state.state_bytes - with_state.kv_bytes_per_token * 16
    table = with_state.format_table()
    assert "recurrent state" in table and "17 x" in table
    assert "none (no linear-attention layers)" in base.format_table()
    assert with_state.minimum_bytes == base.minimum_bytes + 17 * per_slot
    with pytest.raises(MemoryPlanError, match="recurrent state"):
        plan_memory(inputs(state_slot_bytes=5 * GiB, max_running_requests=15, weights_bytes=10 * GiB + 512 * MiB))


def test_snapshots_evict_least_recently_used_and_restore_exact_states():
    from ferrylm.engine.cache.state_snapshots import StateSnapshots

    pool = StatePool(LAYOUT, 3, torch.float32, "cpu")
    snaps = StateSnapshots(pool, capacity=2)
    for slot in range(3):
        for layer in LAYOUT.layers:
            pool.conv[layer][slot].fill_(slot + 1)
            pool.rec[layer][slot].fill_(10 * (slot + 1))
    snaps.save(b"a", 0)
    snaps.save(b"b", 1)
    snaps.restore(b"a", 2)                      # "a" used again: "b" is now the least recently used
    assert float(pool.conv[0][2].max()) == 1 and float(pool.rec[2][2].min()) == 10
    snaps.save(b"c", 2)
    assert snaps.has(b"a") and snaps.has(b"c") and not snaps.has(b"b") and snaps.evictions == 1
    assert snaps.usable([b"x", b"a", b"b"], 3) == 2 and snaps.usable([b"b"], 1) == 0
    snaps.check()
    with pytest.raises(KeyError):
        snaps.restore(b"b", 0)


def test_turn_points_are_evicted_after_page_boundary_snapshots():
    from ferrylm.engine.cache.state_snapshots import StateSnapshots

    snaps = StateSnapshots(StatePool(LAYOUT, 2, torch.float32, "cpu"), capacity=2)
    snaps.save(b"turn", 0, turn=True)
    snaps.save(b"p1", 1)
    snaps.save(b"p2", 1)                        # evicts p1 although "turn" is older
    assert snaps.has(b"turn") and snaps.has(b"p2") and not snaps.has(b"p1")
    snaps.save(b"turn2", 0, turn=True)          # evicts p2
    snaps.save(b"turn3", 0, turn=True)          # only turn points left: the least recently used goes
    assert not snaps.has(b"turn") and snaps.has(b"turn2") and snaps.has(b"turn3")
    assert snaps.stats()["turn_points"] == 2
    snaps.check()
