"""The machine profile (`ferry bench bw`) at boot: a profile for this machine and format replaces the bandwidth
measurement of the hybrid split and of `auto` (logged with its date); a corrupt file, another machine's profile, a
format it did not measure, or pageable banks on CUDA leave the boot measuring as without one (logged)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import ferrylm.experts.bandwidth as bandwidth
from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.boot import build_engine
from ferrylm.experts import machine_profile as mp
from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.hybrid import cpu_effective_rate, split_misses
from ferrylm.experts.options import Bandwidths

STAMP = "2031-02-03 04:05 UTC"
MEASURED = Bandwidths(pcie=1.0, host=3.0, cpu=1.0, hbm=10.0)


def fake_profile(machine: mp.MachineKey, fmt: str, *, h2d=7.25e9, cpu=(3.5e9, 6.75e9), beside=(1.5e9, 2.5e9),
                 latency=4.5e-5) -> mp.MachineProfile:
    """A profile with distinctive numbers: format ``fmt`` measured at 1 and 2 threads."""
    rates = tuple(mp.ThreadRates(threads=t, alone=a, with_copies=b, copies_during=1e9)
                  for t, a, b in zip((1, 2), cpu, beside))
    fp = mp.FormatProfile(name="x", kernel="native-avx2", expert_bytes=1000, rates=rates, best_threads=2,
                          cpu_latency=latency, backend="hybrid", reason="test")
    return mp.MachineProfile(machine=machine, measured_at=STAMP, copies="memcpy" if machine.gpu is None else "cuda",
                             h2d=h2d, d2h=6e9, host=11.5e9, hbm=13e9, formats={fmt: fp})


@pytest.fixture
def cache(own_cache_root):
    return own_cache_root


@pytest.fixture
def no_measuring(monkeypatch):
    """Fail the test if the boot measures bandwidths."""
    def measure(*a, **k):
        raise AssertionError("measured although a profile covers this machine")
    monkeypatch.setattr(bandwidth, "measure_bandwidths", measure)


def test_boot_hybrid_split_starts_from_the_profile(cache, no_measuring, expert_checkpoints, caplog):
    ckpt = expert_checkpoints("qwen3_moe")
    mp.save_profile(fake_profile(mp.current_machine(torch.device("cpu")), "float32"))
    engine = build_engine(ckpt.path, EngineConfig(device="cpu", moe_backend="hybrid", moe_cache_size=2, num_pages=16,
                                                  page_size=4, max_prefill_length=8, max_running_requests=1))
    with caplog.at_level(logging.INFO, logger="ferrylm.experts"):
        bw = engine.expert_executor.bandwidths()
    alone, beside = (6.75e9, 2.5e9) if torch.get_num_threads() >= 2 else (3.5e9, 1.5e9)   # the pool's row
    assert (bw.pcie, bw.host, bw.cpu, bw.hbm) == (7.25e9, 11.5e9, alone, 13e9)
    assert (bw.cpu_with_copies, bw.cpu_latency) == (beside, 4.5e-5)
    assert cpu_effective_rate(bw) == beside   # measured beside copies, not estimated as min(cpu, host - pcie)
    assert f"machine profile {cache / mp.PROFILE_FILE} (ferry bench bw, measured {STAMP})" in caplog.text


def test_auto_on_cuda_starts_from_the_profile(cache, no_measuring, monkeypatch, tmp_path):
    """auto's prediction (experts larger than the budget) reads the GPU machine's profile; the options carry it
    to the executor."""
    from ferrylm.engine.expert_choice import resolve_expert_backend
    from ferrylm.synthetic.spec import materialize, parse_synthetic_spec

    gpu = mp.MachineKey(cpu="Test CPU", cores=16, gpu="Test GPU 80GB")
    monkeypatch.setattr(mp, "current_machine", lambda device: gpu)
    monkeypatch.setattr("ferrylm.experts.banks.probe_pinning", lambda: None)
    folder = materialize(parse_synthetic_spec("synthetic:qwen3-30b-a3b:layers=4"), tmp_path)
    layout = ExpertLayout(2048, 768, torch.bfloat16)
    mp.save_profile(fake_profile(gpu, mp.format_key(layout)))
    opts = resolve_expert_backend(ModelConfig.from_folder(folder), EngineConfig(gpu_memory_limit=6, moe_cpu_threads=1),
                                  torch.device("cuda"), torch.bfloat16)
    assert opts.backend != "resident"   # 4.7 GB of experts, less left: auto needed the rates
    assert (opts.bandwidths.pcie, opts.bandwidths.cpu, opts.bandwidths.cpu_with_copies) == (7.25e9, 3.5e9, 1.5e9)


def _boot_rates(caplog, layout=ExpertLayout(64, 32, torch.float32)) -> Bandwidths:
    with caplog.at_level(logging.INFO, logger="ferrylm.experts"):
        return bandwidth.machine_bandwidths("cpu", layout, pinned=True, threads=2)


def test_corrupt_profile_is_ignored_with_a_log_line(cache, monkeypatch, caplog):
    monkeypatch.setattr(bandwidth, "measure_bandwidths", lambda *a, **k: MEASURED)
    (cache / mp.PROFILE_FILE).write_text('{"version": 1, "machines": {"x": {"machine": 3')
    assert _boot_rates(caplog) is MEASURED
    assert "ignored: it does not parse" in caplog.text
    key = mp.current_machine(torch.device("cpu"))
    bad = fake_profile(key, "float32").model_dump(mode="json")
    bad["h2d"] = -1.0   # valid JSON, an invalid profile: the file is checked against its schema
    (cache / mp.PROFILE_FILE).write_text(json.dumps({"version": 1, "machines": {key.id: bad}}))
    caplog.clear()
    assert _boot_rates(caplog) is MEASURED
    assert "h2d" in caplog.text and "does not parse" in caplog.text


def test_foreign_machine_or_format_is_ignored_with_a_log_line(cache, monkeypatch, caplog):
    monkeypatch.setattr(bandwidth, "measure_bandwidths", lambda *a, **k: MEASURED)
    other = mp.MachineKey(cpu="Another CPU", cores=96, gpu=None)
    mp.save_profile(fake_profile(other, "float32"))
    assert _boot_rates(caplog) is MEASURED
    assert "holds Another CPU | 96 cores | no GPU, not this machine" in caplog.text
    mp.save_profile(fake_profile(mp.current_machine(torch.device("cpu")), "bfloat16"))  # beside the other one
    caplog.clear()
    assert _boot_rates(caplog) is MEASURED
    assert "no CPU rate for float32" in caplog.text
    assert len(mp.read_profiles().machines) == 2
    assert _boot_rates(caplog, ExpertLayout(64, 32, torch.bfloat16)).cpu == 6.75e9


def test_pageable_banks_on_cuda_do_not_use_pinned_copy_rates(cache, monkeypatch, caplog):
    gpu = mp.MachineKey(cpu="Test CPU", cores=16, gpu="Test GPU")
    monkeypatch.setattr(mp, "current_machine", lambda device: gpu)
    mp.save_profile(fake_profile(gpu, "bfloat16"))
    with caplog.at_level(logging.INFO, logger="ferrylm.experts"):
        assert mp.profile_bandwidths(torch.device("cuda"), ExpertLayout(64, 32, torch.bfloat16), threads=1,
                                     pinned=False) is None
        assert mp.profile_bandwidths(torch.device("cuda"), ExpertLayout(64, 32, torch.bfloat16), threads=1,
                                     pinned=True).cpu == 3.5e9
    assert "expert banks are pageable" in caplog.text


def test_thread_rows_and_the_split_with_measured_contention():
    fp = fake_profile(mp.MachineKey(cpu="c", cores=8, gpu=None), "float32").formats["float32"]
    assert [fp.at(t).threads for t in (1, 2, 3, 64)] == [1, 2, 2, 2]
    low = fp.model_copy(update={"rates": fp.rates[1:]})
    assert low.at(1).threads == 2   # below every measured count: the smallest
    est = Bandwidths(pcie=1.0, host=3.0, cpu=1.0, hbm=10.0)           # estimate min(1, 3 - 1) = 1
    measured = Bandwidths(pcie=1.0, host=3.0, cpu=1.0, hbm=10.0, cpu_with_copies=1 / 3)
    assert split_misses(4, est) == 2 and split_misses(4, measured) == 3
