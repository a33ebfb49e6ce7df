"""The boot plan through the real boot (engine/boot.py) on the CPU: the warmup runs, the plan is logged and kept, the
engine is left clean; an infeasible plan is a boot error with the numbers."""

from __future__ import annotations

import json
import logging

import pytest

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import build_engine
from ferrylm.memory.budget import MemoryPlanError
from tests.memory.conftest import SHORT, run


def test_factory_plan_on_cpu(mixtral_dir, caplog):
    caplog.set_level(logging.INFO, logger="ferrylm.engine")
    eng = build_engine(mixtral_dir, EngineConfig(device="cpu", max_prefill_length=64, max_running_requests=4,
                                                 faults="logits:times=1"))
    plan = eng.memory_plan
    assert plan.kind == "host" and plan.workspace_source == "estimated" and plan.weights_bytes > 0
    assert plan.kv_tokens == eng.limits.pool_tokens == 4 * 256          # max_running x context, host-capped
    from ferrylm.memory.budget import default_reserve

    assert plan.reserve_bytes == default_reserve(plan.free_at_boot_bytes, 0.9)   # a tenth of the free memory
    assert plan.budget_bytes == plan.free_at_boot_bytes - plan.reserve_bytes
    assert plan.headroom_bytes == plan.budget_bytes - (plan.weights_bytes + plan.workspace_bytes + plan.graph_bytes
                                                      + plan.kv_bytes + plan.expert_bytes) > 0
    json.dumps(plan.to_dict())
    assert "memory plan (cpu)" in caplog.text and "free at boot" in caplog.text
    assert "fault injection is ON" in caplog.text
    assert eng.num_steps == 0 and not eng.has_work() and eng.faults.fired("logits") == 0   # warmup: no faults
    res = run(eng, {"a": SHORT})
    assert res["a"]["error"] is None and eng.stats()["oom_recoveries"] == {"retry": 1}
    assert eng.stats()["memory"]["free_bytes"] > 0


def test_factory_infeasible_plan_is_a_boot_error(mixtral_dir):
    with pytest.raises(MemoryPlanError) as ei:
        build_engine(mixtral_dir, EngineConfig(device="cpu", memory_reserve=100_000.0))
    msg = str(ei.value)
    assert msg.startswith("memory plan does not fit") and "--memory-reserve" in msg and "To fix:" in msg
    with pytest.raises(MemoryPlanError, match="--num-tokens"):
        build_engine(mixtral_dir, EngineConfig(device="cpu", num_tokens=10**12))


@pytest.mark.parametrize("kw, slots", [({"moe_cache_auto": True}, 16), ({"moe_cache_size": 4}, 4)])
def test_factory_sizes_the_expert_cache(mixtral_dir, kw, slots):
    eng = build_engine(mixtral_dir, EngineConfig(device="cpu", moe_backend="offload", max_prefill_length=64,
                                                 max_running_requests=2, **kw))
    try:
        plan = eng.memory_plan
        assert plan.expert_total == 16 and plan.expert_slots == slots == eng.expert_executor.cache.num_slots
        assert plan.expert_bytes == slots * plan.expert_slot_bytes + eng.expert_executor.stream_bytes()
        assert run(eng, {"a": SHORT})["a"]["error"] is None
    finally:
        eng.expert_executor.close()


def test_boot_plan_counts_the_fp8_kv_bytes(mixtral_dir):
    """``--kv-cache-dtype fp8`` through the real boot: the plan's bytes per token are the fp8 layout's (values and
    scales, about half the model dtype's), the engine's pool is float8, and a request runs."""
    import torch

    from ferrylm.config import ModelConfig
    from ferrylm.engine.cache.kv_pool import FP8, KVLayout

    eng = build_engine(mixtral_dir, EngineConfig(device="cpu", max_prefill_length=64, max_running_requests=4,
                                                 kv_cache_dtype="fp8"))
    layout = KVLayout.of(ModelConfig.from_folder(mixtral_dir))
    dtype = eng.runner.dtype
    assert eng.memory_plan.kv_bytes_per_token == layout.bytes_per_token(dtype, "fp8") \
        < layout.bytes_per_token(dtype) // 2
    assert eng.memory_plan.kv_bytes == eng.memory_plan.kv_tokens * eng.memory_plan.kv_bytes_per_token
    assert all(t.dtype == FP8 for t in eng.pool.k if t.numel()) and eng.pool.k_scale[0].dtype == torch.float32
    assert run(eng, {"a": SHORT})["a"]["error"] is None


def _oom_engine(monkeypatch, times: int) -> list[int]:
    """Make the boot's first ``times`` engine placements run out of memory (as a fragmented CUDA allocator does
    when the KV pool is allocated); returns the call counter."""
    import torch

    from ferrylm.engine import boot

    calls = [0]
    real = boot.Engine

    def flaky(*a, **kw):
        calls[0] += 1
        if calls[0] <= times:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 MiB.")
        return real(*a, **kw)

    monkeypatch.setattr(boot, "Engine", flaky)
    return calls


def test_a_placement_that_runs_out_of_memory_is_planned_again(mixtral_dir, monkeypatch, caplog):
    calls = _oom_engine(monkeypatch, times=2)
    caplog.set_level(logging.WARNING, logger="ferrylm.engine")
    eng = build_engine(mixtral_dir, EngineConfig(device="cpu", moe_backend="offload", max_prefill_length=64,
                                                 max_running_requests=4))
    plan = eng.memory_plan
    assert calls[0] == 3 and plan.allocator_slack_bytes >= 2 * (plan.budget_bytes // 20)
    assert "planned again" in caplog.text and "allocator slack" in plan.format_table()
    assert plan.headroom_bytes == plan.budget_bytes - (plan.weights_bytes + plan.workspace_bytes + plan.graph_bytes
                                                      + plan.allocator_slack_bytes + plan.kv_bytes
                                                      + plan.expert_bytes)
    assert run(eng, {"a": SHORT})["a"]["error"] is None


def test_a_placement_that_never_fits_is_a_boot_error(mixtral_dir, monkeypatch):
    calls = _oom_engine(monkeypatch, times=99)
    with pytest.raises(MemoryPlanError, match=r"ran out of memory 3 time\(s\)"):
        build_engine(mixtral_dir, EngineConfig(device="cpu", max_prefill_length=64, max_running_requests=4))
    assert calls[0] == 3
