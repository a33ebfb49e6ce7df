"""The fault-injection spec and injector: parsing, counters and filters, the real exception types, off = free."""

from __future__ import annotations

import timeit

import pytest
import torch

from ferrylm.config import EngineConfig
from ferrylm.faults import NO_FAULTS, FaultInjector, FaultRule, parse_rules
from ferrylm.memory.guard import is_oom, oom_bytes


def test_parse_rules():
    rules = parse_rules(" prefill_workspace:after=2:times=1 , attention_scratch:min_prompt=300:phase=decode,"
                        "engine_stall:file=/tmp/x:y ")
    assert rules == [FaultRule("prefill_workspace", after=2, times=1),
                     FaultRule("attention_scratch", min_prompt=300, phase="decode"),
                     FaultRule("engine_stall", file="/tmp/x:y")]
    assert parse_rules(None) == [] and parse_rules("") == []


@pytest.mark.parametrize("spec, words", [
    ("nope", "unknown fault point 'nope'"), ("logits:times=-1", "integer >= 0"), ("logits:when=3", "unknown fault"),
    ("logits:phase=later", "phase must be"), ("logits,logits", "named twice"), ("logits:times", "key=value"),
    ("logits:file=/x", "engine_stall and boot_delay only")])
def test_parse_errors_name_the_part(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_rules(spec)
    with pytest.raises(ValueError, match="--faults"):
        EngineConfig(faults=spec).validate()


def test_after_times_and_the_real_exception():
    f = FaultInjector.parse("logits:after=1:times=2:bytes=3145728")
    f.check("logits")                       # hit 1 passes (after=1)
    for i in (1, 2):
        with pytest.raises(torch.OutOfMemoryError) as ei:
            f.check("logits", nbytes=10)
        assert "CUDA out of memory. Tried to allocate 3.00 MiB" in str(ei.value) and is_oom(ei.value)
        assert oom_bytes(ei.value) == 3 * 2**20 and f.fired("logits") == i
    f.check("logits")                       # times=2 used up
    f.check("attention_scratch")            # no rule


def test_min_prompt_and_phase_filters():
    f = FaultInjector.parse("attention_scratch:min_prompt=100:phase=decode,kv_page_alloc:min_prompt=50")
    f.set_step(200, "prefill")
    f.check("attention_scratch")            # wrong phase
    f.set_step(99, "decode")
    f.check("attention_scratch")            # prompt too short
    f.set_step(100, "decode")
    with pytest.raises(torch.OutOfMemoryError):
        f.check("attention_scratch")
    f.check("kv_page_alloc", prompt_tokens=49)   # the site's own request wins over the step context
    with pytest.raises(torch.OutOfMemoryError):
        f.check("kv_page_alloc", prompt_tokens=50)


def test_frontend_point_raises_memory_error():
    f = FaultInjector.parse("detokenize:times=1")
    with pytest.raises(MemoryError, match="fault injection at 'detokenize'"):
        f.check_host("detokenize", prompt_tokens=5)
    f.check_host("detokenize", prompt_tokens=5)


def test_from_config_merges_flag_env_and_legacy_stall(tmp_path):
    stall = tmp_path / "stall"
    f = FaultInjector.from_config("logits:times=1", {"FERRYLM_FAULTS": "detokenize",
                                                     "FERRYLM_FAULT_STALL_FILE": str(stall)})
    assert set(f.rules) == {"logits", "detokenize", "engine_stall"} and f.enabled
    assert not f.should_stall()
    stall.touch()
    assert f.should_stall() and not stall.exists() and not f.should_stall()   # once per file
    with pytest.raises(ValueError, match="FERRYLM_FAULTS: .*named twice"):
        FaultInjector.from_config("logits", {"FERRYLM_FAULTS": "logits"})
    assert not FaultInjector.from_config(None, {}).enabled


def test_off_is_free():
    assert not NO_FAULTS.enabled and not NO_FAULTS.rules
    NO_FAULTS.check("prefill_workspace")
    assert NO_FAULTS.fired("prefill_workspace") == 0
    # a disabled site costs one attribute test: well under a microsecond
    per = min(timeit.repeat("f.enabled and f.check('logits')", globals={"f": NO_FAULTS}, number=100_000,
                            repeat=3)) / 100_000
    assert per < 1e-6


def test_is_oom_recognises_allocator_failures():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("CUDA out of memory"))
    try:
        torch.empty(1 << 55, dtype=torch.uint8)
    except RuntimeError as e:  # the CPU allocator's own failure
        assert is_oom(e) and oom_bytes(e) == 1 << 55
