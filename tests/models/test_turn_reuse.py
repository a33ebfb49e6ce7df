"""Prefix reuse across agent turns (issue 47), one tiny random checkpoint per family: turn 2 re-sends turn 1's prompt
and answer plus a new message and recomputes only the new tokens and the answer's last sampled token (never fed
through the model in turn 1); greedy outputs equal an engine without the prefix cache."""

from __future__ import annotations

import pytest
import torch

from ferrylm.checkpoints.loader import load_model
from ferrylm.config import EngineConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.sampling_params import SamplingParams
from tests.models.hf_checkpoints import token_ids

#: attention only, hybrid (Gated DeltaNet), MLA, sliding-window layers with sinks, GLM-4.5
FAMILIES = ["qwen3_moe", "qwen3_5_moe", "deepseek_v3", "gpt_oss", "glm4_moe"]


def _turn(engine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    out, cached = [], None
    while engine.has_work():
        for o in engine.step():
            assert o.error_code is None, o.error_message
            out.extend(o.new_token_ids)
            cached = o.num_cached_tokens if o.num_cached_tokens is not None else cached
    return out, cached


@pytest.mark.parametrize("case", FAMILIES)
def test_turn_two_recomputes_only_its_new_tokens(checkpoints, case):
    ckpt = checkpoints(case)
    loaded = load_model(ckpt.path, device="cpu", dtype=torch.float32)
    prompt = token_ids(22, ckpt.vocab_size, seed=7).tolist()
    new = token_ids(5, ckpt.vocab_size, seed=8).tolist()
    runs = {}
    for caching in (False, True):
        cfg = EngineConfig(device="cpu", check_invariants=True, num_pages=32, page_size=8, max_prefill_length=64,
                           max_running_requests=2, max_model_len=256, enable_prefix_caching=caching)
        engine = engine_for_model(loaded.model, loaded.config, cfg, device=torch.device("cpu"), dtype=torch.float32)
        out1, cached1 = _turn(engine, "t1", prompt)
        turn2 = prompt + out1 + new
        out2, cached2 = _turn(engine, "t2", turn2)
        runs[caching] = (out1, out2, cached1, cached2, len(turn2))
    assert runs[True][:2] == runs[False][:2]
    out1, _, cached1, cached2, n2 = runs[True]
    assert cached1 == 0 and runs[False][3] == 0
    assert cached2 == n2 - len(new) - 1, f"{case}: turn 2 reused {cached2} of {n2} tokens"
