"""The synthetic routing model: each calibrated profile reproduces its published statistics within tolerance,
routing is deterministic per seed, a token's routing does not depend on the rest of the batch (nor on how its
sequence is chunked), and a synthetic model routes through it (``synthetic:<preset>:routing=<profile>``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrylm.bench.routing_report import profile_statistics, profile_trace
from ferrylm.errors import ModelLoadError
from ferrylm.models.moe import SparseMoeBlock
from ferrylm.synthetic.routing_model import RoutingContext, RoutingModel, hash_fold, sequence_key, to_uniform
from ferrylm.synthetic.routing_profiles import PROFILES, ROUTER, get_profile
from ferrylm.synthetic.routing_stats import lru_hit_rate, repeat_next, reuse_within, trace_stats
from ferrylm.synthetic.presets import PRESETS, SyntheticPreset
from ferrylm.synthetic.spec import SyntheticSpec, parse_synthetic_spec
from ferrylm.checkpoints.synthetic_build import build_synthetic
from tests.models.test_synthetic import TINY_SHAPES, logits

# |reproduced - published| allowed per statistic (absolute; reuse distance in tokens). The fits sit well inside
# these (docs/ROUTING.md); the slack covers the sampling noise of 2 x 1024 tokens x 3 layers.
TOLERANCE = {"repeat_next": 0.06, "reuse_within_8": 0.06, "median_reuse_distance": 1.0, "lru_40pct": 0.06,
             "top_half_share": 0.06, "jaccard_next": 0.07, "lru_64": 0.06, "lru_128": 0.06,
             "predict_recall": 0.12}


@pytest.mark.parametrize("name", ["qwen3", "olmoe", "wide512"])
def test_profile_reproduces_its_published_statistics(name):
    prof = PROFILES[name]
    stats = profile_statistics(name)   # 2 x 1024 tokens x 3 layers (OLMoE: 64 x 128, a corpus-level share)
    assert prof.targets
    for key, target in prof.targets.items():
        assert abs(stats[key] - target) <= TOLERANCE[key], (name, key, stats[key], target, stats)


def test_uniform_has_no_locality_and_calibrated_profiles_do():
    trace, recall = profile_trace("uniform", seqs=1, tokens=512)
    u = trace_stats(trace, 128)
    # independent uniform top-8 of 128: 1/16 repeat at the next token, LRU at 40 % residency hits ~40 %
    assert abs(u["repeat_next"] - 8 / 128) < 0.02 and abs(u["lru_40pct"] - 0.4) < 0.04
    assert recall < 0.15
    q = trace_stats(profile_trace("qwen3", seqs=1, tokens=512)[0], 128)
    assert q["repeat_next"] > 4 * u["repeat_next"] and q["lru_40pct"] > u["lru_40pct"] + 0.3


def test_statistics_on_hand_made_traces():
    ids = np.array([[0, 1], [0, 2], [3, 4], [0, 1]])
    assert repeat_next(ids, 8) == pytest.approx((1 + 0 + 0) / (2 * 3))
    assert reuse_within(ids, 8, window=2) == pytest.approx(1 / 4)  # of tokens 2-3, only t=3 expert 0
    assert lru_hit_rate(ids, slots=2, warmup=0) == pytest.approx(1 / 8)


def test_deterministic_per_seed_and_distinct_across_seeds():
    prof = get_profile("qwen3")
    keys, pos = torch.full((64,), 5, dtype=torch.int64), torch.arange(64)
    a = RoutingModel(prof, 128, 8, seed=1, layers=range(2)).route(1, keys, pos)
    b = RoutingModel(prof, 128, 8, seed=1, layers=range(2)).route(1, keys, pos)
    c = RoutingModel(prof, 128, 8, seed=2, layers=range(2)).route(1, keys, pos)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a.sort(1).values.diff(1) > 0).all()  # k distinct experts per token
    other_key = RoutingModel(prof, 128, 8, seed=1, layers=range(2)).route(1, keys + 1, pos)
    assert not torch.equal(a, other_key)


def test_a_requests_routing_ignores_the_rest_of_the_batch_and_the_chunking():
    model = RoutingModel(get_profile("qwen3"), 128, 8, seed=0, layers=range(4))
    key_a, key_b = sequence_key([1, 2, 3]), sequence_key([9, 9])
    alone = model.route(2, torch.full((40,), key_a), torch.arange(40))
    # the same sequence, decoded in a batch with another one at other positions, in two chunks
    batch_pos = torch.cat([torch.arange(0, 25), torch.arange(100, 108), torch.arange(25, 40)])
    batch_key = torch.cat([torch.full((25,), key_a), torch.full((8,), key_b), torch.full((15,), key_a)])
    mixed = model.route(2, batch_key, batch_pos)
    assert torch.equal(torch.cat([mixed[:25], mixed[33:]]), alone)
    assert torch.equal(model.predict(3, batch_key, batch_pos)[33:], model.predict(3, torch.full((15,), key_a),
                                                                                  torch.arange(25, 40)))


def test_hash_is_uniform_enough():
    u = to_uniform(hash_fold(3, torch.arange(200_000)))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.005
    hist = torch.histc(u, bins=20, min=0, max=1) / u.numel()
    assert (hist - 0.05).abs().max() < 0.003


def tiny_qwen3(experts: int = 32, top_k: int = 4) -> SyntheticPreset:
    cfg = {**PRESETS["qwen3-30b-a3b"].config, **TINY_SHAPES, "num_hidden_layers": 2, "num_experts": experts,
           "num_experts_per_tok": top_k}
    return SyntheticPreset("tiny-qwen3-30b-a3b", "test", cfg)


def test_synthetic_model_routes_through_the_profile():
    spec = SyntheticSpec(tiny_qwen3(), layers=2, seed=3, routing="qwen3")
    loaded = build_synthetic(spec)
    blocks = [m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.routing is not None for b in blocks)
    seen = {}
    for b in blocks:
        route = b.route

        def record(hidden, b=b, route=route):
            ids, w = route(hidden)
            seen[b.layer_idx] = (ids, w)
            return ids, w
        b.route = record
    n = 48
    out = logits(loaded, torch.arange(n) % 90)
    assert torch.isfinite(out).all()
    ref = RoutingModel(get_profile("qwen3"), 32, 4, seed=3, layers=(0, 1))
    for layer, (ids, w) in seen.items():
        assert torch.equal(ids, ref.route(layer, torch.zeros(n, dtype=torch.int64), torch.arange(n)))
        assert torch.allclose(w.sum(-1), torch.ones(n))  # Qwen3 renormalises the kept weights
    # the router's own choice would differ (the routing model replaced it)
    plain = build_synthetic(SyntheticSpec(tiny_qwen3(), layers=2, seed=3))
    assert all(b.routing is None for b in plain.model.modules() if isinstance(b, SparseMoeBlock))


def test_context_keys_separate_sequences():
    ctx = RoutingContext()
    with pytest.raises(RuntimeError):
        ctx.current()
    ctx.bind(torch.arange(4))
    keys, _ = ctx.current()
    assert keys.tolist() == [0, 0, 0, 0]
    ctx.set_keys(torch.tensor([1, 1, 2, 2]))
    assert ctx.current()[0].tolist() == [1, 1, 2, 2]
    ctx.bind(torch.arange(3))  # a different step shape: stale keys are not used
    assert ctx.current()[0].tolist() == [0, 0, 0]


def test_spec_routing_option():
    assert parse_synthetic_spec("synthetic:qwen3-30b-a3b:layers=2").routing == "qwen3"
    assert parse_synthetic_spec("synthetic:olmoe-1b-7b").routing == "olmoe"
    assert parse_synthetic_spec("synthetic:qwen3-30b-a3b:skew=1").routing == ROUTER
    assert parse_synthetic_spec("synthetic:mixtral-8x7b").routing == ROUTER
    s = parse_synthetic_spec("synthetic:qwen3-30b-a3b:layers=2:routing=uniform")
    assert s.routing == "uniform" and s.name == "synthetic:qwen3-30b-a3b:layers=2:routing=uniform"
    assert parse_synthetic_spec(s.name) == s
    assert parse_synthetic_spec("synthetic:qwen3-30b-a3b:layers=2").name == "synthetic:qwen3-30b-a3b:layers=2"
    with pytest.raises(ModelLoadError, match="unknown routing 'zipf'.*router, uniform, qwen3"):
        parse_synthetic_spec("synthetic:qwen3-30b-a3b:routing=zipf")
    cfg = parse_synthetic_spec("synthetic:qwen3-30b-a3b:layers=2:routing=wide512:seed=4").config()
    assert cfg["ferrylm_routing"] == {"profile": "wide512", "seed": 4}


def test_engine_decode_routes_by_position(monkeypatch, tmp_path):
    """Through the engine (paged KV, chunked prefill, batched decode): every token's experts are the routing
    model's at its own position and under its own request's key (positions bound by the decoder layers, keys by
    the model runner from the packed step: two requests in one batch route as independent sequences)."""
    from ferrylm.engine.sampling_params import SamplingParams
    from ferrylm.llm import LLM

    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(PRESETS, "tiny-routing", tiny_qwen3())
    llm = LLM("synthetic:tiny-routing:routing=qwen3:seed=2", device="cpu", num_pages=32)
    blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.routing is not None for b in blocks)
    seen = []
    run = blocks[0].executor.run

    def record(layer, hidden, ids, weights, **kw):
        keys, pos = blocks[0].routing_context.current()
        seen.append((layer, keys.clone(), pos.clone(), ids.clone()))
        return run(layer, hidden, ids, weights, **kw)
    monkeypatch.setattr(blocks[0].executor, "run", record)
    out = llm.generate([[1, 2, 3, 4, 5], [6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    ref = RoutingModel(get_profile("qwen3"), 32, 4, seed=2, layers=(0, 1))
    assert len(seen) >= 2 * 4
    want = {sequence_key([1, 2, 3, 4, 5]), sequence_key([6, 7])}
    used = set()
    for layer, keys, pos, ids in seen:
        assert torch.equal(ids, ref.route(layer, keys, pos))
        used.update(keys.tolist())
    assert used == want


@pytest.mark.parametrize("name", ["qwen3", "olmoe", "wide512", "uniform"])
def test_route_all_layers_at_once_is_bit_identical_to_per_layer(name):
    prof = get_profile(name)
    e, k = prof.shape
    model = RoutingModel(prof, e, k, seed=4, layers=(0, 1, 2, 5))
    keys = torch.tensor([sequence_key([1]), sequence_key([2]), sequence_key([1])] * 3)
    pos = torch.tensor([0, 7, 1, 300, 301, 2, 9000, 9001, 3])
    ids, pred = model.route_all(keys, pos)
    for i, layer in enumerate(model.layers):
        assert model.layer_slot(layer) == i
        assert torch.equal(ids[i], model.route(layer, keys, pos)), (name, layer)
        assert torch.equal(pred[i], model.predict(layer, keys, pos)), (name, layer)
    assert model.batches_layers(16) and not model.batches_layers(1 << 20)


def test_context_routes_a_step_once_and_drops_it_at_the_next_first_layer():
    model = RoutingModel(get_profile("qwen3"), 128, 8, seed=0, layers=(0, 1))
    first, other = object(), object()
    ctx = RoutingContext(first_layer=first)
    ctx.bind(torch.arange(4), first)
    a = ctx.choose(model, 1)
    step = ctx._all
    ctx.bind(torch.arange(4), other)            # a later layer of the same step: routed once, reused
    assert torch.equal(ctx.choose(model, 1), a) and ctx._all is step
    ctx.bind(torch.arange(10, 14), first)       # the next step
    assert torch.equal(ctx.choose(model, 1), model.route(1, torch.zeros(4, dtype=torch.int64), torch.arange(10, 14)))
    assert torch.equal(ctx.choose(model, 1, predict=True),
                       model.predict(1, torch.zeros(4, dtype=torch.int64), torch.arange(10, 14)))


def test_prediction_breaks_ties_to_the_lower_expert_id():
    """The uniform profile scores every expert alike before its fresh field: the prediction is the first k ids on
    every device (a CUDA topk and a CPU topk break ties differently)."""
    prof = get_profile("uniform")
    e, k = prof.shape
    model = RoutingModel(prof, e, k, seed=3, layers=range(2))
    keys, pos = torch.arange(5) * 977, torch.arange(5)
    pred = model.predict(1, keys, pos)
    assert torch.equal(pred, torch.arange(k).expand(5, k))
    assert torch.equal(model.route_all(keys, pos)[1][model.layer_slot(1)], pred)
