"""Greedy outputs through the engine (paged KV, continuous batching) equal each prompt run alone, and equal
transformers' own greedy generation, on tiny random Llama and Mixtral checkpoints."""

from __future__ import annotations

import pytest
import torch

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.engine import Engine
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.checkpoints.loader import load_model
from tests.models.hf_checkpoints import build_checkpoint, token_ids


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def ckpt(request, tmp_path_factory):
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=3)


def engine_for(ckpt, **kw) -> Engine:
    loaded = load_model(ckpt.path, device="cpu", dtype=torch.float32)
    cfg = EngineConfig(device="cpu", check_invariants=True, **kw)
    return engine_for_model(loaded.model, loaded.config, cfg, device=torch.device("cpu"), dtype=torch.float32)


def generate(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        # min_tokens (EOS banned, as HF min_new_tokens does), not ignore_eos (which would emit EOS)
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(5000):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error_code is None, o.error_message
            out[o.request_id].extend(o.new_token_ids)
    assert not engine.has_work()
    return out


def test_batched_chunked_preempted_equals_solo_and_transformers(ckpt):
    lengths = [3, 17, 40, 9, 26]
    prompts = {str(i): token_ids(n, ckpt.vocab_size, seed=i).tolist() for i, n in enumerate(lengths)}
    max_tokens = 10
    solo = {}
    for rid, p in prompts.items():
        solo.update(generate(engine_for(ckpt, num_pages=64, page_size=4), {rid: p}, max_tokens))
    # transformers' greedy generate is the reference for the solo runs
    for rid, p in prompts.items():
        with torch.no_grad():
            ref = ckpt.reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                          max_new_tokens=max_tokens, do_sample=False,
                                          min_new_tokens=max_tokens, pad_token_id=0)
        assert solo[rid] == ref[0, len(p):].tolist(), f"prompt {rid} differs from transformers"
    # tiny step budget forces chunked prefill; a 25-page x 4-token pool forces preemption
    eng = engine_for(ckpt, num_pages=25, page_size=4, max_prefill_length=8, max_running_requests=5)
    together = generate(eng, prompts, max_tokens)
    assert together == solo
    assert eng.scheduler.num_preemptions > 0
