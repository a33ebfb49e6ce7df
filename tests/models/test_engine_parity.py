"""Every architecture through the engine (paged KV, two prompts batched, chunked prefill) generates exactly what
transformers' greedy ``generate`` does, 16 tokens per prompt."""

from __future__ import annotations

import pytest
import torch

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.checkpoints.loader import load_model
from tests.models.hf_checkpoints import token_ids

NEW_TOKENS = 16
# one per architecture added after Mixtral / Llama
ARCH_CASES = ["qwen3_moe", "qwen2_moe", "olmoe_clip", "qwen2", "qwen3", "glm4_moe", "minimax_m2", "qwen3_next",
              "qwen3_5_moe", "deepseek_v3", "deepseek_v3_lite", "gpt_oss"]


def hf_greedy(reference, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation; EOS suppressed for the first NEW_TOKENS like ``min_tokens`` does."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ARCH_CASES)
def test_engine_greedy_equals_transformers_generate(checkpoints, case):
    ckpt = checkpoints(case)
    loaded = load_model(ckpt.path, device="cpu", dtype=torch.float32)
    # 4-token pages and an 8-token step budget: prompts are prefilled in chunks while the other one decodes
    cfg = EngineConfig(device="cpu", check_invariants=True, num_pages=32, page_size=4, max_prefill_length=8,
                       max_running_requests=2, max_model_len=128)
    engine = engine_for_model(loaded.model, loaded.config, cfg, device=torch.device("cpu"), dtype=torch.float32)
    prompts = {"a": token_ids(11, ckpt.vocab_size, seed=21).tolist(),
               "b": token_ids(23, ckpt.vocab_size, seed=22).tolist()}
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    ours: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(500):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error_code is None, o.error_message
            ours[o.request_id].extend(o.new_token_ids)
    assert not engine.has_work()
    for rid, p in prompts.items():
        assert len(ours[rid]) == NEW_TOKENS
        assert ours[rid] == hf_greedy(ckpt.reference, p), f"{case}: prompt {rid} differs from transformers"

