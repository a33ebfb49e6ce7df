"""DeepSeek-V3 (multi-head latent attention over the latent KV pool) on a GPU. Skipped without CUDA; written without
a GPU at hand (the CPU parity against transformers is tests/models/test_deepseek_v3.py).

* float32: decode CUDA graphs (whole-step graphs for resident / offload, whose captured decode runs
  ``TritonPagedAttention.attend_latent``: the Triton row store and latent decode kernel of
  ``engine/attention/triton_latent.py``; the piecewise graphs for hybrid / cpu, whose decode runs
  ``StaticDecodeAttention.attend_latent``) give the eager engine's greedy tokens exactly and its logprobs within
  1e-4, and both give transformers' greedy tokens;
* the Triton backend (its latent decode kernel for decodes, the torch dispatch for prefill chunks) equals the torch
  backend, and the kernel alone equals the torch absorbed decode at DeepSeek-V3's shapes (R 512, P 64, 128 heads);
* bfloat16: graph and eager tokens identical; the first token's logprob within 0.1 of float32's (bf16 activations
  and a bf16 latent pool: about 3 significant digits per product, 0.1 nats covers the tiny models' logits);
* a second turn whose first pages come from the prefix cache gives transformers' tokens.
"""

from __future__ import annotations

import pytest
import torch
from tests.gpu.test_decode_graph_cuda import _generate  # greedy tokens + logprobs per request
from tests.models.hf_checkpoints import build_checkpoint, copy_config, hf_greedy, token_ids

from ferrylm.config import EngineConfig
from ferrylm.engine.decode_graph import MIN_KV_BUCKET
from ferrylm.engine.boot import build_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW = 12
BF16_TOL = 0.1  # nats: bf16 first-token logprob vs float32


def _checkpoint(tmp_path, case):
    ckpt = build_checkpoint(case, tmp_path / "m", seed=5)
    copy_config(ckpt.path, ckpt.path, max_position_embeddings=1024)  # yarn factor is explicit: same frequencies
    return ckpt


def _prompts(vocab: int) -> dict[str, list[int]]:
    return {"a": token_ids(MIN_KV_BUCKET - 3, vocab, seed=1).tolist(),  # decodes cross into KV bucket 512
            "b": token_ids(9, vocab, seed=2).tolist()}


def _config(backend: str, **kw) -> EngineConfig:
    base = dict(device="cuda", dtype="float32", num_pages=200, page_size=4, max_prefill_length=512,
                max_running_requests=2, moe_backend=backend, moe_cache_size=3)
    return EngineConfig(**{**base, **kw})


@pytest.mark.parametrize("case,backend", [("deepseek_v3", "resident"), ("deepseek_v3", "offload"),
                                          ("deepseek_v3_lite", "hybrid"), ("deepseek_v3_lite", "resident"),
                                          ("deepseek_v3", "cpu")])
def test_cuda_graphs_match_eager_and_transformers(tmp_path, case, backend):
    ckpt = _checkpoint(tmp_path, case)
    prompts = _prompts(ckpt.vocab_size)
    results = {}
    for mode in ("off", "cuda"):
        engine = build_engine(ckpt.path, _config(backend, decode_graphs=mode))
        results[mode] = _generate(engine, prompts, NEW)
        if mode == "cuda":
            st = engine.stats()["decode_graphs"]
            assert st["replays"] >= 5, st
    assert results["cuda"][0] == results["off"][0]
    for rid, p in prompts.items():
        assert results["cuda"][1][rid] == pytest.approx(results["off"][1][rid], abs=1e-4)
        assert results["off"][0][rid] == hf_greedy(ckpt.reference, p, NEW), rid


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v3_lite"])
def test_triton_backend_equals_torch_backend(tmp_path, case):
    ckpt = _checkpoint(tmp_path, case)
    prompts = _prompts(ckpt.vocab_size)
    runs = {name: _generate(build_engine(ckpt.path, _config("resident", decode_graphs="off",
                                                            attention_backend=name)), prompts, NEW)
            for name in ("triton", "torch")}
    assert runs["triton"][0] == runs["torch"][0]
    for rid in prompts:
        assert runs["triton"][1][rid] == pytest.approx(runs["torch"][1][rid], abs=1e-4)


@pytest.mark.parametrize("backend", ["resident", "offload"])
def test_bfloat16_graphs_equal_eager_and_stay_near_float32(tmp_path, backend):
    ckpt = _checkpoint(tmp_path, "deepseek_v3")
    prompts = _prompts(ckpt.vocab_size)
    runs = {(dtype, mode): _generate(build_engine(ckpt.path, _config(backend, dtype=dtype, decode_graphs=mode)),
                                     prompts, NEW)
            for dtype in ("bfloat16", "float32") for mode in ("off", "cuda")}
    assert runs[("bfloat16", "cuda")][0] == runs[("bfloat16", "off")][0]
    for rid in prompts:
        first_bf16 = runs[("bfloat16", "off")][1][rid][0]
        assert first_bf16 == pytest.approx(runs[("float32", "off")][1][rid][0], abs=BF16_TOL)


def test_prefix_cached_turn_matches_transformers(tmp_path):
    ckpt = _checkpoint(tmp_path, "deepseek_v3")
    engine = build_engine(ckpt.path, _config("resident", enable_prefix_caching=True))
    first = token_ids(40, ckpt.vocab_size, seed=3).tolist()
    _generate(engine, {"a": first}, 4)
    second = first[:32] + token_ids(6, ckpt.vocab_size, seed=4).tolist()
    toks, _ = _generate(engine, {"b": second}, NEW)
    assert toks["b"] == hf_greedy(ckpt.reference, second, NEW)
    assert engine.stats()["prefix_cache"]["hits"] >= 32


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_latent_decode_kernel_at_deepseek_v3_shapes(dtype, tol):
    """The Triton latent decode kernel against the torch absorbed decode: 128 heads, R 512, P 64, 16-token pages,
    lengths from 1 to 3000 (float32: TF32-free ``ieee`` dots, tolerance for the summation order; bfloat16 inputs,
    float32 accumulation)."""
    import ferrylm.models.latent_attention as la
    from ferrylm.engine.attention.triton_latent import latent_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    heads, r, p, ps, lens = 128, 512, 64, 16, [1, 17, 640, 3000]
    pages = -(-max(lens) // ps)
    cache = torch.randn(len(lens) * pages * ps, 1, r + p, device="cuda", generator=g).to(dtype)
    table = torch.randperm(len(lens) * pages, device="cuda", generator=g).view(len(lens), pages).to(torch.int32)
    q_abs = torch.randn(len(lens), heads, r, device="cuda", generator=g).to(dtype) * 0.05
    q_pe = torch.randn(len(lens), heads, p, device="cuda", generator=g).to(dtype) * 0.05
    scale = (128 + 64) ** -0.5
    got = latent_decode_attention(q_abs, q_pe, cache, table, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                  scale, ps)
    for b, n in enumerate(lens):
        slots = (table[b].long()[:, None] * ps + torch.arange(ps, device="cuda")).reshape(-1)[:n]
        want = la.absorbed_attention(q_abs[b:b + 1, :, None].float(), q_pe[b:b + 1, :, None].float(),
                                     cache[slots, 0][None].float(), r, scale)[0, :, 0]
        torch.testing.assert_close(got[b].float(), want, atol=tol, rtol=tol)


def _chunk_inputs(tq: int, prefix: int, seed: int = 1):
    """DeepSeek-V3's MLA shapes (128 heads, N 128, P 64, V 128, R 512) in bf16: a chunk of ``tq`` queries after
    ``prefix`` cached rows."""
    import ferrylm.models.latent_attention as la

    h, n, p, v, r = 128, 128, 64, 128, 512
    g = torch.Generator(device="cuda").manual_seed(seed)
    proj = la.LatentProjection.of((torch.randn(h * (n + v), r, device="cuda", generator=g) * r ** -0.5).bfloat16(),
                                  h, n, v)
    latent = torch.randn(prefix + tq, r + p, device="cuda", generator=g).bfloat16()
    q_nope = torch.randn(tq, h, n, device="cuda", generator=g).bfloat16()
    q_pe = torch.randn(tq, h, p, device="cuda", generator=g).bfloat16()
    return q_nope, q_pe, latent, proj, (n + p) ** -0.5


def _timed_chunk(q_nope, q_pe, latent, proj, scale, prefix):
    """(output, ms, peak bytes above what was allocated before the call)."""
    import ferrylm.models.latent_attention as la

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    got = la.latent_chunk_attention(q_nope, q_pe, latent, proj, scale, q_offset=prefix)
    end.record()
    torch.cuda.synchronize()
    return got, start.elapsed_time(end), torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("tq", [128, 2048, 8192])   # absorbed, expanded, a whole default chunk
@pytest.mark.parametrize("flash", [True, False])
def test_chunk_attention_workspace_bounded_by_the_chunk(monkeypatch, tq, flash):
    """A bf16 prefill chunk of ``tq`` queries after a 14k-token prefix takes no more memory than after a 2k one
    (unblocked float32 scores alone would be ``128 * tq * 16384 * 4`` bytes: 17 GiB at 2048), under 1.5 GiB above
    its inputs up to 2048 queries; sampled rows equal float32 attention over the expanded keys. ``flash``: the
    expanded form on flash kernels (the default on CUDA) or the torch key blocks. Times printed as [measured]."""
    import ferrylm.models.latent_attention as la

    if not flash:
        monkeypatch.setattr(la, "flash_usable", lambda x: False)
    r, short, prefix = 512, 2048, 14336
    _, _, peak_short = _timed_chunk(*_chunk_inputs(tq, short), short)
    q_nope, q_pe, latent, proj, scale = _chunk_inputs(tq, prefix)
    _timed_chunk(q_nope, q_pe, latent, proj, scale, prefix)           # first call: kernels compiled / loaded
    got, ms, peak = _timed_chunk(q_nope, q_pe, latent, proj, scale, prefix)
    form = "absorbed" if la.absorb_wins(tq, r, 128, 64, 128) else ("expanded/flash" if flash else "expanded/torch")
    flops = 2 * 128 * tq * (prefix + tq / 2) * (192 + 128)
    print(f"\n[measured] MLA chunk tq={tq} prefix={prefix} {form}: {ms:.1f} ms ({flops / ms / 1e9:.0f} TFLOP/s of "
          f"attention), peak workspace {peak / 2**20:.0f} MiB (prefix {short}: {peak_short / 2**20:.0f} MiB)")
    assert peak <= peak_short * 1.1 + 64 * 2**20
    if tq <= 2048:
        assert peak < 1.5 * 2**30
    length = prefix + tq
    rows = torch.tensor([0, 1, tq // 2, tq - 1], device="cuda")
    k, vals = proj.expand(latent.float()[:, :r], latent.float()[:, r:])            # [L, H, N + P], [L, H, V]
    q = torch.cat((q_nope, q_pe), dim=-1).float()[rows]                            # [4, H, N + P]
    s = torch.einsum("thd,lhd->htl", q, k) * scale
    s = s.masked_fill(torch.arange(length, device="cuda")[None, None] > (prefix + rows)[None, :, None], float("-inf"))
    want = torch.einsum("htl,lhv->thv", torch.softmax(s, dim=-1), vals)
    torch.testing.assert_close(got[rows].float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("batch", [1, 8])
def test_latent_decode_kernel_at_30k_context(batch):
    """The Triton latent decode kernel at a 30000-token context (bf16, 128 heads, R 512, P 64), without split-KV
    and with the splits a decode step gets (``decode_splits``): equal to the torch absorbed decode, and its time
    against the latent bytes it must read from HBM (printed as [measured])."""
    import ferrylm.models.latent_attention as la
    from ferrylm.engine.attention.metadata import decode_splits
    from ferrylm.engine.attention.triton_latent import latent_decode_attention

    g = torch.Generator(device="cuda").manual_seed(2)
    heads, r, p, ps, n = 128, 512, 64, 16, 30000
    pages = -(-n // ps)
    cache = torch.randn(batch * pages * ps, 1, r + p, device="cuda", generator=g).bfloat16()
    table = torch.randperm(batch * pages, device="cuda", generator=g).view(batch, pages).to(torch.int32)
    q_abs = (torch.randn(batch, heads, r, device="cuda", generator=g) * 0.05).bfloat16()
    q_pe = (torch.randn(batch, heads, p, device="cuda", generator=g) * 0.05).bfloat16()
    lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    scale = (128 + 64) ** -0.5
    nbytes = batch * n * (r + p) * 2
    splits = decode_splits(batch, 1, torch.cuda.get_device_properties(0).multi_processor_count)
    for num_splits in sorted({1, splits}):
        got = latent_decode_attention(q_abs, q_pe, cache, table, lens, scale, ps, num_splits=num_splits)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            latent_decode_attention(q_abs, q_pe, cache, table, lens, scale, ps, num_splits=num_splits)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        print(f"\n[measured] MLA decode kernel, batch {batch} x {n} tokens, {num_splits} splits: {ms:.3f} ms per "
              f"layer, {nbytes / 2**20:.1f} MiB of latent -> {nbytes / ms / 1e6:.0f} GB/s")
        for b in range(batch):
            slots = (table[b].long()[:, None] * ps + torch.arange(ps, device="cuda")).reshape(-1)[:n]
            want = la.absorbed_attention(q_abs[b:b + 1, :, None].float(), q_pe[b:b + 1, :, None].float(),
                                         cache[slots, 0][None].float(), r, scale)[0, :, 0]
            torch.testing.assert_close(got[b].float(), want, atol=3e-2, rtol=3e-2)
