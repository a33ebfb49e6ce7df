"""GLM-4.5 and MiniMax-M2 on a GPU (float32): decode CUDA graphs give the eager engine's greedy tokens and logprobs,
and both give transformers' greedy tokens, on the resident and offloading backends (the sigmoid routers and the
partial-rotary tables inside captured graphs). Skipped without CUDA. Written without a GPU at hand (CPU parity is in
tests/models/test_sigmoid_families.py)."""

from __future__ import annotations

import pytest
import torch
from tests.gpu.test_decode_graph_cuda import _generate  # greedy tokens + logprobs per request
from tests.models.hf_checkpoints import build_checkpoint, copy_config, hf_greedy, token_ids

from ferrylm.config import EngineConfig
from ferrylm.engine.decode_graph import MIN_KV_BUCKET
from ferrylm.engine.boot import build_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW = 12


@pytest.mark.parametrize("case,backend", [("glm4_moe", "resident"), ("glm4_moe", "offload"),
                                          ("glm4_moe_air", "hybrid"), ("minimax_m2", "resident"),
                                          ("minimax_m2", "offload")])
def test_cuda_graphs_match_eager_and_transformers(tmp_path, case, backend):
    ckpt = build_checkpoint(case, tmp_path / "m", seed=5)
    copy_config(ckpt.path, ckpt.path, max_position_embeddings=1024)
    prompts = {"a": token_ids(MIN_KV_BUCKET - 3, ckpt.vocab_size, seed=1).tolist(),  # crosses into bucket 512
               "b": token_ids(9, ckpt.vocab_size, seed=2).tolist()}
    results = {}
    for mode in ("off", "cuda"):
        cfg = EngineConfig(device="cuda", dtype="float32", num_pages=200, page_size=4, max_prefill_length=512,
                           max_running_requests=2, moe_backend=backend, moe_cache_size=3, decode_graphs=mode)
        engine = build_engine(ckpt.path, cfg)
        results[mode] = _generate(engine, prompts, NEW)
        if mode == "cuda":
            st = engine.stats()["decode_graphs"]
            assert st["captures"] >= 2 and st["replays"] >= 5, st
    assert results["cuda"][0] == results["off"][0]
    for rid, p in prompts.items():
        assert results["cuda"][1][rid] == pytest.approx(results["off"][1][rid], abs=1e-4)
        assert results["off"][0][rid] == hf_greedy(ckpt.reference, p, NEW), rid
