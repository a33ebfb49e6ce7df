"""The native CPU expert kernel (experts/cpu_kernel.py): arithmetic against a float64 reference, the pool's use of
it against the torch path, and its build failures (auto falls back, native raises)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from ferrylm.experts.banks import ExpertLayout
from ferrylm.experts.cpu_kernel import KernelBuildError, NativeExpertKernel, load_kernel
from ferrylm.experts.cpu_pool import CpuExpertPool, CpuJob

H, I = 80, 40  # not multiples of 16: the vector loops' scalar tails run too


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    try:
        return NativeExpertKernel.build(tmp_path_factory.mktemp("kernels"))
    except KernelBuildError as e:  # a machine without a C compiler: the torch path is covered elsewhere
        pytest.skip(f"no native kernel here: {e}")


def reference(x, w, rows, counts):
    """float64 SwiGLU experts on the same (dtype-rounded) weights and inputs."""
    out, s = [], 0
    for r, n in zip(rows, counts):
        xe, rr = x[s:s + n].double(), r.double()
        gu = xe @ rr[:2 * I * H].view(2 * I, H).T
        out.append((F.silu(gu[:, :I]) * gu[:, I:]) @ rr[2 * I * H:].view(H, I).T * w[s:s + n, None].double())
        s += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[1], [1, 1, 1, 1], [3, 1, 6, 2], [8]])
def test_matches_float64_reference(kernel, dtype, counts):
    g = torch.Generator().manual_seed(sum(counts))
    rows = [(torch.randn(3 * I * H, generator=g) * 0.2).to(dtype) for _ in counts]
    m = sum(counts)
    x = torch.randn(m, H, generator=g).to(dtype)
    w = torch.rand(m, generator=g)
    for threads in (1, 3):
        out = kernel.run(x, w, rows, counts, H, I, threads)
        assert out.shape == (m, H) and out.dtype == torch.float32
        ref = reference(x, w, rows, counts)
        # float32 accumulation of exactly widened weights: float32 rounding only
        assert (out.double() - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


def test_rejects_bad_arguments(kernel):
    rows = [torch.zeros(3 * I * H)]
    with pytest.raises(ValueError, match="counts"):
        kernel.run(torch.zeros(2, H), torch.ones(2), rows, [1], H, I, 1)
    with pytest.raises(ValueError, match="contiguous"):
        kernel.run(torch.zeros(1, H), torch.ones(1), [torch.zeros(3 * I * H, dtype=torch.float16)], [1], H, I, 1)
    with pytest.raises(ValueError, match="contiguous"):
        kernel.run(torch.zeros(1, H), torch.ones(1), [torch.zeros(2, 3 * I * H)[:, 0]], [1], H, I, 1)


def test_build_is_cached(tmp_path):
    try:
        a = NativeExpertKernel.build(tmp_path)
    except KernelBuildError as e:
        pytest.skip(f"no native kernel here: {e}")
    mtime = a.path.stat().st_mtime_ns
    b = NativeExpertKernel.build(tmp_path)
    assert b.path == a.path and a.path.stat().st_mtime_ns == mtime
    assert a.isa in ("avx512", "avx2", "scalar")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_native_equals_torch_path(kernel, dtype):
    layout = ExpertLayout(hidden=H, inter=I, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    bank = (torch.randn(5, layout.numel, generator=g) * 0.2).to(dtype)
    counts = [2, 1, 3]
    m = sum(counts)
    x = torch.randn(m, H, generator=g).to(dtype)
    w = torch.rand(m, generator=g)
    items, s = [], 0
    for e, n in zip((4, 0, 2), counts):
        items.append((e, bank[e], s, n))
        s += n
    job = CpuJob(x=x, weights=w, items=items, out_dtype=dtype)
    native, plain = CpuExpertPool(layout, kernel="native"), CpuExpertPool(layout, kernel="torch")
    try:
        assert native.kernel_name.startswith("native-") and plain.kernel_name == "torch"
        a, _ = native.submit(job).result()
        b, _ = plain.submit(job).result()
    finally:
        native.close()
        plain.close()
    a, b = torch.cat(a).double(), torch.cat(b).double()
    ref = reference(x, w, [bank[e] for e, *_ in items], counts)
    assert a.shape == b.shape == (m, H)
    if dtype == torch.float32:
        assert (a - b).abs().max().item() < 1e-5
    else:  # the torch path rounds every intermediate to bfloat16; the native kernel keeps float32
        assert (a - ref).abs().max().item() <= (b - ref).abs().max().item() + 1e-6


def test_build_failure_auto_falls_back_native_raises(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="ferrylm.experts"):
        assert load_kernel("auto", tmp_path) is None
    assert "native kernel unavailable" in caplog.text and "--moe-cpu-kernel torch" in caplog.text
    with pytest.raises(KernelBuildError, match="no C compiler"):
        load_kernel("native", tmp_path)
    assert load_kernel("torch", tmp_path) is None
    with pytest.raises(ValueError, match="--moe-cpu-kernel"):
        load_kernel("fast", tmp_path)


def test_compile_error_is_reported(tmp_path, monkeypatch):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fake 1.0; exit 0; }\necho 'boom: bad flag' >&2\nexit 3\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(KernelBuildError, match="failed \\(3\\): boom: bad flag"):
        NativeExpertKernel.build(tmp_path)
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_native_refuses_float16_experts():
    with pytest.raises(ValueError, match="--moe-cpu-kernel native reads bfloat16 or float32"):
        CpuExpertPool(ExpertLayout(hidden=H, inter=I, dtype=torch.float16), kernel="native")


def test_bench_cpu_experts_times_every_configuration(tmp_path, capsys):
    import json

    from ferrylm.cli import main

    out = tmp_path / "ce.json"
    rc = main(["bench", "cpu-experts", "--hidden", "64", "--inter", "32", "--kernels", "torch,auto",
               "--threads", "1,2", "--experts", "1,3", "--jobs", "3", "--gap-ms", "0", "--bank-experts", "8",
               "--output-json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["threads"], r["experts"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)] * 2
    assert rows[0]["kernel"] == "torch" and rows[-1]["kernel"] != ""
    assert all(0 < r["median_s"] <= r["p90_s"] and r["gb_s"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert printed.count("experts/job") == 8


@pytest.mark.parametrize("flags, message", [
    (["--experts", "0"], "--experts takes a comma-separated list of integers >= 1"),
    (["--threads", "two"], "--threads takes"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--experts", "4", "--bank-experts", "2"], "--bank-experts must be >= 4"),
    (["--kernels", "fast"], "--kernels takes a comma-separated list of auto, native, torch"),
])
def test_bench_cpu_experts_bad_flags(flags, message, capsys):
    from ferrylm.cli import main

    assert main(["bench", "cpu-experts", "--hidden", "16", "--inter", "8", "--jobs", "1"] + flags) == 2
    assert message in capsys.readouterr().err
