"""The native CPU expert kernel (experts/cpu_kernel.py): arithmetic against a float64 reference, the pool's use of
it against the torch path, and its build failures (auto falls back, native raises)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.cpu_kernel import ISAS, KernelBuildError, NativeExpertKernel, load_kernel
from ferrylm.experts.cpu_pool import CpuExpertPool, CpuJob
from tests.experts.helpers import kernel_isa

H, I = 83, 37  # not multiples of 8 or 16: the vector loops' scalar tails run in both passes


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
    starts = [sum(counts[:e]) for e in range(len(counts))]
    for threads in (1, 3):
        out = kernel.run(x, w, rows, starts, counts, H, I, threads)
        assert out.shape == (m, H) and out.dtype == torch.float32
        ref = reference(x, w, rows, counts)
        # float32 accumulation of exactly widened weights: float32 rounding only
        assert (out.double() - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


def test_spans_in_any_order_and_rows_nobody_owns(kernel):
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(3 * I * H, generator=g) * 0.2 for _ in range(2)]
    x, w = torch.randn(6, H, generator=g), torch.rand(6, generator=g)
    out = kernel.run(x, w, rows, [4, 0], [2, 3], H, I, 2)  # expert 0 owns rows 4-5, expert 1 rows 0-2; 3 is free
    ref = reference(torch.cat([x[4:6], x[0:3]]), torch.cat([w[4:6], w[0:3]]), rows, [2, 3])
    assert torch.allclose(out[4:6].double(), ref[:2], atol=1e-5) and torch.allclose(out[0:3].double(), ref[2:],
                                                                                       atol=1e-5)
    assert not out[3].any()


@pytest.mark.parametrize("call, match", [
    (lambda k, r: k.run(torch.zeros(2, H), torch.ones(2), r, [0], [1], H, I, 1), None),  # a row nobody owns: fine
    (lambda k, r: k.run(torch.zeros(2, H), torch.ones(2), r, [0, 0], [1], H, I, 1), "one of each per expert"),
    (lambda k, r: k.run(torch.zeros(1, 8), torch.ones(1), r, [0], [1], H, I, 1), "x must be"),
    (lambda k, r: k.run(torch.zeros(3, H), torch.ones(1), r, [0], [1], H, I, 1), "weights"),
    (lambda k, r: k.run(torch.zeros(2, H), torch.ones(2), r, [1], [2], H, I, 1), "within the 2 rows"),
    (lambda k, r: k.run(torch.zeros(2, H), torch.ones(2), r, [0], [-1], H, I, 1), "within"),
    (lambda k, r: k.run(torch.zeros(2, H), torch.ones(2), r * 2, [0, 0], [2, 1], H, I, 1), "not overlap"),
    (lambda k, r: k.run(torch.zeros(1, H), torch.ones(1), r, [0], [1], H, I, 0), "threads must be >= 1"),
    (lambda k, r: k.run(torch.zeros(1, H), torch.ones(1), [torch.zeros(3 * I * H, dtype=torch.float16)], [0], [1],
                        H, I, 1), "contiguous"),
    (lambda k, r: k.run(torch.zeros(1, H), torch.ones(1), [torch.zeros(2, 3 * I * H)[:, 0]], [0], [1], H, I, 1),
     "contiguous"),
    (lambda k, r: k.run(torch.zeros(1, H, device="meta"), torch.ones(1), r, [0], [1], H, I, 1), "host tensors"),
])
def test_rejects_bad_arguments(kernel, call, match):
    rows = [torch.zeros(3 * I * H)]
    if match is None:
        assert call(kernel, rows).shape == (2, H)
        return
    with pytest.raises(ValueError, match=match):
        call(kernel, rows)


def _seed_cache(root, kernel):
    """``root``'s kernel cache holding a copy of the session's build (its name is the cache key): the tests below
    compile only what they are about."""
    lib = root / "kernels" / kernel.path.name
    lib.parent.mkdir(parents=True)
    shutil.copyfile(kernel.path, lib)
    return lib


def test_build_is_cached(tmp_path, kernel):
    lib = _seed_cache(tmp_path, kernel)   # the same sources, command and compiler give the same key
    mtime = lib.stat().st_mtime_ns
    b = NativeExpertKernel.build(tmp_path)
    assert b.path == lib and lib.stat().st_mtime_ns == mtime
    assert b.isa == kernel.isa and b.isa in ("avx512", "avx2", "scalar")


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
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fake 1.0; exit 0; }\n"
                  "echo 'boom: bad flag' >&2\nexit 3\n")
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
    (["--experts", "4", "--bank-experts", "2"], "--bank-experts (2) must be >= the largest --experts value (4)"),
    (["--kernels", "fast"], "--kernels takes a comma-separated list of auto, native, torch"),
])
def test_bench_cpu_experts_bad_flags(flags, message, capsys):
    from ferrylm.cli import main

    assert main(["bench", "cpu-experts", "--hidden", "16", "--inter", "8", "--jobs", "1"] + flags) == 2
    assert message in capsys.readouterr().err


def test_unwritable_cache_builds_uncached_with_a_warning(tmp_path, kernel, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # <root>/kernels cannot be created under a file
    with caplog.at_level(logging.WARNING, logger="ferrylm.experts"):
        k = NativeExpertKernel.build(blocker)
    assert "cannot write the kernel cache" in caplog.text
    assert not str(k.path).startswith(str(blocker)) and k.isa == kernel.isa
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ferrylm.experts"):   # built once per process, not per caller
        assert NativeExpertKernel.build(blocker) is k and not caplog.text
    rows = [torch.ones(3 * I * H) * 0.01]
    out = k.run(torch.ones(1, H), torch.ones(1), rows, [0], [1], H, I, 1)
    assert torch.allclose(out.double(), reference(torch.ones(1, H), torch.ones(1), rows, [1]), atol=1e-6)


def test_compiler_command_with_arguments(tmp_path, kernel, monkeypatch):
    _seed_cache(tmp_path, kernel)
    plain = NativeExpertKernel.build(tmp_path)
    monkeypatch.setenv("CC", "env cc")  # a wrapper plus the compiler, as "ccache gcc"
    wrapped = NativeExpertKernel.build(tmp_path)
    assert wrapped.path.parent == plain.path.parent == tmp_path / "kernels"
    assert wrapped.path != plain.path  # the compile command is part of the cache key


def test_pool_falls_back_to_torch_when_spans_do_not_tile_x(kernel):
    layout = ExpertLayout(hidden=H, inter=I, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    bank = torch.randn(2, layout.numel, generator=g) * 0.2
    x, w = torch.randn(3, H, generator=g), torch.rand(3, generator=g)
    job = CpuJob(x=x, weights=w, items=[(0, bank[0], 2, 1), (1, bank[1], 0, 2)], out_dtype=torch.float32)
    assert not CpuExpertPool._native_fits(job)
    pool = CpuExpertPool(layout, kernel="native")
    try:
        outs, _ = pool.submit(job).result()
    finally:
        pool.close()
    assert [o.shape[0] for o in outs] == [1, 2]  # the torch path: one output per item, in item order
    ref = reference(torch.cat([x[2:3], x[0:2]]), torch.cat([w[2:3], w[0:2]]), [bank[0], bank[1]], [1, 2])
    assert torch.allclose(torch.cat(outs).double(), ref, atol=1e-5)


def test_a_compiler_that_writes_nothing_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "true")  # exits 0, writes no library
    with pytest.raises(KernelBuildError, match="wrote no library"):
        NativeExpertKernel.build(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ferrylm.experts"):
        assert load_kernel("auto", tmp_path) is None
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_a_broken_cached_library_is_rebuilt(tmp_path, kernel, caplog):
    broken = _seed_cache(tmp_path / "b", kernel)  # the session build's cache key in another cache folder
    broken.write_bytes(b"not an ELF file")  # (never overwrite a loaded library in place: it is mapped)
    with caplog.at_level(logging.WARNING, logger="ferrylm.experts"):
        rebuilt = NativeExpertKernel.build(tmp_path / "b")
    assert "does not load" in caplog.text and "rebuilding" in caplog.text
    assert rebuilt.path == broken and broken.read_bytes()[:4] == b"\x7fELF"
    rows = [torch.ones(3 * I * H) * 0.01]
    out = rebuilt.run(torch.ones(1, H), torch.ones(1), rows, [0], [1], H, I, 1)
    assert torch.allclose(out.double(), reference(torch.ones(1, H), torch.ones(1), rows, [1]), atol=1e-6)


def test_more_threads_than_cpus_warns(caplog):
    import os

    layout = ExpertLayout(hidden=H, inter=I, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="ferrylm.experts"):
            CpuExpertPool(layout, threads=(os.cpu_count() or 1) + 3, kernel="torch").close()
        assert "oversubscribed" in caplog.text and "--moe-cpu-threads" in caplog.text and "process-wide" in caplog.text
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_bench_cpu_experts_dma_on_needs_cuda(capsys):
    from ferrylm.cli import main

    assert main(["bench", "cpu-experts", "--hidden", "16", "--inter", "8", "--jobs", "1", "--dma", "on"]) == 2
    assert "--dma on needs a CUDA device" in capsys.readouterr().err


QUANT = {
    "int4": ("int4", 32, torch.bfloat16, False, False),
    "int4-mins": ("int4", 16, torch.float32, True, False),
    "int8": ("int8", 32, torch.float16, False, False),
    "int8-mins": ("int8", 16, torch.float32, True, False),
    "fp4-mx": ("fp4", 32, torch.bfloat16, False, False),
    "fp4-nv": ("fp4", 16, torch.float8_e4m3fn, False, True),
    "fp8": ("fp8", 32, torch.float32, False, False),
    "Q8_0": ("q8_0", 32, torch.bfloat16, False, False),  # GGML blocks, kept as a GGUF file's bytes
    "Q4_K": ("q4_k", 256, torch.bfloat16, False, False),
    "Q5_K": ("q5_k", 256, torch.bfloat16, False, False),
    "Q6_K": ("q6_k", 256, torch.bfloat16, False, False),
    "Q4_K|Q5_K|Q6_K": ("kmix", 256, torch.bfloat16, False, False),  # a kind per expert
}


ACT_TOL = 5e-2  # integer kinds: 8-bit activations (two roundings of up to 1/254 of a 32-block's largest input)


def _quant_layout(name, e, seed):
    """``e`` random experts of QUANT[name] (odd H / I multiples of 32 where the group allows), packed in a bank."""
    from ferrylm.experts.executor import LayerExperts
    from ferrylm.experts.quantized import QuantFormat, random_quant

    kind, group, sdt, mins, row = QUANT[name]
    mix = ("q4_k", "q5_k", "q6_k") if kind == "kmix" else ()
    fmt = QuantFormat(kind, group, sdt, mins=mins, row_scale=row, mix=mix)
    h, i = (160, 96) if group < 256 else (256, 512)
    g = torch.Generator().manual_seed(seed)
    le = LayerExperts(random_quant(fmt, (e,), i, h, generator=g, std=h ** -0.5, dtype=torch.float32),
                      random_quant(fmt, (e,), i, h, generator=g, std=h ** -0.5, dtype=torch.float32),
                      random_quant(fmt, (e,), h, i, generator=g, std=i ** -0.5, dtype=torch.float32))
    layout = ExpertLayout.of(le)
    bank = torch.zeros(e, layout.numel, dtype=torch.uint8)
    layout.pack(bank, le)
    return le, layout, bank, g


def _swiglu_reference(le, x, w, counts):
    i, ref, s = le.gate.shape[-2], [], 0
    for j, n in enumerate(counts):
        gu = x[s:s + n].double() @ torch.cat([le.gate[j].dequantize(torch.float64),
                                              le.up[j].dequantize(torch.float64)]).T
        ref.append((F.silu(gu[:, :i]) * gu[:, i:]) @ le.down[j].dequantize(torch.float64).T * w[s:s + n, None].double())
        s += n
    return torch.cat(ref)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(QUANT))
@pytest.mark.parametrize("counts", [[1, 3, 5], [3, 1, 8, 2, 1], [2, 37, 9]])  # 37: three 16-token lane tiles
def test_quantized_rows_match_the_dequantized_reference(kernel, isa, name, counts):
    """Every format on every instruction set, odd token and expert counts (from 8 tokens an expert's Q4_K / Q8_0 rows
    take the AVX-512 lanes, a tile per 16 tokens): the whole expert against float64 SwiGLU
    on the torch reference's dequantized weights (fp8: float32 activations, float32 rounding only; the integer kinds:
    within ACT_TOL, their 8-bit activations), and the pool routes decode jobs of quantized rows to the kernel."""
    k = kernel_isa(kernel, isa)
    le, layout, bank, g = _quant_layout(name, len(counts), len(name) + sum(counts))
    assert NativeExpertKernel.supports(layout)
    h, m = layout.hidden, sum(counts)
    x, w = torch.randn(m, h, generator=g), torch.rand(m, generator=g)
    starts = [sum(counts[:j]) for j in range(len(counts))]
    got = k.run(x, w, list(bank.unbind(0)), starts, counts, h, layout.inter, threads=2, layout=layout)
    ref = _swiglu_reference(le, x, w, counts)
    tol = 1e-5 if name == "fp8" else ACT_TOL
    assert ((got.double() - ref).norm() / ref.norm()).item() < tol
    if isa != kernel.isa:
        return
    pool = CpuExpertPool(layout, threads=2, kernel="native")
    try:
        job = CpuJob(x=x, weights=w, items=[(j, bank[j], starts[j], n) for j, n in enumerate(counts)],
                     out_dtype=torch.float32)
        outs, _ = pool.submit(job).result()
        assert pool.kernel_name.startswith("native") and len(outs) >= 1  # a long job may run as several calls
        assert ((torch.cat(outs).double() - ref).norm() / ref.norm()).item() < tol
    finally:
        pool.close()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", [n for n in QUANT if n != "fp8"])
def test_decoded_rows_equal_the_reference_dequantization(kernel, isa, name):
    """The integer kinds' row decoding (``v * s + o``) against the torch reference, bit for bit: GGML blocks against
    gguf-py too (its dequantize is ggml's); int8 with mins within two float32 roundings of the row's largest value
    (``(u - 128) * s + (128 s - m)`` instead of ``u * s - m``)."""
    k = kernel_isa(kernel, isa)
    le, layout, bank, _ = _quant_layout(name, 3, 11)
    for e in range(3):
        for part, want in (("gate_up", torch.cat([le.gate[e].dequantize(torch.float32),
                                                  le.up[e].dequantize(torch.float32)])),
                           ("down", le.down[e].dequantize(torch.float32))):
            got = k.dequantize(bank[e], layout, part)
            if name == "int8-mins":
                assert (got - want).abs().max() <= 2 ** -22 * want.abs().max() and not torch.equal(got, want)
            else:
                assert torch.equal(got, want), (name, isa, e, part)
            kind = QUANT[name][0]
            if kind in ("q8_0", "q4_k", "q5_k", "q6_k"):
                gguf = pytest.importorskip("gguf")
                src = le.down[e] if part == "down" else le.gate[e]
                oracle = gguf.quants.dequantize(src.data.numpy(), getattr(gguf.GGMLQuantizationType, kind.upper()))
                n = src.data.shape[0]
                assert torch.equal(got[:n], torch.from_numpy(oracle).float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(QUANT))
@pytest.mark.parametrize("m", [1, 3, 7])
def test_projection_is_exact_on_the_quantized_activation(kernel, isa, name, m):
    """One projection (gate|up) against float64 on the dequantized weights and the activation as the kernel
    quantizes it (``q * d``): float32 accumulation only, relative error < 1e-5."""
    k = kernel_isa(kernel, isa)
    le, layout, bank, g = _quant_layout(name, 2, 5 + m)
    x = torch.randn(m, layout.hidden, generator=g)
    w = torch.cat([le.gate[1].dequantize(torch.float64), le.up[1].dequantize(torch.float64)])
    got = k.project(x, bank[1], layout, "gate_up", threads=2)
    if name == "fp8":
        xs = x.double()
    else:
        block = 256 if QUANT[name][0] in ("q4_k", "q5_k", "q6_k", "kmix") else 32  # K-quants: ggml's Q8_K
        q, d = k.quantize_activation(x, block)
        xs = (q.double().view(m, -1, block) * d.double()[..., None]).view(m, -1)
        assert (xs - x.double()).abs().max() <= x.abs().max() / 254 + 1e-7
    ref = xs @ w.T
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5


def _stacks(name, seed):
    """Three experts as separate gate / up / down stacks (as a GGUF's mapped tensors): GGML blocks, or bfloat16."""
    from ferrylm.experts.executor import LayerExperts

    if name != "bf16":
        return _quant_layout(name, 3, seed)[0]
    g = torch.Generator().manual_seed(seed)
    h, i = 160, 96
    return LayerExperts(*(torch.randn(3, n, kk, generator=g).mul_(kk ** -0.5).bfloat16()
                          for n, kk in ((i, h), (i, h), (h, i))))


def _dense(t, e):
    return t[e].double() if isinstance(t, torch.Tensor) else t[e].dequantize(torch.float64)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "bf16"])
def test_stacks_are_read_where_they_lie(kernel, isa, name):
    """Experts whose gate, up and down are separate stacks (a GGUF file's blocks, read in place), a subset out of
    order with odd token counts: the SwiGLU of each against float64 on the reference dequantization."""
    k = kernel_isa(kernel, isa)
    le = _stacks(name, 3)
    assert k.reads_stacks(le)
    h = le.down.shape[-2] if isinstance(le.down, torch.Tensor) else le.down.data.shape[-2]
    experts, counts = [2, 0], [3, 1]
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, h, generator=g), torch.rand(4, generator=g)
    got = k.run_stacks(x, w, k.stack_rows(le), experts, [0, 3], counts, threads=2)
    ref, s = [], 0
    for e, n in zip(experts, counts):
        xe = x[s:s + n].double()
        gate, up = xe @ _dense(le.gate, e).T, xe @ _dense(le.up, e).T
        ref.append((F.silu(gate) * up) @ _dense(le.down, e).T * w[s:s + n, None].double())
        s += n
    ref = torch.cat(ref)
    assert ((got.double() - ref).norm() / ref.norm()).item() < (1e-5 if name == "bf16" else ACT_TOL)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "bf16"])
@pytest.mark.parametrize("tokens", [3, 20])
def test_resident_on_the_cpu_runs_the_native_kernel(kernel, name, tokens, monkeypatch):
    """The resident backend on the CPU computes a step's quantized experts with the native kernel in one call per
    layer at any step size (plain ones stay on torch) and agrees with the torch reference path."""
    from ferrylm.experts.resident import ResidentExecutor

    le = _stacks(name, 5)
    h = le.down.shape[-2] if isinstance(le.down, torch.Tensor) else le.down.data.shape[-2]
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, h, generator=g).to(torch.bfloat16 if name == "bf16" else torch.float32)
    ids = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    calls = []
    run_routed = kernel.run_routed
    monkeypatch.setattr(kernel, "run_routed", lambda *a, **kw: calls.append(1) or run_routed(*a, **kw))
    got = ResidentExecutor({0: le}, native=kernel, threads=2).run(0, hidden, ids, weights)
    want = ResidentExecutor({0: le}).run(0, hidden, ids, weights)
    assert len(calls) == (0 if name == "bf16" else 1)
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() < ACT_TOL


def test_a_whole_layer_call_groups_its_assignments_in_c(kernel):
    """run_routed groups a step's [T, k] assignments by expert in C (repeats of an expert across tokens, a token's
    ids in any order) and sums each token's outputs as the per-expert calls would; an id outside the layer's
    experts is refused before any work; the number of experts used comes back."""
    le = _stacks("Q4_K", 3)
    rows = kernel.stack_rows(le)
    h = le.down.data.shape[-2]
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    w = torch.tensor([[0.5, 0.25], [0.5, 0.75], [0.125, 1.0]])
    used, got = kernel.run_routed(x, rows, ids, w, 2)
    assert used == 3
    per = {e: kernel.run_stacks(x, torch.ones(3), rows, [e], [0], [3], 2) for e in range(3)}   # every token, e
    want = torch.stack([sum(w[t, j] * per[int(ids[t, j])][t] for j in sorted(range(2), key=lambda j: int(ids[t, j])))
                        for t in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for bad in (torch.tensor([[2, 0], [0, 3], [2, 1]]), torch.tensor([[2, 0], [-1, 1], [2, 1]])):
        with pytest.raises(ValueError, match="native expert kernel"):
            kernel.run_routed(x, rows, bad, w, 2)
    with pytest.raises(ValueError, match="topk ids and weights"):
        kernel.run_routed(x, rows, ids, w[:2], 2)
