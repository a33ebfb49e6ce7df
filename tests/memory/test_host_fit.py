"""A model larger than the host's memory is refused before loading, with both sizes (issue 26); synthetic presets
know their size from their config; --gpu-memory-limit without a GPU is a warning."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from ferrylm.config import ModelConfig
from ferrylm.engine import boot, expert_choice
from ferrylm.memory.budget import MemoryPlanError, check_host_fits
from ferrylm.memory.probe import GiB
from ferrylm.synthetic.spec import parse_synthetic_spec, synthetic_config

CPU = torch.device("cpu")


def preset(spec: str) -> ModelConfig:
    return ModelConfig.from_dict(synthetic_config(parse_synthetic_spec(spec)))


def test_qwen3_30b_a3b_counts_about_57_gib_in_bf16() -> None:
    need, what = expert_choice.model_host_bytes(preset("synthetic:qwen3-30b-a3b"), CPU, torch.bfloat16, "resident")
    assert 55 * GiB < need < 60 * GiB and "routed experts" in what
    q, _ = expert_choice.model_host_bytes(preset("synthetic:qwen3-30b-a3b:quant=int4"), CPU, torch.bfloat16, "resident")
    assert q < need / 2.5   # quantized experts are counted at their size


def test_gpu_host_counts_only_the_expert_banks_of_an_offloading_backend() -> None:
    cfg = preset("synthetic:qwen3-30b-a3b")
    cuda = torch.device("cuda")
    assert expert_choice.model_host_bytes(cfg, cuda, torch.bfloat16, "resident")[0] == 0
    banks, what = expert_choice.model_host_bytes(cfg, cuda, torch.bfloat16, "offload")
    assert 50 * GiB < banks < 57 * GiB and "host banks" in what


def test_refused_with_both_sizes() -> None:
    with pytest.raises(MemoryPlanError) as e:
        check_host_fits(57 * GiB, 20 * GiB, 24 * GiB, "its weights")
    assert "57.00 GiB" in str(e.value) and "20.00 GiB available" in str(e.value) and "24.00 GiB total" in str(e.value)
    check_host_fits(GiB, 20 * GiB, 24 * GiB, "its weights")


def test_check_host_memory_before_loading(tmp_path, monkeypatch) -> None:
    import json

    import psutil

    (tmp_path / "config.json").write_text(json.dumps(synthetic_config(parse_synthetic_spec("synthetic:qwen3-30b-a3b"))))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=20 * GiB, total=24 * GiB))
    with pytest.raises(MemoryPlanError, match="does not fit in host memory"):
        expert_choice.check_host_memory(ModelConfig.from_folder(tmp_path), CPU, torch.bfloat16, "resident")


def test_build_engine_refuses_before_loading_and_warns_about_the_limit(tmp_path, monkeypatch, caplog) -> None:
    import json

    import psutil

    (tmp_path / "config.json").write_text(json.dumps(synthetic_config(parse_synthetic_spec("synthetic:qwen3-30b-a3b"))))
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=20 * GiB, total=24 * GiB,
                                                                           percent=real.percent, used=real.used))
    loaded = []
    monkeypatch.setattr("ferrylm.engine.boot.load_model", lambda *a, **k: loaded.append(1))
    from ferrylm.config import EngineConfig

    with caplog.at_level(logging.WARNING, logger="ferrylm.engine"), pytest.raises(MemoryPlanError):
        boot.build_engine(tmp_path, EngineConfig(device="cpu", gpu_memory_limit=24.0))
    assert not loaded
    assert any("--gpu-memory-limit 24 GiB is ignored: there is no GPU" in r.message for r in caplog.records)
