"""Qwen3-Next and Qwen3.5-MoE on a GPU (float32): the chunk form of the gated delta rule on CUDA against the
recurrence at the published head shapes; the engine (boot warmup, Triton attention, the recurrent-state pool, whole-step and piecewise decode CUDA graphs with the linear layers' slots as
static buffers)
against transformers (greedy tokens equal, each chosen token's logprob within 1e-4 of transformers' full-sequence
log-softmax) with three concurrent requests of different lengths, and the graphs against the eager engine. Skipped
without CUDA. Written without a GPU at hand (the CPU parity is tests/models/test_qwen3_next.py)."""

from __future__ import annotations

import pytest
import torch
from tests.gpu.test_decode_graph_cuda import _generate  # greedy tokens + logprobs per request
from tests.models.hf_checkpoints import build_checkpoint, copy_config, token_ids
from tests.models.test_qwen3_next import hf_greedy

from ferrylm.config import EngineConfig
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.boot import build_engine
from ferrylm.models.kernels.gated_delta import gated_delta_chunked, gated_delta_recurrent, l2_normalize

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW = 12


@pytest.mark.parametrize("t", [1, 100, 1000])
def test_chunk_form_on_cuda_at_published_head_shapes(t):
    g = torch.Generator().manual_seed(t)
    h, dk, dv = 4, 128, 128
    q = (l2_normalize(torch.randn(t, h, dk, generator=g)) * dk ** -0.5).cuda()
    k = l2_normalize(torch.randn(t, h, dk, generator=g)).cuda()
    v = torch.randn(t, h, dv, generator=g).cuda()
    decay = (-torch.rand(t, h, generator=g) * 0.1).cuda()
    beta = torch.rand(t, h, generator=g).cuda()
    s0 = torch.randn(h, dk, dv, generator=g).cuda()
    out, state = gated_delta_chunked(q, k, v, decay, beta, s0)
    ref, ref_state = gated_delta_recurrent(q.cpu(), k.cpu(), v.cpu(), decay.cpu(), beta.cpu(), s0.cpu())
    torch.testing.assert_close(out.cpu(), ref, atol=5e-4, rtol=5e-4)
    torch.testing.assert_close(state.cpu(), ref_state, atol=5e-4, rtol=5e-4)


def _reference_logprobs(reference, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-softmax of each generated token at its position (one full-sequence forward)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(reference(input_ids=ids).logits[0].float(), dim=-1)
    return [float(lp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(tokens)]


@pytest.mark.parametrize("case,backend", [("qwen3_next", "resident"), ("qwen3_5_moe", "resident"),
                                          ("qwen3_next", "offload"), ("qwen3_5_moe", "hybrid")])
def test_engine_on_cuda_matches_transformers_with_and_without_graphs(tmp_path, case, backend):
    ckpt = build_checkpoint(case, tmp_path / "m", seed=5)
    copy_config(ckpt.path, ckpt.path, max_position_embeddings=1024)
    prompts = {"a": token_ids(70, ckpt.vocab_size, seed=1).tolist(),    # several 16-token chunks across pages
               "b": token_ids(9, ckpt.vocab_size, seed=2).tolist(),
               "c": token_ids(33, ckpt.vocab_size, seed=3).tolist()}
    results = {}
    for mode in ("off", "cuda"):
        cfg = EngineConfig(device="cuda", dtype="float32", num_pages=200, page_size=4, max_prefill_length=16,
                           max_running_requests=3, moe_backend=backend, moe_cache_size=3, decode_graphs=mode,
                           check_invariants=True)
        engine = build_engine(ckpt.path, cfg)
        assert engine.state_pool is not None and engine.state_snapshots is not None
        results[mode] = _generate(engine, prompts, NEW)
        assert engine.state_pool.num_free == engine.state_pool.num_slots
        if mode == "cuda":   # the linear layers ran inside captured graphs (whole-step, or piecewise for hybrid)
            st = engine.stats()["decode_graphs"]
            replays = st.get("replays", 0) + (st.get("piecewise") or {}).get("replays", 0)
            assert replays >= 1, st
            if backend == "resident":
                assert st["kind"] == "step" and st["replays"] >= NEW, st
    assert results["cuda"][0] == results["off"][0]
    for rid, p in prompts.items():
        assert results["cuda"][1][rid] == pytest.approx(results["off"][1][rid], abs=1e-4)
        assert results["off"][0][rid] == hf_greedy(ckpt.reference, p, NEW), rid
        want = _reference_logprobs(ckpt.reference, p, results["off"][0][rid])
        assert results["off"][1][rid] == pytest.approx(want, abs=1e-4), rid


def test_deltanet_scratch_oom_on_cuda_is_survived(tmp_path):
    """An injected OOM inside the DeltaNet layers of a prefill on the GPU: the engine recovers and generates
    transformers' tokens."""
    ckpt = build_checkpoint("qwen3_next", tmp_path / "m", seed=7)
    cfg = EngineConfig(device="cuda", dtype="float32", num_pages=100, page_size=4, max_prefill_length=16,
                       max_running_requests=2, faults="deltanet_scratch:after=3:times=1")
    engine = build_engine(ckpt.path, cfg)
    prompts = {"a": token_ids(40, ckpt.vocab_size, seed=4).tolist(),
               "b": token_ids(12, ckpt.vocab_size, seed=5).tolist()}
    toks, _ = _generate(engine, prompts, 6)
    for rid, p in prompts.items():
        assert toks[rid] == hf_greedy(ckpt.reference, p, 6), rid
    assert engine.faults._fired["deltanet_scratch"] == 1
    assert sum(engine.guard.recoveries.values()) + engine.scheduler.num_preemptions >= 1


def test_prefix_cache_snapshots_on_cuda(tmp_path):
    """A repeated prompt on the GPU maps its cached pages and restores the recurrent-state snapshot at their end:
    the same greedy tokens as the first run and as transformers, with its cached tokens reported."""
    ckpt = build_checkpoint("qwen3_5_moe", tmp_path / "m", seed=9)
    cfg = EngineConfig(device="cuda", dtype="float32", num_pages=100, page_size=4, max_prefill_length=16,
                       max_running_requests=2, check_invariants=True)
    engine = build_engine(ckpt.path, cfg)
    p = token_ids(45, ckpt.vocab_size, seed=6).tolist()
    first, _ = _generate(engine, {"a": p}, 6)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("b", p, params)
    toks, cached = [], None
    while engine.has_work():
        for o in engine.step():
            assert o.error_code is None, o.error_message
            toks.extend(o.new_token_ids)
            cached = o.num_cached_tokens if o.num_cached_tokens is not None else cached
    assert cached == 44 and engine.state_snapshots.restores == 1
    assert toks == first["a"] == hf_greedy(ckpt.reference, p, 6)
