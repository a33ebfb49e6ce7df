"""Decode CUDA graphs (engine/decode_graph.py) on a GPU: captured and replayed steps give the plain forward's greedy
tokens and logprobs (float32), across batch sizes, a KV-bucket change and an executor with prefetch. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch
from tests.models.hf_checkpoints import build_checkpoint, copy_config, token_ids

from ferrylm.config import EngineConfig
from ferrylm.engine.decode_graph import MIN_KV_BUCKET
from ferrylm.engine.boot import build_engine
from ferrylm.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _generate(engine, prompts, new):
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=1)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    toks = {rid: [] for rid in prompts}
    lps = {rid: [] for rid in prompts}
    while engine.has_work():
        for o in engine.step():
            assert o.error_code is None, o.error_message
            toks[o.request_id].extend(o.new_token_ids)
            lps[o.request_id].extend(lp.logprob for lp in o.logprobs or [])
    return toks, lps


@pytest.mark.parametrize("case,backend", [("mixtral", "offload"), ("qwen2_moe", "resident"),
                                          ("qwen3_moe", "hybrid")])
def test_cuda_graphs_match_eager(tmp_path, case, backend):
    ckpt = build_checkpoint(case, tmp_path / "m", seed=5)
    copy_config(ckpt.path, ckpt.path, max_position_embeddings=1024)
    prompts = {"a": token_ids(MIN_KV_BUCKET - 3, ckpt.vocab_size, seed=1).tolist(),  # crosses into bucket 512
               "b": token_ids(9, ckpt.vocab_size, seed=2).tolist()}
    results = {}
    for mode in ("off", "cuda"):
        cfg = EngineConfig(device="cuda", dtype="float32", num_pages=200, page_size=4, max_prefill_length=512,
                           max_running_requests=2, moe_backend=backend, moe_cache_size=3, decode_graphs=mode)
        engine = build_engine(ckpt.path, cfg)
        results[mode] = _generate(engine, prompts, 12)
        if mode == "cuda":
            st = engine.stats()["decode_graphs"]
            if backend == "offload":  # the device table: whole-step graphs keyed by batch size only
                assert st["kind"] == "step" and st["replays"] >= 10, st
            else:
                assert st["captures"] >= 2 and st["replays"] >= 5, st  # (2, 256) and (2, 512) at least
    assert results["cuda"][0] == results["off"][0]
    for rid in prompts:
        assert results["cuda"][1][rid] == pytest.approx(results["off"][1][rid], abs=1e-4)
