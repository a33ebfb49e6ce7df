"""The memory plan with fake readings: explicit sizes win, the reserve is never handed out, infeasible plans fail
at boot with the numbers, the processes holding the memory and the right flag."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.memory.budget import MemoryBudget, MemoryPlanError, default_reserve
from ferrylm.memory.plan import ExpertNeeds, PlanInputs, plan_memory
from ferrylm.memory.probe import GiB, MiB, ProcessUsage

PER_TOK = 128 * 1024   # K+V bytes per token (a mid-size model)


BUDGET_FIELDS = frozenset(f.name for f in dataclasses.fields(MemoryBudget))


def inputs(**kw) -> PlanInputs:
    """Plan inputs for a mid-size model on an 80 GiB card; ``kw`` overrides any field, of the budget too."""
    base = dict(kind="cuda", total_bytes=80 * GiB, free_at_boot_bytes=79 * GiB, memory_ratio=0.9,
                gpu_memory_limit_bytes=None, memory_reserve_bytes=None, weights_bytes=10 * GiB,
                workspace_bytes=2 * GiB, workspace_source="measured", kv_bytes_per_token=PER_TOK, page_size=16,
                max_model_len=32768, max_running_requests=16, max_prefill_length=8192)
    base.update(kw)
    budget = MemoryBudget(**{k: base.pop(k) for k in BUDGET_FIELDS if k in base})
    return PlanInputs(budget, **base)


EXPERTS = ExpertNeeds(slot_bytes=64 * MiB, fixed_bytes=2 * GiB, total_experts=48 * 128, min_slots=1)


def handed_out(p) -> int:
    return p.weights_bytes + p.workspace_bytes + p.kv_bytes + p.expert_bytes


def test_default_plan_budget_and_table():
    p = plan_memory(inputs())
    # one cut of what ferrylm may use (the free memory): the ratio sets the reserve's share, not a second cut
    assert p.reserve_bytes == default_reserve(79 * GiB, 0.9) == round(0.1 * 79 * GiB)
    assert p.budget_bytes == 79 * GiB - p.reserve_bytes
    assert p.kv_tokens == p.kv_pages * 16 and p.kv_bytes == p.kv_tokens * PER_TOK
    assert handed_out(p) + p.headroom_bytes == p.budget_bytes
    assert p.kv_tokens <= 16 * 32768
    table = p.format_table()
    for row in ("device total", "free at boot", "reserve", "weights", "workspace", "KV pool", "expert slots",
                "headroom"):
        assert row in table
    json.dumps(p.to_dict())  # served at /v1/memory


def test_small_reserve_default_is_half_a_gib():
    assert default_reserve(4 * GiB) == GiB // 2 and default_reserve(40 * GiB, 0.9) == 4 * GiB


def test_explicit_kv_sizes_win():
    p = plan_memory(inputs(num_tokens=1000))
    assert p.kv_tokens == 1008 and p.kv_pages == 63            # rounded up to whole pages
    p = plan_memory(inputs(num_pages=10, num_tokens=100000))   # pages win over tokens
    assert p.kv_pages == 10
    p = plan_memory(inputs(num_tokens=1000, experts=EXPERTS))  # experts take the rest
    assert p.kv_tokens == 1008
    assert p.expert_slots == min(EXPERTS.total_experts,
                                 (p.budget_bytes - 12 * GiB - p.kv_bytes - 2 * GiB) // (64 * MiB))


def test_explicit_cache_size_wins_and_kv_takes_the_rest():
    p = plan_memory(inputs(moe_cache_size=100, experts=EXPERTS))
    assert p.expert_slots == 100 and p.expert_bytes == 100 * 64 * MiB + 2 * GiB
    assert p.kv_tokens > 0 and handed_out(p) <= p.budget_bytes


def test_moe_cache_auto_gives_kv_its_floor_and_experts_the_rest():
    p = plan_memory(inputs(moe_cache_auto=True, kv_reserve_tokens=20000, experts=EXPERTS))
    assert p.kv_tokens == 20000
    assert p.expert_slots == (p.budget_bytes - 12 * GiB - 20000 * PER_TOK - 2 * GiB) // (64 * MiB)
    # every expert fits: what they leave goes back to the KV pool
    few = ExpertNeeds(slot_bytes=64 * MiB, fixed_bytes=0, total_experts=10, min_slots=1)
    p = plan_memory(inputs(moe_cache_auto=True, kv_reserve_tokens=20000, experts=few))
    room = (p.budget_bytes - 12 * GiB - 10 * 64 * MiB) // PER_TOK
    assert p.expert_slots == 10 and p.kv_tokens == room // 16 * 16 > 20000


@settings(max_examples=200, deadline=None)
@given(total=st.integers(8, 200), free_pct=st.integers(10, 100), ratio=st.floats(0.3, 1.0),
       weights=st.integers(0, 40), ws=st.integers(0, 8), reserve=st.one_of(st.none(), st.integers(0, 8)),
       limit=st.one_of(st.none(), st.integers(4, 200)), auto=st.booleans(), experts=st.booleans(),
       kv_explicit=st.one_of(st.none(), st.integers(16, 200_000)))
def test_the_reserve_is_never_handed_out(total, free_pct, ratio, weights, ws, reserve, limit, auto, experts,
                                         kv_explicit):
    free = total * GiB * free_pct // 100
    try:
        p = plan_memory(inputs(total_bytes=total * GiB, free_at_boot_bytes=free, memory_ratio=ratio,
                               weights_bytes=weights * GiB // 4, workspace_bytes=ws * GiB // 8,
                               memory_reserve_bytes=None if reserve is None else reserve * GiB // 4,
                               gpu_memory_limit_bytes=None if limit is None else limit * GiB,
                               moe_cache_auto=auto, experts=EXPERTS if experts else None, num_tokens=kv_explicit))
    except MemoryPlanError as e:
        assert "To fix:" in str(e)
        return
    assert reserve is not None or p.reserve_bytes >= 512 * MiB
    assert handed_out(p) <= free - p.reserve_bytes
    assert handed_out(p) + p.headroom_bytes <= p.budget_bytes
    if limit is not None:
        assert handed_out(p) <= limit * GiB - p.reserve_bytes
    assert (kv_explicit is not None or p.kv_tokens >= 512) and p.headroom_bytes >= 0


def test_explicit_kv_that_does_not_fit_fails_with_numbers():
    with pytest.raises(MemoryPlanError) as ei:
        plan_memory(inputs(num_tokens=500_000))
    msg = str(ei.value)
    assert "--num-tokens" in msg and "500000 tokens need 61.04 GiB" in msg
    assert "only" in msg and "free at boot" in msg and "raise --memory-ratio" in msg


def test_explicit_cache_that_does_not_fit_fails():
    with pytest.raises(MemoryPlanError, match="--moe-cache-size 2000 needs 127.00 GiB"):
        plan_memory(inputs(moe_cache_size=2000, experts=EXPERTS))


def test_memory_held_by_others_names_them_and_never_says_raise_memory_ratio():
    others = (ProcessUsage(4242, "python grab.py", 70 * GiB),)
    with pytest.raises(MemoryPlanError) as ei:
        plan_memory(inputs(free_at_boot_bytes=9 * GiB, other_processes=others))
    msg = str(ei.value)
    assert "pid 4242 (python grab.py) 70.00 GiB" in msg and "held by others" in msg
    assert "free that memory" in msg and "--memory-ratio (now" not in msg and "raise --memory-ratio" not in msg
    assert "weights (10.00 GiB)" in msg and "9.00 GiB free at boot of 80.00 GiB" in msg


def test_held_by_others_without_nvml_still_not_ratio():
    with pytest.raises(MemoryPlanError) as ei:
        plan_memory(inputs(free_at_boot_bytes=9 * GiB))
    assert "processes nvidia-ml-py cannot list" in str(ei.value) and "raise --memory-ratio" not in str(ei.value)


def test_limit_binding_names_the_limit():
    from ferrylm.memory.budget import limit_reserve

    p = plan_memory(inputs(gpu_memory_limit_bytes=30 * GiB))
    # the allocator is capped at the limit: the plan keeps a reserve inside it (fragmentation, lazy buffers)
    assert p.budget_bytes == 30 * GiB - limit_reserve(30 * GiB) == 30 * GiB - int(1.5 * GiB)
    assert p.binding == "limit" and p.reserve_bytes == int(1.5 * GiB)
    assert "--gpu-memory-limit - reserve" in p.format_table()
    assert plan_memory(inputs(gpu_memory_limit_bytes=30 * GiB, memory_reserve_bytes=GiB)).budget_bytes == 29 * GiB
    with pytest.raises(MemoryPlanError, match="raise --gpu-memory-limit"):
        plan_memory(inputs(gpu_memory_limit_bytes=11 * GiB))


def test_kv_floor_and_context_warning():
    with pytest.raises(MemoryPlanError, match="--kv-reserve-tokens"):
        plan_memory(inputs(kv_reserve_tokens=10_000_000))
    p = plan_memory(inputs(num_tokens=4096))
    (w,) = [w for w in p.warnings if "fewer than the model context of 32768" in w]
    # what admission does (engine/admission.py): only a prompt the pool cannot hold is rejected; a longer request
    # is cut when it outgrows the pool
    assert "a prompt of 4096 tokens or more is rejected" in w and "finish_reason length" in w, w
    assert "longer requests are rejected" not in w


def test_the_short_pool_warning_is_one_rule():   # the plan and engine_for_model both say it
    from ferrylm.memory.plan import short_pool_warning

    assert short_pool_warning(4096, 4096) is None and short_pool_warning(8192, 4096) is None
    assert short_pool_warning(4096, 32768) == plan_memory(inputs(num_tokens=4096)).warnings[0]


def test_host_plan_caps_the_automatic_kv_pool():
    p = plan_memory(inputs(kind="host", total_bytes=24 * GiB, free_at_boot_bytes=20 * GiB, weights_bytes=GiB,
                           workspace_bytes=0, host_kv_fraction=0.05))
    assert p.kv_bytes <= GiB and p.kv_tokens >= 512


def test_boot_checks_before_the_weights_load():
    from ferrylm.memory.budget import check_budget
    from ferrylm.memory.plan import boot_failure

    others = (ProcessUsage(77, "trainer", 78 * GiB),)
    with pytest.raises(MemoryPlanError, match="nothing is left for the weights.*pid 77 \\(trainer\\)"):
        check_budget(inputs(free_at_boot_bytes=256 * MiB, other_processes=others).budget)
    check_budget(inputs().budget)
    e = boot_failure(inputs(free_at_boot_bytes=5 * GiB, other_processes=others),
                     "loading the weights ran out of memory (CUDA out of memory)", smaller="the model size")
    assert "loading the weights ran out of memory" in str(e) and "pid 77" in str(e)
    assert "raise --memory-ratio" not in str(e) and "lower the model size" in str(e)


def test_default_kv_floor_is_the_context_when_the_experts_keep_a_tenth():
    """Issue 15: with an expert cache the KV pool gets a floor and the experts the rest by default (the KV pool no
    longer takes max_running_requests x context and leaves the experts one slot)."""
    p = plan_memory(inputs(experts=EXPERTS, max_running_requests=64))
    assert p.kv_tokens == 32768                                  # the model context, not 64 x 32768
    assert p.expert_slots >= EXPERTS.total_experts // 10
    assert p.expert_slots == (p.budget_bytes - 12 * GiB - p.kv_bytes - 2 * GiB) // (64 * MiB)


def test_default_kv_floor_falls_back_to_a_chunk_plus_short_requests_on_a_small_budget():
    from ferrylm.memory.plan import SHORT_REQUEST_TOKENS

    # 24 GiB: the context (4 GiB of KV) would leave the experts fewer than a tenth of the slots
    small = dict(gpu_memory_limit_bytes=24 * GiB, weights_bytes=3 * GiB, workspace_bytes=GiB,
                 max_model_len=32768, experts=EXPERTS)
    p = plan_memory(inputs(**small))
    assert p.kv_tokens == 8192 + 16 * SHORT_REQUEST_TOKENS
    assert p.expert_slots == (p.budget_bytes - 4 * GiB - p.kv_bytes - 2 * GiB) // (64 * MiB)
    assert p.expert_slots > (p.budget_bytes - 4 * GiB - 32768 * PER_TOK - 2 * GiB) // (64 * MiB)
    # an explicit floor wins either way
    assert plan_memory(inputs(kv_reserve_tokens=20000, **small)).kv_tokens == 20000


def test_kv_floor_above_what_requests_can_use_is_honoured():
    p = plan_memory(inputs(max_running_requests=1, max_model_len=256, kv_reserve_tokens=4096))
    assert p.kv_tokens == 4096


# --- issue 26: a GPU that others share ---------------------------------------------------------------------
STEP = ExpertNeeds(slot_bytes=9 * MiB, fixed_bytes=512 * MiB, total_experts=48 * 128, min_slots=8, step_slots=64)


def shared(free_gib: float, **kw) -> PlanInputs:
    """Qwen3-30B-A3B-like on a 140 GiB card that another process mostly holds."""
    base = dict(total_bytes=140 * GiB, free_at_boot_bytes=int(free_gib * GiB), weights_bytes=int(2.9 * GiB),
                workspace_bytes=515 * MiB, max_model_len=40960, max_running_requests=16, max_prefill_length=8192,
                experts=STEP, other_processes=(ProcessUsage(9, "other model", int((140 - free_gib) * GiB)),))
    base.update(kw)
    return inputs(**base)


def test_reserve_scales_with_the_free_memory_not_the_card():
    """10 GiB free on a 140 GiB card: the reserve was 7 GiB (5 % of the card) and the 0.9 ratio cut again (budget
    2 GiB, no boot); now the reserve is a tenth of the free memory, cut once."""
    p = plan_memory(shared(10))
    assert p.reserve_bytes == GiB and p.budget_bytes == 9 * GiB
    assert p.expert_slots >= STEP.step_slots and p.kv_tokens >= 512


@pytest.mark.parametrize("free", [10, 16, 24])
def test_boots_at_each_free_size_with_more_given_to_the_largest(free):
    p = plan_memory(shared(free))
    assert p.budget_bytes == free * GiB - max(512 * MiB, round(0.1 * free * GiB))
    assert handed_out(p) <= p.budget_bytes


def test_a_limit_above_the_free_memory_follows_the_free_memory():
    p = plan_memory(shared(10, gpu_memory_limit_bytes=24 * GiB))
    assert p.binding != "limit" and p.budget_bytes == 9 * GiB
    assert "above the free memory" in p.format_table()
    q = plan_memory(shared(100, gpu_memory_limit_bytes=12 * GiB))   # a limit below: the limit binds, no ratio cut
    assert q.binding == "limit" and q.budget_bytes == 12 * GiB - int(0.6 * GiB)


def test_explicit_reserve_is_one_cut_too():
    p = plan_memory(shared(10, memory_reserve_bytes=2 * GiB))
    assert p.reserve_bytes == 2 * GiB and p.budget_bytes == 8 * GiB and "--memory-reserve" in p.reserve_note


def test_the_kv_floor_gives_way_to_one_decode_steps_slots():
    """Default flags: the KV pool's default floor (a chunk + short requests) would leave fewer slots than one decode
    step needs; it gives way down to its minimum and the server boots."""
    big_step = ExpertNeeds(slot_bytes=64 * MiB, fixed_bytes=0, total_experts=48 * 128, min_slots=1, step_slots=48)
    small = inputs(free_at_boot_bytes=int(9.5 * GiB), weights_bytes=4 * GiB, workspace_bytes=GiB, experts=big_step,
                   max_model_len=32768, max_prefill_length=8192)
    p = plan_memory(small)
    assert p.expert_slots >= 48 and 512 <= p.kv_tokens < 8192 + 16 * 256


def test_below_the_minimum_the_error_names_the_holders_and_the_minimum():
    with pytest.raises(MemoryPlanError) as e:
        plan_memory(shared(4))
    msg = str(e.value)
    assert "pid 9 (other model)" in msg and "held by others" in msg
    assert "needs a budget of at least" in msg
    p = shared(4)
    from ferrylm.memory.budget import gib
    from ferrylm.memory.plan import minimum_bytes

    m = minimum_bytes(p)
    assert gib(m) in msg
    assert m == p.weights_bytes + p.workspace_bytes + 512 * PER_TOK + STEP.bytes_for(64)


def test_the_table_says_where_each_number_comes_from():
    table = plan_memory(shared(10)).format_table()
    for needle in ("CUDA driver", "measured before loading", "(1 - --memory-ratio 0.9) x free at boot",
                   "free at boot - reserve", "measured after loading", "measured at the prefill chunk",
                   "budget - the rows above", "minimum"):
        assert needle in table, (needle, table)


def test_expert_needs_fixed_bytes_hold_the_device_table():
    """The warmup reserves ``needs.bytes_for(min_slots)`` (``slot_needs``); ``plan_slots`` sets the stream buffers and the offload
    table aside first, so the needs must count both or the minimum cache does not fit its own budget (the GPU
    suite's offload cases failed with "budget 0.00 GiB" when the table was left out)."""
    from types import SimpleNamespace

    from ferrylm.experts.slots import ElasticSlots

    ex = SimpleNamespace(layout=SimpleNamespace(nbytes=1000), banks=SimpleNamespace(layers=[0, 1]), num_experts=4,
                         min_slots=2, name="offload", stream_bytes=lambda: 8000, table_bytes=lambda: 333,
                         options=SimpleNamespace(cache_size=None, stream_prefill=True))
    needs = ElasticSlots.slot_needs(ex)
    assert needs.fixed_bytes == 8000 + 333
    assert ElasticSlots.plan_slots(ex, needs.bytes_for(needs.min_slots)) == 2


def test_mapped_file_bytes_sums_the_mappings_of_one_checkpoint(tmp_path):
    from ferrylm.memory.probe import mapped_file_bytes

    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    maps = tmp_path / "maps"
    maps.write_text(
        f"7f0000000000-7f0000100000 r--s 00000000 08:01 12 {model}\n"
        f"7f0000200000-7f0000204000 r--s 00100000 08:01 12 {model}\n"
        f"7f0000300000-7f0000400000 r--s 00000000 08:01 13 {tmp_path}/m.gguf.other\n"
        "7f0000500000-7f0000600000 rw-p 00000000 00:00 0 \n")
    assert mapped_file_bytes(model, maps=str(maps)) == 0x100000 + 0x4000
    assert mapped_file_bytes(tmp_path / "absent", maps=str(maps)) == 0
    assert mapped_file_bytes(model, maps=str(tmp_path / "no-such-maps")) == 0
