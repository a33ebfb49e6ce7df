"""`ferry bench suite` (scenarios, roofline, a live scenario) and `ferry bench tables` (JSON -> BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferrylm.bench import suite, tables
from ferrylm.bench.roofline import Bandwidths, decode_roofline, prefill_floor
from ferrylm.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]


def test_packaged_scenarios_parse_and_name_their_runs():
    scs = suite.load_scenarios()
    names = [s.name for s in scs]
    assert "q30b-bf16-24g" in names and "q35-bf16-32g" in names and len(set(names)) == len(names)
    q = next(s for s in scs if s.name == "q30b-bf16-24g")
    assert q.args == ("--gpu-memory-limit", "24") and q.tokenizer
    assert [r.name for r in q.runs] == ["c1", "c16", "p8k"]
    assert all(r.num_prompts >= 3 for s in scs for r in s.runs if not r.multi_turn)   # p50/p90 of >= 3 requests
    assert next(s for s in scs if s.name == "q30b-shared-leave10g").hold_leave_gib == 10


@pytest.mark.parametrize("text, needle", [
    ('[[scenario]]\nname = "a"\nmodel = "m"\nruns = ["nope"]\n', "runs ['nope'] are not defined"),
    ('[[scenario]]\nname = "a"\nmodel = "m"\ncap = 3\n', "unknown keys ['cap']"),
    ('[runs.x]\nconcurency = 1\n', "run 'x'"),
])
def test_bad_scenario_files_are_named(tmp_path, text, needle):
    p = tmp_path / "s.toml"
    p.write_text(text)
    with pytest.raises(suite.SuiteError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        suite.load_scenarios(p)


def test_selection_and_commands_fail_before_any_server_starts(monkeypatch):
    scs = suite.load_scenarios()
    with pytest.raises(suite.SuiteError, match="unknown scenario 'nope'; scenarios: q30b"):
        suite.select(scs, "nope")
    assert [s.name for s in suite.select(scs, "q35-bf16-32g,q30b-bf16-24g")] == ["q35-bf16-32g", "q30b-bf16-24g"]
    gguf = suite.select(scs, "gguf-q30b-12g")[0]
    monkeypatch.delenv("PEER_GGUF", raising=False)
    with pytest.raises(suite.SuiteError, match="set PEER_GGUF"):
        suite.serve_command(gguf, 8000, None)
    monkeypatch.setenv("PEER_GGUF", "/x/q.gguf")
    cmd = suite.serve_command(gguf, 8123, None)
    assert cmd[-6:] == ["--model", "/x/q.gguf", "--port", "8123", "--gpu-memory-limit", "12"]
    with pytest.raises(suite.SuiteError, match="pass --tokenizer"):
        suite.serve_command(suite.select(scs, "q30b-bf16-24g")[0], 8000, None)


def test_cli_refuses_an_unknown_scenario_with_exit_2(capsys):
    assert cli_main(["bench", "suite", "--only", "nope", "--out-dir", "/nonexistent/x"]) == 2
    assert "unknown scenario 'nope'" in capsys.readouterr().err


def test_decode_roofline_counts_each_memory_at_its_rate():
    bw = Bandwidths(dram=80e9, pcie=50e9, hbm=4000e9)
    ex = {"steps": 10, "hits": 60, "bytes_copied": 20 * 1000, "bytes_mapped": 5000, "cpu_experts": 4}
    r = decode_roofline(ex, {"dense_step_bytes": 3000, "expert_bytes": 1000}, 10, bw)
    assert r["bytes_per_token"] == {"hbm": (3000 * 10 + 60 * 1000) / 10, "pcie": 2500.0, "dram": 400.0}
    assert r["seconds_per_token"]["pcie"] == pytest.approx(2500 / 50e9)
    assert r["bound"] == "pcie" and r["floor_tok_s"] == pytest.approx(50e9 / 2500)
    # a CPU server: every weight read is a host DRAM read
    cpu = decode_roofline(ex, {"dense_step_bytes": 3000, "expert_bytes": 1000}, 10, Bandwidths(dram=80e9))
    assert cpu["bytes_per_token"]["dram"] == 9000 + 400 and cpu["bound"] == "dram"
    assert decode_roofline(ex, {}, 10, bw) == {}
    assert prefill_floor({"expert_total": 100, "expert_slots": 40}, {"expert_bytes": 1000}, bw) == pytest.approx(
        60 * 1000 / 50e9)
    assert prefill_floor({"expert_total": 0}, {"expert_bytes": 1000}, bw) is None


def _record(name: str, date: str, tok_s: float, args=("--gpu-memory-limit", "24")) -> dict:
    run = {"itl_ms": {"p50": 1000 / tok_s, "p90": 2000 / tok_s}, "ttft_ms": {"p50": 1500.0, "p90": 1800.0},
           "output_throughput": 10 * tok_s, "failed": 0,
           "experts": {"hit_rate": 0.75, "pcie_bytes_per_output_token": 7.5e8},
           "roofline": {"measured_tok_s": tok_s, "floor_tok_s": 80.0, "bound": "pcie", "ratio": tok_s / 80.0,
                        "prefill_floor_s": 1.17}}
    return {"kind": suite.SUITE_KIND, "version": 1, "date": date, "scenario": name, "args": list(args),
            "ready_s": 90.4, "gpu_used_mib": 25000, "memory_before": {"server": {"moe_backend": "offload"}},
            "runs": {"c1": run, "c16": run, "p8k": run}}


def test_tables_take_the_newest_record_of_each_scenario(tmp_path):
    (tmp_path / "2026-12-01-q.json").write_text(json.dumps(_record("q", "2026-12-01", 20.0)))
    (tmp_path / "2026-12-05-q.json").write_text(json.dumps(_record("q", "2026-12-05", 27.5)))
    (tmp_path / "2026-12-05-other.json").write_text(json.dumps({"model": "not a suite record"}))
    (tmp_path / "2026-12-05-peer-llamacpp.json").write_text(json.dumps([
        {"step": "build", "rc": 0},
        {"step": "lserve", "name": "l_gpu", "ready_s": 3.0, "gpu_used_mib": 23700,
         "runs": [{"tag": "c1", "itl_p50": 4.1, "out_tok_s": 230.0}, {"tag": "c16", "out_tok_s": 327.0},
                  {"tag": "prefill8k", "ttft_p50": 1580.0}]},
        {"step": "fserve", "name": "f_nocap", "ready_s": 40.0, "gpu_used_mib": 70000,
         "runs": [{"tag": "c1", "itl_p50": 8.2, "out_tok_s": 120.0}, {"tag": "c16", "out_tok_s": 654.0},
                  {"tag": "prefill8k", "ttft_p50": 790.0}]},
        {"step": "fserve", "name": "f_cap12", "ready_s": None, "error": "memory plan does not fit"}]))
    block = tables.generate(tmp_path)
    row = next(line for line in block.splitlines() if line.startswith("| q |"))
    assert "**27.5**" in row and "2026-12-05-q.json" in row and "| 24 GiB |" in row and "0.34" in row
    assert "1.50 / 1.80" in row and "| 75.0 |" in row and "| 750 |" in row
    assert "| llama.cpp | l_gpu | 3.0 | 23700 | 4.1 | 243.9 | 327.0 | 1580 |" in block
    assert "| ferrylm | f_cap12 | did not start: memory plan does not fit |" in block
    assert "| f_nocap / l_gpu | whole model on the GPU | 0.50 | 2.00 | 2.00 |" in block   # c1: 4.1 / 8.2 ms
    doc = "# Benchmarks\n\nnarrative\n"
    once = tables.splice(doc, block)
    assert once.startswith("# Benchmarks\n\n" + tables.BEGIN) and once.endswith("narrative\n")
    assert tables.splice(once, block) == once


def test_committed_benchmarks_md_equals_what_its_json_generates():
    """The headline tables of docs/BENCHMARKS.md are exactly what `ferry bench tables` makes of docs/bench/."""
    doc = (REPO / "docs" / "BENCHMARKS.md").read_text()
    assert tables.BEGIN in doc, "docs/BENCHMARKS.md has no generated block: run `ferry bench tables`"
    assert tables.splice(doc, tables.generate(REPO / "docs" / "bench")) == doc, \
        "docs/BENCHMARKS.md differs from its JSON: run `ferry bench tables`"


@pytest.mark.slow
def test_suite_serves_a_scenario_and_records_it(tmp_path):
    """The built-in model through `ferry bench suite`: ready time, plan, model bytes, a roofline per run."""
    sc = tmp_path / "s.toml"
    sc.write_text('[runs.tiny]\nconcurrency = 2\nnum_prompts = 3\ninput_len = 8\noutput_len = 4\n'
                  '[[scenario]]\nname = "tiny"\nmodel = "smollm2-moe"\nargs = ["--max-model-len", "512"]\n'
                  'runs = ["tiny"]\n')
    from tests.e2e.conftest import free_port

    rc = cli_main(["bench", "suite", "--scenarios", str(sc), "--out-dir", str(tmp_path), "--date", "2026-01-02",
                   "--port", str(free_port()), "--ready-timeout", "300"])
    rec = json.loads((tmp_path / "2026-01-02-tiny.json").read_text())
    assert rc == 0, rec
    assert rec["kind"] == suite.SUITE_KIND and rec["exit_code"] == 0 and rec["ready_s"] > 0
    mb = rec["memory_before"]["server"]["model_bytes"]
    assert mb["dense_step_bytes"] > 0 and mb["expert_bytes"] > 0
    run = rec["runs"]["tiny"]
    assert run["completed"] == 3 and run["total_output_tokens"] == 12
    roof = run["roofline"]
    assert roof["bytes_per_token"]["dram"] >= mb["dense_step_bytes"] * 0.5   # a CPU server reads from DRAM
    assert 0 < roof["ratio"] and roof["floor_tok_s"] > 0
    assert (tmp_path / "tiny.log").read_text()
