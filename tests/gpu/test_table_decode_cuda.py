"""The offload backend's device table on a GPU (experts/slot_table.py): whole-step decode graphs keyed by batch size
only, misses installed into their layer's slot pool by the device inside the step (the rest read from mapped host
banks by the fused kernel). Greedy tokens equal the
resident backend's (float32), with a cache smaller than one step's needs and with every expert cached, at contexts
across the old 8192-token graph boundary and at 30k tokens; a decode step makes no host sync. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch
from tests.gpu.test_decode_graph_cuda import _generate
from tests.models.hf_checkpoints import build_checkpoint, copy_config, token_ids

from ferrylm.config import EngineConfig
from ferrylm.engine.boot import build_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(path, backend, **kw):
    base = dict(device="cuda", dtype="float32", page_size=16, max_prefill_length=2048, max_running_requests=4,
                moe_backend=backend)
    base.update(kw)
    return build_engine(path, EngineConfig(**base))


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("cache", [3, 4096], ids=["small-cache", "all-cached"])  # 4096: every expert
def test_table_graphs_equal_resident(tmp_path, case, cache):
    ckpt = build_checkpoint(case, tmp_path / "m", seed=11)
    copy_config(ckpt.path, ckpt.path, max_position_embeddings=2048)
    prompts = {"a": token_ids(300, ckpt.vocab_size, seed=1).tolist(), "b": token_ids(9, ckpt.vocab_size, seed=2).tolist(),
               "c": token_ids(40, ckpt.vocab_size, seed=3).tolist()}
    ref = _generate(_engine(ckpt.path, "resident", num_pages=128, decode_graphs="off"), prompts, 16)
    eng = _engine(ckpt.path, "offload", num_pages=128, moe_cache_size=cache)
    got = _generate(eng, prompts, 16)
    assert got[0] == ref[0], "greedy tokens differ from resident"
    for rid in prompts:
        assert got[1][rid] == pytest.approx(ref[1][rid], abs=1e-4)
    st = eng.stats()
    g = st["decode_graphs"]
    assert g["kind"] == "step" and g["replays"] >= 12, g
    ex = st["experts"]
    assert ex["hits"] + ex["misses"] == ex["needed"] > 0
    if cache == 4096:
        assert ex["misses"] == 0, ex
    else:
        assert ex["fetched"] > 0 and ex["bytes_mapped"] == ex["mapped"] * ex["expert_bytes"], ex
        assert ex["prefetched"] == 0, ex  # table steps install on demand only


@pytest.mark.parametrize("length", [8190, 30000])
def test_long_context_decodes_graphed(tmp_path, length):
    """Past the old 8192-token limit of the piecewise graphs: still one graph per step, same tokens as resident."""
    ckpt = build_checkpoint("qwen3_moe", tmp_path / "m", seed=4)
    copy_config(ckpt.path, ckpt.path, max_position_embeddings=32768)
    prompts = {"long": token_ids(length, ckpt.vocab_size, seed=9).tolist(),  # with a short one: batch 2, the table
               "short": token_ids(7, ckpt.vocab_size, seed=8).tolist()}
    kw = dict(num_tokens=32768 + 64, max_prefill_length=8192, max_running_requests=2)
    ref = _generate(_engine(ckpt.path, "resident", **kw), prompts, 12)
    eng = _engine(ckpt.path, "offload", moe_cache_size=3, **kw)
    got = _generate(eng, prompts, 12)
    assert got[0] == ref[0]
    g = eng.stats()["decode_graphs"]
    assert g["kind"] == "step" and g["replays"] >= 10, g


@pytest.mark.parametrize("backend", ["offload", "resident"])
def test_decode_step_forward_makes_no_host_sync(tmp_path, backend):
    """torch's sync debug mode set to error around every decode forward (eager, graphs off): any synchronizing
    torch call inside the step raises."""
    ckpt = build_checkpoint("mixtral", tmp_path / "m", seed=2)
    copy_config(ckpt.path, ckpt.path, max_position_embeddings=1024)
    eng = _engine(ckpt.path, backend, num_pages=64, moe_cache_size=3 if backend == "offload" else None,
                  decode_graphs="off")
    model = eng.runner.model
    orig = model.forward
    checked = []

    def forward(ids, positions, attn):
        if ids.shape[0] <= 2:  # the decode steps of this test (2 sequences)
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = orig(ids, positions, attn)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            checked.append(ids.shape[0])
            return out
        return orig(ids, positions, attn)

    model.forward = forward
    prompts = {"a": token_ids(30, ckpt.vocab_size, seed=1).tolist(), "b": token_ids(20, ckpt.vocab_size, seed=2).tolist()}
    _generate(eng, prompts, 8)
    assert len(checked) >= 6, checked
