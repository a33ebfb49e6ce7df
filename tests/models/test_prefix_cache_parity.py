"""Greedy outputs of a tiny random checkpoint are the same with and without the prefix cache (issue 23), over
multi-turn prompts (each turn re-sends the history, the previous answer and a new message) and several
conversations sharing a system prefix, with chunked prefill and a pool small enough to evict."""

from __future__ import annotations

import pytest
import torch

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.engine import Engine
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.checkpoints.loader import load_model
from tests.models.hf_checkpoints import token_ids

CASES = ["qwen3_moe", "llama"]


def _engine(loaded, caching: bool) -> Engine:
    cfg = EngineConfig(device="cpu", check_invariants=True, num_pages=40, page_size=4, max_prefill_length=12,
                       max_running_requests=2, max_model_len=256, enable_prefix_caching=caching)
    return engine_for_model(loaded.model, loaded.config, cfg, device=torch.device("cpu"), dtype=torch.float32)


def _conversations(engine: Engine, vocab: int) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Two conversations x three turns, both at once each turn; returns every turn's output and cached tokens."""
    system = token_ids(18, vocab, seed=5).tolist()
    history = {c: system + token_ids(5, vocab, seed=10 + i).tolist() for i, c in enumerate("ab")}
    outs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for turn in range(3):
        for c in "ab":
            engine.add_request(f"{c}{turn}", history[c], params)
        for _ in range(1000):
            if not engine.has_work():
                break
            for o in engine.step():
                assert o.error_code is None, o.error_message
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.num_cached_tokens is not None:
                    cached[o.request_id] = o.num_cached_tokens
        for i, c in enumerate("ab"):
            history[c] = history[c] + outs[f"{c}{turn}"] + token_ids(4, vocab, seed=100 * turn + i).tolist()
    return outs, cached


@pytest.mark.parametrize("case", CASES)
def test_greedy_outputs_equal_with_and_without_prefix_cache(checkpoints, case):
    ckpt = checkpoints(case)
    loaded = load_model(ckpt.path, device="cpu", dtype=torch.float32)
    off, cached_off = _conversations(_engine(loaded, False), ckpt.vocab_size)
    eng = _engine(loaded, True)
    on, cached_on = _conversations(eng, ckpt.vocab_size)
    assert on == off
    assert set(cached_off.values()) == {0}
    # b0 maps the system pages a0 computed in its first 12-token chunk (a0 and b0 arrive together: b0 is
    # admitted a step later); later turns map their own history too
    assert cached_on["a0"] == 0 and cached_on["b0"] == 12
    assert cached_on["a2"] > cached_on["a1"] > 16 and cached_on["b2"] > cached_on["b1"] > 16
    assert eng.stats()["prefix_cache"]["hits"] == sum(cached_on.values())
