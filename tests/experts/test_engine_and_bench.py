"""The backends through the engine (factory flags, continuous batching, Engine.stats()) and `ferry bench decode`
end to end on a tiny checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tests.models.hf_checkpoints import token_ids

from ferrylm.cli import build_parser, engine_config_from_args, main
from ferrylm.config import EngineConfig
from ferrylm.engine.boot import build_engine
from ferrylm.engine.expert_choice import expert_options
from ferrylm.experts import ExpertOptions
from ferrylm.engine.sampling_params import SamplingParams

NEW = 10


def _generate(engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    out = {rid: [] for rid in prompts}
    for _ in range(200):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error_code is None, o.error_message
            out[o.request_id].extend(o.new_token_ids)
    return out


def _config(**kw) -> EngineConfig:
    # 4-token pages, 8-token step budget: chunked prefills run beside decodes (steps of 1..8 tokens)
    return EngineConfig(device="cpu", check_invariants=True, num_pages=32, page_size=4, max_prefill_length=8,
                        max_running_requests=2, **kw)


def test_engine_backends_match_resident_and_report_stats(expert_checkpoints):
    ckpt = expert_checkpoints("mixtral")
    prompts = {"a": token_ids(11, ckpt.vocab_size, seed=21).tolist(),
               "b": token_ids(17, ckpt.vocab_size, seed=22).tolist()}
    resident = build_engine(ckpt.path, _config(moe_backend="auto"))  # auto on the CPU -> resident
    assert resident.stats()["experts"]["backend"] == "resident"
    ref = _generate(resident, prompts)
    assert resident.stats()["experts"]["needed"] > 0
    for backend in ("offload", "cpu", "hybrid"):
        engine = build_engine(ckpt.path, _config(moe_backend=backend, moe_cache_size=3, moe_cpu_threads=None))
        assert _generate(engine, prompts) == ref, backend
        st = engine.stats()["experts"]
        assert st["backend"] == backend and st["num_slots"] == 3
        assert st["hits"] + st["misses"] == st["needed"] > 0 and 0.0 <= st["hit_rate"] <= 1.0
        assert st["steps"] >= engine.num_steps and st["last_step"]["steps"] == 1  # + the boot warmup
        # issue 26: counters that move, each by its backend's mechanism (">= 0" held for a counter never touched)
        slot = engine.expert_executor.layout.nbytes
        if backend == "offload":
            assert st["bytes_copied"] > 0 and st["cpu_experts"] == 0
        elif backend == "cpu":
            assert st["cpu_experts"] > 0 and st["cpu_expert_time_s"] > 0
        else:
            assert st["bytes_copied"] > 0 and st["bytes_copied"] % slot == 0
        assert st["bytes_copied"] % slot == 0
        assert st["copy_hidden_s"] == pytest.approx(max(0.0, st["copy_time_s"] - st["copy_exposed_s"]))
        assert len(st["layer_hits"]) == len(st["layers"]) == 2
        engine.expert_executor.close()


def test_cli_moe_flags_reach_the_engine_config():
    a = build_parser().parse_args(["serve", "--moe-backend", "hybrid", "--moe-cache-size", "12",
                                   "--moe-cpu-threads", "3", "--gpu-memory-limit", "24", "--moe-cpu-kernel", "torch",
                                   "--moe-cpu-share", "2"])
    ec = engine_config_from_args(a)
    assert (ec.moe_backend, ec.moe_cache_size, ec.moe_cpu_threads, ec.gpu_memory_limit) == ("hybrid", 12, 3, 24.0)
    assert (ec.moe_cpu_kernel, ec.moe_cpu_share) == ("torch", 2)
    from ferrylm.engine.expert_choice import expert_options

    opts = expert_options(ec)
    assert (opts.cpu_kernel, opts.cpu_share, opts.cpu_threads) == ("torch", 2, 3)
    assert (engine_config_from_args(build_parser().parse_args(["serve"])).moe_cpu_kernel,
            engine_config_from_args(build_parser().parse_args(["serve"])).moe_cpu_share) == ("auto", None)
    with pytest.raises(ValueError, match="--moe-cpu-threads"):
        engine_config_from_args(build_parser().parse_args(["serve", "--moe-cpu-threads", "0"]))
    with pytest.raises(ValueError, match="--moe-cpu-share must be >= 0"):
        engine_config_from_args(build_parser().parse_args(["serve", "--moe-cpu-share", "-1"]))
    with pytest.raises(ValueError, match="--moe-cpu-share applies to --moe-backend hybrid, not offload"):
        engine_config_from_args(build_parser().parse_args(["serve", "--moe-backend", "offload",
                                                           "--moe-cpu-share", "1"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--moe-cpu-kernel", "fast"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--moe-backend", "all"])  # only bench decode takes "all"


def test_bench_decode_all_backends_agree(expert_checkpoints, tmp_path, capsys):
    ckpt = expert_checkpoints("qwen3_moe")
    folder = shutil.copytree(ckpt.path, tmp_path / "model")
    (folder / "tokenizer_config.json").write_text("{}")  # a model folder needs a tokenizer; the bench uses ids
    out = tmp_path / "bench.json"
    rc = main(["bench", "decode", "--model", str(folder), "--device", "cpu", "--moe-backend", "all", "--batch", "2",
               "--tokens", "6", "--prompt-len", "5", "--moe-cache-size", "4", "--output-json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    res = json.loads(out.read_text())
    rows = {r["backend"]: r for r in res["results"]}
    assert set(rows) == {"offload", "offload-host", "cpu", "hybrid", "resident"}
    assert len({r["checksum"] for r in rows.values()}) == 1, table  # identical tokens everywhere
    assert rows["resident"]["hit_rate"] == 1.0 and rows["resident"]["pcie_bytes_per_token"] == 0
    assert rows["cpu"]["counters"]["fetched"] == 0 and rows["cpu"]["cpu_bytes_per_token"] > 0
    for r in rows.values():
        assert r["tokens"] == 12 and r["tok_s"] > 0 and r["roofline_tok_s"] > 0 and r["error"] is None
        assert r["counters"]["steps"] == 6 and r["backend"] in table
    assert all(v > 0 for v in res["bandwidths"].values())


def test_bench_decode_profile_reports_decode_steps_only(expert_checkpoints, tmp_path, capsys):
    ckpt = expert_checkpoints("qwen3_moe")
    folder = shutil.copytree(ckpt.path, tmp_path / "model")
    (folder / "tokenizer_config.json").write_text("{}")
    rc = main(["bench", "decode", "--model", str(folder), "--device", "cpu", "--moe-backend", "offload",
               "--tokens", "3", "--prompt-len", "5", "--moe-cache-size", "4", "--profile-steps", "2"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "--- profile offload-profile: 2 decode steps, batch 1 ---" in err  # the prefill step is not profiled
    assert "aten::" in err and "Self CPU time total" in err


def test_cli_bad_values_are_clear_errors_naming_the_flag(capsys):
    for argv, flag in ((["serve", "--port", "99999"], "--port"), (["serve", "--port", "-1"], "--port"),
                       (["bench", "serve", "--port", "0"], "--port")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and flag in capsys.readouterr().err
    # bench decode: a bad synthetic spec and an absent device are messages with exit 2, not tracebacks
    assert main(["bench", "decode", "--model", "synthetic:nope", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "unknown synthetic preset 'nope'" in err and "Traceback" not in err
    if not torch.cuda.is_available():
        assert main(["bench", "decode", "--model", "synthetic:qwen3-30b-a3b:layers=1", "--device", "cuda"]) == 2
        assert "--device cuda: CUDA is not available" in capsys.readouterr().err


def test_bench_decode_defaults_to_all_backends():
    args = build_parser().parse_args(["bench", "decode"])
    assert args.moe_backend == "all"


def test_bench_decode_native_kernel_without_compiler_is_one_line(expert_checkpoints, tmp_path, monkeypatch, capsys):
    ckpt = expert_checkpoints("qwen3_moe")
    folder = shutil.copytree(ckpt.path, tmp_path / "model")
    (folder / "tokenizer_config.json").write_text("{}")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))
    rc = main(["bench", "decode", "--model", str(folder), "--device", "cpu", "--moe-backend", "cpu", "--tokens", "2",
               "--moe-cache-size", "4", "--moe-cpu-kernel", "native"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "ferry bench decode: no C compiler" in err and "--moe-cpu-kernel torch" in err
    assert "Traceback" not in err


def test_auto_backend_drops_cpu_share_with_a_warning(expert_checkpoints, caplog):
    import logging

    from ferrylm.config import ModelConfig
    from ferrylm.engine.expert_choice import resolve_expert_backend

    ckpt = expert_checkpoints("qwen3_moe")
    cfg = _config(moe_backend="auto", moe_cpu_share=1)
    with caplog.at_level(logging.WARNING, logger="ferrylm.engine"):
        opts = resolve_expert_backend(ModelConfig.from_folder(ckpt.path), cfg, torch.device("cpu"), torch.float32)
    assert (opts.backend, opts.cpu_share) == ("resident", None)
    assert "--moe-cpu-share 1 ignored: --moe-backend auto chose resident" in caplog.text


@pytest.mark.parametrize("backend", ["cpu", "offload", "hybrid"])
def test_an_offloading_backend_without_a_gpu_is_served_with_a_warning(caplog, expert_checkpoints, backend):
    """A user without a GPU who names an offloading backend gets it (the CPU stands in for the GPU, as the tests use
    it) and a warning naming the flag and the default; auto says nothing of the kind."""
    import logging

    from ferrylm.config import ModelConfig
    from ferrylm.engine.expert_choice import resolve_expert_backend

    mcfg = ModelConfig.from_folder(expert_checkpoints("qwen3_moe").path)
    with caplog.at_level(logging.WARNING, logger="ferrylm.engine"):
        opts = resolve_expert_backend(mcfg, _config(moe_backend=backend), torch.device("cpu"), torch.float32)
    assert opts.backend == backend
    assert f"--moe-backend {backend} on a machine without a GPU" in caplog.text and "auto serves resident" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ferrylm.engine"):
        resolve_expert_backend(mcfg, _config(moe_backend="auto"), torch.device("cpu"), torch.float32)
    assert "without a GPU" not in caplog.text


def test_prefill_stream_turned_off_where_its_buffer_would_crowd_out_the_slots(tmp_path, monkeypatch):
    """DeepSeek-V3 fp8 (two whole layers of buffers: 21.7 GiB): a 24 GiB cap turns prefill streaming off (auto then
    offloads with the slots it frees instead of falling to cpu), 64 GiB keeps it; a named backend is fitted alike;
    the function keeps a buffer within its share."""
    from dataclasses import replace as _replace

    import ferrylm.experts.bandwidth as bandwidth
    from ferrylm.config import ModelConfig
    from ferrylm.engine.expert_choice import STREAM_BUDGET_SHARE, fit_prefill_stream, resolve_expert_backend
    from ferrylm.experts.options import Bandwidths
    from ferrylm.synthetic.spec import materialize, parse_synthetic_spec

    folder = materialize(parse_synthetic_spec("synthetic:deepseek-v3:layers=8:quant=fp8"), tmp_path)
    monkeypatch.setattr(bandwidth, "measure_bandwidths",
                        lambda *a, **k: Bandwidths(pcie=55e9, host=87e9, cpu=60e9, hbm=4e12))
    monkeypatch.setattr("ferrylm.experts.banks.probe_pinning", lambda: None)
    cuda = torch.device("cuda")

    def resolved(cap: float, backend: str):
        cfg = EngineConfig(gpu_memory_limit=cap, moe_backend=backend)
        return resolve_expert_backend(ModelConfig.from_folder(folder), cfg, cuda, torch.bfloat16)

    small, large = resolved(24, "auto"), resolved(64, "auto")
    assert (small.backend, small.stream_prefill) == ("offload", False)
    assert large.stream_prefill and large.backend == "offload"
    assert not resolved(24, "cpu").stream_prefill and resolved(64, "hybrid").stream_prefill
    opts = ExpertOptions(backend="offload")
    assert fit_prefill_stream(opts, int(STREAM_BUDGET_SHARE * 100), 100) is opts
    assert not fit_prefill_stream(opts, int(STREAM_BUDGET_SHARE * 100) + 1, 100).stream_prefill
    off = _replace(opts, stream_prefill=False)
    assert fit_prefill_stream(off, 0, 100) is off


def test_the_watchdog_knows_prefill_speed_before_the_first_request(expert_checkpoints):
    """The boot warmup's measured step times seed the engine's estimates: before any request a prefill-sized step
    is expected to take its tokens x the measured seconds per token, not one decode step's time (which let the
    watchdog kill a long first prefill on a slow CPU)."""
    ckpt = expert_checkpoints("qwen3_moe")
    engine = build_engine(ckpt.path, EngineConfig(device="cpu", num_pages=64, page_size=4, max_prefill_length=64,
                                                  max_running_requests=2))
    p = engine.progress
    assert p.steps == 0                      # nothing ran on this engine yet
    assert p.sec_per_token is not None and p.sec_per_token > 0 and p.decode_step_s is not None
    assert p.expected(2000) == pytest.approx(2000 * p.sec_per_token)
    assert p.expected(2000) > p.expected(1)


def test_cpu_bf16_support_is_read_from_the_cpu_flags(tmp_path):
    from ferrylm.engine.boot import cpu_has_native_bf16

    amx, avx2, other = tmp_path / "amx", tmp_path / "avx2", tmp_path / "other"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n")
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n")
    other.write_text("Processor\t: ARMv8\nFeatures\t: fp asimd\n")
    assert cpu_has_native_bf16(str(amx)) is True
    assert cpu_has_native_bf16(str(avx2)) is False
    assert cpu_has_native_bf16(str(other)) is None
    assert cpu_has_native_bf16(str(tmp_path / "missing")) is None
