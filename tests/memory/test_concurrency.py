"""The default --max-running-requests (issue 47 item 2): the most typical requests (1024 tokens, or the context
when shorter) the memory plan's KV pool holds, 1 to 256; an explicit flag wins; the plan table, the plan's dict
(GET /v1/memory) and the engine's limits, scheduler and graph sizes carry the number."""

from __future__ import annotations

import pytest
import torch

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import build_engine, engine_for_model
from ferrylm.memory.concurrency import (MAX_RUNNING_REQUESTS, STATE_SHARE_OF_CACHE, TYPICAL_REQUEST_TOKENS,
                                        carries, choose_running_requests)
from ferrylm.memory.budget import MemoryPlanError
from ferrylm.memory.plan import ExpertNeeds, plan_memory
from ferrylm.memory.probe import GiB, MiB
from tests.memory.conftest import SHORT, run
from tests.memory.test_plan import inputs


def _choose(**kw) -> int:
    return choose_running_requests(lambda n: inputs(max_running_requests=n, **kw)).n


def _is_largest(n: int, **kw) -> bool:
    """``n`` carries itself and ``n + 1`` does not (or ``n`` is the cap)."""
    def ok(m: int) -> bool:
        try:
            return carries(plan_memory(inputs(max_running_requests=m, **kw)), m)
        except MemoryPlanError:
            return False
    return ok(n) and (n == MAX_RUNNING_REQUESTS or not ok(n + 1))


@pytest.mark.parametrize("free_gib", [14.5, 20, 40])
def test_a_bigger_pool_carries_more_requests(free_gib):
    n = _choose(free_at_boot_bytes=int(free_gib * GiB))
    plan = plan_memory(inputs(free_at_boot_bytes=int(free_gib * GiB), max_running_requests=n))
    assert plan.kv_tokens // TYPICAL_REQUEST_TOKENS == n   # resident: the pool takes the room, n fit in it
    assert _is_largest(n, free_at_boot_bytes=int(free_gib * GiB))
    assert 1 < _choose(free_at_boot_bytes=int(14.5 * GiB)) < _choose(free_at_boot_bytes=20 * GiB) \
        < _choose(free_at_boot_bytes=40 * GiB)


def test_a_huge_pool_stops_at_the_cap_and_a_tiny_one_at_one():
    assert _choose() == MAX_RUNNING_REQUESTS == 256             # 79 GiB free: ~470k tokens of KV
    # ~105 MiB left after weights and workspace: ~850 tokens, less than one 1024-token request
    tiny = dict(free_at_boot_bytes=int(13.45 * GiB))
    assert plan_memory(inputs(max_running_requests=1, **tiny)).kv_tokens < TYPICAL_REQUEST_TOKENS
    choice = choose_running_requests(lambda n: inputs(max_running_requests=n, **tiny))
    assert choice.n == 1 and "less than one 1024-token request" in choice.note


def test_a_short_context_is_the_typical_request():
    # 4096 tokens of KV: four 1024-token requests, or sixteen when the context is 256 tokens
    assert _choose(num_tokens=4096, max_model_len=4096) == 4
    assert _choose(num_tokens=4096, max_model_len=256) == 16


def test_with_an_expert_cache_the_kv_floor_sets_it():
    """The KV floor beside an expert cache is one chunk plus a short request per running request, so the number
    is where that floor stops holding typical requests; the experts keep the rest."""
    experts = ExpertNeeds(slot_bytes=64 * MiB, fixed_bytes=2 * GiB, total_experts=48 * 128, min_slots=1)
    kw = dict(experts=experts, free_at_boot_bytes=40 * GiB)
    n = _choose(**kw)
    plan = plan_memory(inputs(max_running_requests=n, **kw))
    assert plan.kv_tokens >= n * TYPICAL_REQUEST_TOKENS and _is_largest(n, **kw)
    assert plan.expert_slots > 200 and n < 16


def test_recurrent_state_takes_no_more_than_the_kv_pool():
    kw = dict(state_slot_bytes=200 * MiB, state_snapshots=0, free_at_boot_bytes=40 * GiB)
    n = _choose(**kw)
    plan = plan_memory(inputs(max_running_requests=n, **kw))
    assert plan.state_bytes <= plan.kv_bytes and _is_largest(n, **kw)
    assert n < _choose(free_at_boot_bytes=40 * GiB)   # the state of each request counts


def test_recurrent_state_beside_a_missing_expert_cache_takes_a_tenth_of_its_room():
    """A hybrid model whose experts do not all fit: the state of the running requests takes at most
    ``STATE_SHARE_OF_CACHE`` of the bytes it shares with the slots, fewer requests than the KV pool alone allows;
    with every expert resident the KV rule alone decides."""
    experts = ExpertNeeds(slot_bytes=64 * MiB, fixed_bytes=2 * GiB, total_experts=48 * 128, min_slots=1)
    # Qwen3.5-like: KV of 10 attention layers (20 KiB a token) with a floor of one full 256k context
    kw = dict(experts=experts, state_slot_bytes=64 * MiB, state_snapshots=0, free_at_boot_bytes=40 * GiB,
              kv_bytes_per_token=20 * 1024, max_model_len=262144, kv_reserve_tokens=262144)
    n = _choose(**kw)
    plan = plan_memory(inputs(max_running_requests=n, **kw))
    share = plan.state_bytes / (plan.state_bytes + plan.expert_slots * plan.expert_slot_bytes)
    assert share <= STATE_SHARE_OF_CACHE and _is_largest(n, **kw)
    over = plan_memory(inputs(max_running_requests=n + 1, **kw))
    assert over.state_bytes > STATE_SHARE_OF_CACHE * (over.state_bytes + over.expert_slots * over.expert_slot_bytes)
    assert over.kv_tokens >= (n + 1) * TYPICAL_REQUEST_TOKENS and over.state_bytes <= over.kv_bytes  # KV alone: more
    resident = dict(kw, experts=None)
    assert _choose(**resident) > n


# --- through the boot, on the CPU ---------------------------------------------------------------------------


def _boot(mixtral_dir, **kw):
    return build_engine(mixtral_dir, EngineConfig(device="cpu", max_prefill_length=64, **kw))


@pytest.mark.parametrize("tokens, want", [(1024, 4), (4096, 16)])
def test_boot_resolves_it_from_the_pool(mixtral_dir, tokens, want):
    """The tiny Mixtral's context is 256 tokens: a pool of N x 256 tokens runs N requests at once."""
    eng = _boot(mixtral_dir, num_tokens=tokens)
    plan = eng.memory_plan
    assert eng.limits.pool_tokens == tokens and eng.limits.max_running_requests == want
    assert eng.scheduler.config.max_running_requests == want and eng.runner.graph_max_batch == want
    assert plan.max_running_requests == want and plan.to_dict()["max_running_requests"] == want
    row = next(line for line in plan.format_table().splitlines() if "max running requests" in line)
    assert row.split()[3] == str(want) and "256-token requests the KV pool holds" in row
    prompts = {f"r{i}": SHORT for i in range(want + 2)}
    assert all(r["error"] is None for r in run(eng, prompts).values())


def test_boot_explicit_flag_wins(mixtral_dir):
    eng = _boot(mixtral_dir, num_tokens=4096, max_running_requests=3)
    assert eng.limits.max_running_requests == eng.memory_plan.max_running_requests == 3
    assert eng.runner.graph_max_batch == 3
    row = next(line for line in eng.memory_plan.format_table().splitlines() if "max running requests" in line)
    assert row.split()[3:] == ["3", "--max-running-requests"]


def test_engine_for_model_resolves_it_from_explicit_pages(offload_model):
    cfg = EngineConfig(device="cpu", page_size=16, num_pages=32, max_prefill_length=64)   # 512 tokens
    eng = engine_for_model(offload_model.model, offload_model.config, cfg, device=torch.device("cpu"),
                           dtype=torch.float32, expert_executor=offload_model.executor)
    assert eng.limits.max_running_requests == 2 == eng.scheduler.config.max_running_requests
