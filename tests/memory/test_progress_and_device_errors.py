"""Progress inside a step and sticky device errors, in-process on the tiny Mixtral (CPU): the engine ticks once
per decoder layer and at each step boundary, learns its step times (the watchdog's expected duration), and a
sticky device error injected inside the forward is the real exception type, is not taken for an OOM, and leaves
``Engine.step`` with the step's requests named (issue 18)."""

from __future__ import annotations

import time

import pytest
import torch

from ferrylm.faults import DEVICE_ERROR_TEXT, FaultInjector, device_error
from ferrylm.memory.guard import is_device_error, is_oom
from tests.memory.conftest import LONG, SHORT, drain, greedy, make_engine


def test_the_engine_ticks_per_layer_and_per_step(offload_model):
    eng = make_engine(offload_model)
    p = eng.progress
    layers = offload_model.config.num_layers
    assert p.ticks_per_step == layers + 1
    eng.add_request("s", SHORT, greedy(2))
    before = p.ticks
    eng.step()                                   # the prefill: begin, every layer, end
    assert p.ticks - before == layers + 2 and not p.in_step and p.step_request_ids == ("s",)
    assert p.sec_per_token is None and p.decode_step_s is not None   # 20 tokens: a small step
    eng.add_request("l", LONG, greedy(2))
    eng.step()
    assert p.sec_per_token is not None and p.expected(2048) > p.expected(64) > 0
    rep = p.report()
    assert rep["ticks"] == p.ticks and rep["in_step"] is False and rep["ticks_per_step"] == layers + 1


def test_engines_over_one_model_do_not_stack_hooks(offload_model):
    first = make_engine(offload_model)
    second = make_engine(offload_model)
    second.add_request("s", SHORT, greedy(1))
    t1, t2 = first.progress.ticks, second.progress.ticks
    second.step()
    assert first.progress.ticks == t1 and second.progress.ticks - t2 == offload_model.config.num_layers + 2


def test_step_delay_makes_a_slow_step_that_ticks(offload_model):
    eng = make_engine(offload_model, "step_delay:ms=30:min_prompt=150")
    eng.add_request("l", LONG, greedy(1))
    t0 = time.monotonic()
    drain(eng, t0)
    assert time.monotonic() - t0 >= 0.03 * offload_model.config.num_layers
    assert eng.faults.fired("step_delay") >= offload_model.config.num_layers


def test_the_injected_device_error_is_the_real_type():
    e = device_error("x")
    accel = getattr(torch, "AcceleratorError", None)
    assert isinstance(e, accel or RuntimeError) and isinstance(e, RuntimeError)
    assert str(e).startswith("CUDA error: an illegal memory access was encountered")
    assert is_device_error(e) and not is_oom(e)
    assert is_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_device_error(RuntimeError("CUDA error: out of memory"))        # an OOM: the guard's
    assert not is_device_error(ValueError("CUDA error: not a RuntimeError"))
    assert DEVICE_ERROR_TEXT.splitlines()[0] in str(e)


def test_a_sticky_device_error_leaves_the_step_with_its_requests_named(offload_model):
    eng = make_engine(offload_model, "device_error:times=1:min_prompt=150")
    eng.add_request("short", SHORT, greedy(4))
    eng.step()                                   # the short prompt: no fault
    eng.add_request("long", LONG, greedy(4))
    with pytest.raises(RuntimeError) as e:
        eng.step()                               # the fault fires inside the forward (a layer's hook)
    assert is_device_error(e.value) and "illegal memory access" in str(e.value)
    assert set(eng.progress.step_request_ids) == {"short", "long"} and not eng.progress.in_step
    assert eng.stats()["oom_recoveries"] == {}   # never retried as if it were an allocation failure


def test_faults_parse_the_new_points():
    f = FaultInjector.parse("step_delay:ms=5:min_prompt=10,device_error:times=1,heartbeat_error:after=2")
    assert f.rules["step_delay"].ms == 5 and f.rules["device_error"].times == 1
    with pytest.raises(ValueError, match="ms= applies to step_delay and boot_delay only"):
        FaultInjector.parse("device_error:ms=3")
    assert FaultInjector.parse("ipc_garbage:times=2").rules["ipc_garbage"].times == 2
    boot = FaultInjector.parse("boot_delay:ms=30")
    t0 = time.monotonic()
    boot.boot_hook()
    assert time.monotonic() - t0 >= 0.03 and boot.rules["boot_delay"].ms == 30
    FaultInjector.parse(None).boot_hook()   # disabled: returns at once


def test_boot_delay_with_a_file_delays_only_while_the_file_exists(tmp_path):
    flag = tmp_path / "slow:boots"   # the path may hold ':' (file= ends the rule)
    boot = FaultInjector.parse(f"boot_delay:ms=200:file={flag}")
    t0 = time.monotonic()
    boot.boot_hook()
    assert time.monotonic() - t0 < 0.15 and boot.fired("boot_delay") == 0
    flag.touch()
    for _ in range(2):   # every boot while it exists: the file is kept
        t0 = time.monotonic()
        boot.boot_hook()
        assert time.monotonic() - t0 >= 0.2
    assert flag.exists() and boot.fired("boot_delay") == 2
    with pytest.raises(ValueError, match="file= applies to engine_stall and boot_delay only"):
        FaultInjector.parse(f"step_delay:file={flag}")
    band = FaultInjector.parse("logits:min_prompt=10:max_prompt=20")
    assert [band.fires("logits", prompt_tokens=n) for n in (9, 10, 20, 21)] == [False, True, True, False]
