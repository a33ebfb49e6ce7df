"""Batch invariance on both built-in models: greedy outputs of mixed-length prompts run together — with chunked
prefill forced by a tiny step budget and preemption forced by a tiny pool — equal each prompt run alone."""

from __future__ import annotations

import pytest
import torch

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.engine import Engine
from ferrylm.checkpoints import builtin
from ferrylm.checkpoints.loader import load_model
from ferrylm.server.text.tokenizer import TextCodec
from tests.engine.test_batch_invariance import generate

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Hi",
           "List three prime numbers and explain why each is prime, in one sentence per number."]


@pytest.fixture(scope="module", params=["smollm2-135m", "smollm2-moe"])
def loaded(request):
    try:
        path = builtin.ensure_builtin(request.param, progress=False)
    except Exception as e:
        pytest.skip(str(e))
    codec = TextCodec.from_pretrained(path)
    prompts = {str(i): codec.apply_chat_template([{"role": "user", "content": p}]) for i, p in enumerate(PROMPTS)}
    return load_model(path, dtype=torch.float32), prompts


def make(loaded_model, **kw) -> Engine:
    cfg = EngineConfig(device="cpu", check_invariants=True, **kw)
    return engine_for_model(loaded_model.model, loaded_model.config, cfg, device=torch.device("cpu"), dtype=torch.float32)


def test_builtin_batch_invariance(loaded):
    lm, prompts = loaded
    max_tokens = 8
    solo = {}
    for rid, p in prompts.items():
        solo.update(generate(make(lm, num_tokens=256), {rid: p}, max_tokens))
    longest = max(len(p) for p in prompts.values())
    # pool: room for the longest request plus one page, so running several at once needs preemption
    pages = -(-(longest + max_tokens) // 16) + 1
    # without the prefix cache: the chat template's shared system prompt would otherwise share pages and spare
    # the preemptions this test is about
    eng = make(lm, num_pages=pages, page_size=16, max_prefill_length=24, max_running_requests=3,
               enable_prefix_caching=False)
    together = generate(eng, prompts, max_tokens)
    assert together == solo
    assert eng.scheduler.num_preemptions > 0
    cached = make(lm, num_pages=pages, page_size=16, max_prefill_length=24, max_running_requests=3)
    assert generate(cached, prompts, max_tokens) == solo
    assert cached.stats()["prefix_cache"]["hits"] > 0
