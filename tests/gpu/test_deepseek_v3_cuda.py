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
from ferrylm.engine.factory import build_engine

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
