"""`ferry bench bw`: the table (copy rates, the CPU kernel per format and thread count alone and beside copies, the
verdict) and the machine profile it saves for this machine; the verdict's rules; bad flags."""

from __future__ import annotations

import pytest
import torch

from ferrylm.bench.bw import best_threads, verdict
from ferrylm.cli import main
from ferrylm.experts import machine_profile as mp
from ferrylm.experts.executor import ExpertLayout
from ferrylm.synthetic.quant import SYNTHETIC_FORMATS

SMALL = ["--hidden", "256", "--inter", "256", "--bank-mib", "2", "--copy-mib", "2", "--host-mib", "4", "--jobs", "2",
         "--reps", "1", "--experts-per-job", "2"]


def test_bench_bw_prints_the_table_and_saves_this_machines_profile(tmp_path, own_cache_root, capsys):
    out_json = tmp_path / "profile.json"
    assert main(["bench", "bw", "--device", "cpu", "--formats", "bf16,q4_k", "--threads", "1,2", *SMALL,
                 "--output-json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "no GPU: the 'device' is host memory, every copy a host memcpy" in text
    for row in ("host->device", "device->host", "host read", "device copy", "verdict"):
        assert row in text
    assert text.count("bf16 ") >= 3 and text.count("q4_k ") >= 3   # two thread rows and a verdict each
    assert "resident, " in text and "profile saved:" in text

    saved = mp.read_profiles()
    key = mp.current_machine(torch.device("cpu"))
    profile = saved.machines[key.id]
    assert profile == mp.MachineProfile.model_validate_json(out_json.read_text())
    assert profile.copies == "memcpy" and profile.machine == key
    bf16 = mp.format_key(ExpertLayout(256, 256, torch.bfloat16))
    q4k = mp.format_key(ExpertLayout(256, 256, torch.bfloat16, quant=SYNTHETIC_FORMATS["q4_k"]))
    assert set(profile.formats) == {bf16, q4k}
    for fp in profile.formats.values():
        assert [r.threads for r in fp.rates] == [1, 2]
        assert fp.best_threads in (1, 2) and fp.backend == "resident" and fp.kernel
        assert all(r.alone > 0 and r.with_copies > 0 and r.copies_during > 0 for r in fp.rates)
    assert profile.formats[bf16].expert_bytes == 3 * 256 * 256 * 2
    # what a boot on this machine then reads
    assert mp.profile_bandwidths(torch.device("cpu"), ExpertLayout(256, 256, torch.bfloat16), threads=2,
                                 pinned=True).cpu == profile.formats[bf16].rates[1].alone


def test_bench_bw_no_save_writes_nothing(own_cache_root, capsys):
    assert main(["bench", "bw", "--device", "cpu", "--formats", "f32", "--threads", "1", *SMALL, "--no-save"]) == 0
    assert "f32 " in capsys.readouterr().out
    assert mp.read_profiles() is None


@pytest.mark.parametrize("flags, message", [
    (["--formats", "bf17"], "--formats: unknown format 'bf17'"),
    (["--threads", "0,2"], "--threads takes a comma-separated list of integers >= 1"),
    (["--jobs", "0"], "--jobs must be > 0"),
    (["--device", "tpu"], "--device takes auto, cpu or cuda[:N], got 'tpu'"),
    (["--formats", "q4_k", "--inter", "128"], "multiple of 256"),
])
def test_bench_bw_bad_flags(flags, message, capsys):
    assert main(["bench", "bw", "--device", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err


def _rates(threads, alone, beside):
    return mp.ThreadRates(threads=threads, alone=alone, with_copies=beside, copies_during=1.0)


def test_verdict_and_best_threads():
    rates = (_rates(1, 10, 5), _rates(2, 19, 9.8), _rates(4, 20, 10))
    assert best_threads(rates, with_copies=True) == 2     # 9.8 is within 3 % of 10: fewer threads
    assert best_threads(rates, with_copies=False) == 4    # 19 is not within 3 % of 20
    assert verdict(_rates(4, 60e9, 55e9), 50e9, gpu=True)[0] == "cpu"
    assert verdict(_rates(4, 30e9, 20e9), 50e9, gpu=True)[0] == "hybrid"      # 20 / 70 = 29 % of the misses
    backend, reason = verdict(_rates(4, 10e9, 5e9), 50e9, gpu=True)
    assert backend == "offload" and "9 %" in reason
    assert verdict(_rates(4, 10e9, 5e9), 50e9, gpu=False)[0] == "resident"
