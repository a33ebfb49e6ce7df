"""The piecewise decode path (engine/decode_graph.py) against the plain forward, on the CPU.

Mode ``eager`` runs exactly the pieces the CUDA graphs capture (static buffers, the KV-length bucket with its mask,
the grouped-query layout, RoPE rows bound from static buffers, the executor between pieces with the prediction
computed in the piece) without capturing them; the capture itself is checked on the GPU
(tests/gpu/test_decode_graph_cuda.py)."""

from __future__ import annotations

import pytest
from tests.models.hf_checkpoints import copy_checkpoint, copy_config, token_ids

from ferrylm.cli import build_parser, engine_config_from_args
from ferrylm.config import EngineConfig
from ferrylm.engine.decode_graph import MIN_KV_BUCKET, DecodeGraphConfig, kv_bucket
from ferrylm.engine.boot import build_engine
from ferrylm.engine.sampling_params import SamplingParams


def _generate(engine, prompts: dict[str, list[int]], new: int) -> tuple[dict, dict]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=2)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    toks = {rid: [] for rid in prompts}
    lps = {rid: [] for rid in prompts}
    for _ in range(2000):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error_code is None, o.error_message
            toks[o.request_id].extend(o.new_token_ids)
            lps[o.request_id].extend([lp.logprob for lp in o.logprobs] if o.logprobs else [])
    return toks, lps


def _config(mode: str, **kw) -> EngineConfig:
    base = dict(device="cpu", check_invariants=True, num_pages=160, page_size=4, max_prefill_length=64,
                max_running_requests=3, decode_graphs=mode)
    base.update(kw)
    return EngineConfig(**base)


def _compare(path, prompts, new, **kw):
    ref_engine = build_engine(path, _config("off", **kw))
    assert ref_engine.decode_graphs is None
    ref, ref_lp = _generate(ref_engine, prompts, new)
    engine = build_engine(path, _config("eager", **kw))
    got, got_lp = _generate(engine, prompts, new)
    assert got == ref
    for rid in prompts:
        assert got_lp[rid] == pytest.approx(ref_lp[rid], abs=1e-4)
    return engine


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe_step2", "llama_tied_bias"])
def test_piecewise_decode_matches_the_plain_forward(expert_checkpoints, case):
    """Batches of sequences of different lengths, dense and MoE layers, shared experts, tied embeddings: the
    same greedy tokens and logprobs (float32, 1e-4) as the plain forward."""
    ckpt = expert_checkpoints(case)
    prompts = {"a": token_ids(9, ckpt.vocab_size, seed=1).tolist(),
               "b": token_ids(21, ckpt.vocab_size, seed=2).tolist(),
               "c": token_ids(3, ckpt.vocab_size, seed=3).tolist()}
    engine = _compare(ckpt.path, prompts, 12)
    st = engine.stats()["decode_graphs"]
    assert st["mode"] == "eager" and st["steps"] >= 11  # every decode step went through the pieces
    assert st["keys"] == [] and st["captures"] == 0     # eager mode never captures


@pytest.mark.parametrize("slots", [3, 12])
def test_offload_staged_experts_and_prediction_inside_the_piece(expert_checkpoints, slots):
    """Offload with prefetch: the next layer's prediction computed in the piece reaches the executor
    (run with ids_and_predicted), prefetches happen; the expert GEMMs are staged into the next piece (ExpertStage), except for
    layers computed in waves (3 slots, 4 experts needed), which go through the stage's extra buffer; the tokens
    equal the plain forward's."""
    ckpt = expert_checkpoints("mixtral")
    prompts = {"a": token_ids(7, ckpt.vocab_size, seed=4).tolist(), "b": token_ids(13, ckpt.vocab_size, seed=5).tolist()}
    engine = _compare(ckpt.path, prompts, 10, moe_backend="offload", moe_cache_size=slots)
    ex = engine.stats()["experts"]
    assert ex["backend"] == "offload" and ex["prefetched"] > 0 and ex["prefetch_hits"] > 0
    st = engine.stats()["decode_graphs"]
    assert st["staged_layers"] > 0
    if slots == 12:  # a layer needs 4 experts at most: never in waves, all staged
        assert st["unstaged_layers"] == 0
    else:            # two tokens choosing 4 distinct experts of a layer do not fit 3 slots: waves, eager
        assert st["unstaged_layers"] > 0


def test_hybrid_stages_layers_without_cpu_work(expert_checkpoints):
    """Hybrid: layers whose misses were all prefetched are staged into the next piece; layers with CPU work are
    computed eagerly and reach the piece through the stage's extra buffer; the tokens equal the plain forward's."""
    ckpt = expert_checkpoints("mixtral")
    prompts = {"a": token_ids(7, ckpt.vocab_size, seed=4).tolist(), "b": token_ids(13, ckpt.vocab_size, seed=5).tolist()}
    engine = _compare(ckpt.path, prompts, 10, moe_backend="hybrid", moe_cache_size=3)
    ex, st = engine.stats()["experts"], engine.stats()["decode_graphs"]
    assert ex["cpu_experts"] > 0 and st["staged_layers"] > 0 and st["unstaged_layers"] > 0


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_eager_layers_then_a_kv_bucket_change(expert_checkpoints, tmp_path, monkeypatch, backend):
    """A layer computed eagerly (waves, CPU work; forced here for the last MoE layer) leaves its output in the
    stage's extra buffer, which the KV buckets of one batch size share: the first staged layer after a bucket
    change must clear it (a regression: the flag lived on the bucket and a stale output was added to the
    residual from the bucket change on)."""
    from ferrylm.experts.cached import CachedExecutor

    run = CachedExecutor.run

    def last_layer_eager(self, layer_idx, hidden, ids, weights, *, ids_and_predicted=None, stage=None):
        if layer_idx == max(self.banks.layers):  # as if this layer ran in waves
            stage = None
        return run(self, layer_idx, hidden, ids, weights, ids_and_predicted=ids_and_predicted, stage=stage)

    monkeypatch.setattr(CachedExecutor, "run", last_layer_eager)
    ckpt = expert_checkpoints("mixtral")
    path = copy_checkpoint(ckpt.path, tmp_path / "long")
    copy_config(ckpt.path, path, max_position_embeddings=1024)
    prompts = {"a": token_ids(MIN_KV_BUCKET - 3, ckpt.vocab_size, seed=4).tolist(),
               "b": token_ids(9, ckpt.vocab_size, seed=5).tolist()}
    engine = _compare(path, prompts, 12, max_prefill_length=512, moe_backend=backend, moe_cache_size=12)
    st = engine.stats()["decode_graphs"]
    assert st["staged_layers"] > 0 and st["unstaged_layers"] > 0


def test_kv_bucket_change_and_fallbacks(expert_checkpoints, tmp_path):
    """A sequence crossing the first KV bucket (256 -> 512 tokens) keeps matching; batches larger than
    --cuda-graph-max-batch and sequences longer than --cuda-graph-max-len take the plain forward."""
    ckpt = expert_checkpoints("qwen3_moe")
    path = copy_checkpoint(ckpt.path, tmp_path / "long")
    copy_config(ckpt.path, path, max_position_embeddings=1024)
    prompts = {"long": token_ids(MIN_KV_BUCKET - 4, ckpt.vocab_size, seed=6).tolist(),
               "short": token_ids(5, ckpt.vocab_size, seed=7).tolist()}
    engine = _compare(path, prompts, 10, max_prefill_length=512, cuda_graph_max_len=MIN_KV_BUCKET + 2)
    st = engine.stats()["decode_graphs"]
    assert st["steps"] >= 4           # the first decode steps went through the pieces ...
    assert st["steps"] < 9            # ... not those past --cuda-graph-max-len (plain forward)
    one = build_engine(ckpt.path, _config("eager", cuda_graph_max_batch=1))
    toks, _ = _generate(one, {"a": prompts["short"], "b": token_ids(6, ckpt.vocab_size, seed=8).tolist()}, 6)
    assert one.stats()["decode_graphs"]["steps"] == 0  # two sequences decode together: above the max batch
    assert all(len(t) == 6 for t in toks.values())


def test_kv_bucket():
    assert kv_bucket(1) == MIN_KV_BUCKET and kv_bucket(MIN_KV_BUCKET) == MIN_KV_BUCKET
    assert kv_bucket(MIN_KV_BUCKET + 1) == 2 * MIN_KV_BUCKET and kv_bucket(5000) == 8192


def test_modes_and_flags():
    import torch

    assert DecodeGraphConfig().resolved(torch.device("cpu")) == "off"  # auto: CUDA graphs only on CUDA
    with pytest.raises(ValueError, match="enforce-eager"):
        DecodeGraphConfig(mode="cuda").resolved(torch.device("cpu"))
    ec = engine_config_from_args(build_parser().parse_args(["serve", "--enforce-eager"]))
    assert ec.decode_graphs == "off"
    ec = engine_config_from_args(build_parser().parse_args(["serve", "--cuda-graph-max-batch", "4"]))
    assert (ec.decode_graphs, ec.cuda_graph_max_batch) == ("auto", 4)
    with pytest.raises(ValueError, match="--cuda-graph-max-batch"):
        engine_config_from_args(build_parser().parse_args(["serve", "--cuda-graph-max-batch", "0"]))
    with pytest.raises(ValueError, match="decode_graphs"):
        EngineConfig(decode_graphs="sometimes").validate()


def test_allocation_failure_in_the_graph_path_falls_back_to_the_plain_forward(expert_checkpoints, monkeypatch):
    """An allocation failure while a new key's buffers are made (or its first run) costs nothing but the graphs of
    that key: the step runs the plain forward, the tokens are the plain forward's, the key stays disabled."""
    import torch

    from ferrylm.engine.decode_graph import DecodeGraphRunner

    ckpt = expert_checkpoints("qwen3_moe")
    prompts = {"a": token_ids(9, ckpt.vocab_size, seed=1).tolist()}
    ref, _ = _generate(build_engine(ckpt.path, _config("off")), prompts, 6)
    calls = []

    def out_of_memory(self, batch, kv_len):
        calls.append((batch, kv_len))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    monkeypatch.setattr(DecodeGraphRunner, "_key", out_of_memory)
    engine = build_engine(ckpt.path, _config("eager"))
    got, _ = _generate(engine, prompts, 6)
    assert got == ref
    assert (1, 256) in calls and len(calls) == len(set(calls))  # each key failed once, then was disabled ...
    assert not engine.decode_graphs.accepts(1, 12)     # ... for its batch size and KV bucket
    assert engine.decode_graphs.accepts(2, 12)
