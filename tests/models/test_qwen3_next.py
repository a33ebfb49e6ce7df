"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5-MoE (Qwen3_5MoeForCausalLM) against transformers (5.x) on tiny
random checkpoints written by ``save_pretrained``: float32 logits within 1e-4 for a whole prompt and for a chunked
prefill + decode, and through ferrylm's engine (paged KV, the recurrent-state pool, chunked prefill across pages,
three concurrent requests of different lengths) on every expert backend: every sampled row's logits within 1e-4 of
transformers' full-sequence logits, greedy tokens identical to transformers' greedy continuation."""

from __future__ import annotations

import json

import pytest
import torch
from tests.experts.helpers import options
from tests.models.hf_checkpoints import reference_logits, token_ids

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.engine import Engine
from ferrylm.engine.cache.kv_pool import KVLayout
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.cache.state_pool import StateLayout
from ferrylm.errors import ModelLoadError
from ferrylm.models.reference_attention import DenseCausalAttention, SequenceCacheAttention
from ferrylm.checkpoints.loader import load_model

TOL = 1e-4
CASES = ["qwen3_next", "qwen3_5_moe"]
NEW_TOKENS = 10


def hf_greedy(reference, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, every token from a full forward of the sequence so far (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(torch.argmax(reference(input_ids=torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt):]


@pytest.mark.parametrize("case", CASES)
def test_logits_whole_and_chunked_match_transformers(checkpoints, case):
    ckpt = checkpoints(case)
    model = load_model(ckpt.path).model
    ids = token_ids(37, ckpt.vocab_size, seed=11)
    ref = reference_logits(ckpt, ids)
    with torch.no_grad():
        whole = model.compute_logits(model(ids, torch.arange(37), DenseCausalAttention()))
        cache, pieces = SequenceCacheAttention(), []
        for lo, hi in [(0, 5), (5, 22)] + [(t, t + 1) for t in range(22, 37)]:
            pieces.append(model.compute_logits(model(ids[lo:hi], torch.arange(lo, hi), cache)))
    assert (whole - ref).abs().max().item() <= TOL
    assert (torch.cat(pieces) - ref).abs().max().item() <= TOL


def _run_engine(loaded, prompts: dict[str, list[int]], *, new_tokens: int, **cfg_kw):
    """Run ``prompts`` concurrently through an Engine; return ``(tokens by id, [(id, position, logits [V])])``:
    every sampled row's logits with the position of the token it was computed at."""
    kw = dict(device="cpu", check_invariants=True, num_pages=40, page_size=4, max_prefill_length=9,
              max_running_requests=3, max_model_len=128)
    kw.update(cfg_kw)
    engine = engine_for_model(loaded.model, loaded.config, EngineConfig(**kw), device=torch.device("cpu"),
                    dtype=torch.float32)
    rows: list[tuple[str, int, torch.Tensor]] = []
    eager = engine.runner._eager

    def recording(seqs):
        logits = eager(seqs)
        for s, row in zip([s for s in seqs if s.sample], logits):
            rows.append((s.request.request_id, s.start + s.num_tokens - 1, row.clone()))
        return logits

    engine.runner._eager = recording
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(500):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error_code is None, o.error_message
            out[o.request_id].extend(o.new_token_ids)
    assert not engine.has_work()
    assert engine.state_pool.num_free == engine.state_pool.num_slots   # every slot came back
    return out, rows, engine


@pytest.mark.parametrize("backend", ["resident", "offload", "cpu", "hybrid"])
@pytest.mark.parametrize("case", CASES)
def test_engine_matches_transformers_on_every_backend(checkpoints, case, backend):
    """Prompts of 5, 14 and 23 tokens, 9-token steps on 4-token pages: chunks cross pages and run beside the other
    requests' decodes; a state slot leaking between requests would change their logits."""
    ckpt = checkpoints(case)
    k = int(json.loads((ckpt.path / "config.json").read_text())["num_experts_per_tok"])
    moe = "resident" if backend == "resident" else options(backend, max(1, k - 1), stream_prefill=False)
    loaded = load_model(ckpt.path, moe_backend=moe)
    prompts = {f"r{n}": token_ids(n, ckpt.vocab_size, seed=n).tolist() for n in (5, 14, 23)}
    out, rows, engine = _run_engine(loaded, prompts, new_tokens=NEW_TOKENS)
    assert engine.scheduler.num_preemptions == 0
    refs = {rid: reference_logits(ckpt, torch.tensor(p + out[rid])) for rid, p in prompts.items()}
    assert len(rows) == 3 * NEW_TOKENS
    worst = max((row - refs[rid][pos]).abs().max().item() for rid, pos, row in rows)
    assert worst <= TOL, f"{case}/{backend}: logits differ by {worst}"
    for rid, p in prompts.items():
        assert out[rid] == hf_greedy(ckpt.reference, p, NEW_TOKENS), f"{case}/{backend}: {rid}"
    if backend != "resident":
        loaded.executor.close()


@pytest.mark.parametrize("backend", ["resident", "offload", "hybrid"])
@pytest.mark.parametrize("case", CASES)
def test_piecewise_decode_runner_matches_transformers(checkpoints, case, backend):
    """``--decode-graphs eager``: decode steps go through the piecewise decode runner (``engine/decode_graph.py``,
    its static per-row state-slot buffer), prefills eager; tokens and each chosen token's logprob match
    transformers."""
    ckpt = checkpoints(case)
    k = int(json.loads((ckpt.path / "config.json").read_text())["num_experts_per_tok"])
    moe = "resident" if backend == "resident" else options(backend, max(1, k - 1), stream_prefill=False)
    loaded = load_model(ckpt.path, moe_backend=moe)
    engine = engine_for_model(loaded.model, loaded.config, EngineConfig(device="cpu", check_invariants=True, num_pages=40,
                                                              page_size=4, max_prefill_length=9,
                                                              max_running_requests=3, decode_graphs="eager"),
                    device=torch.device("cpu"), dtype=torch.float32)
    prompts = {f"r{n}": token_ids(n, ckpt.vocab_size, seed=n + 3).tolist() for n in (1, 12, 21)}
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    toks = {rid: [] for rid in prompts}
    lps = {rid: [] for rid in prompts}
    while engine.has_work():
        for o in engine.step():
            assert o.error_code is None, o.error_message
            toks[o.request_id].extend(o.new_token_ids)
            lps[o.request_id].extend(lp.logprob for lp in o.logprobs or [])
    assert engine.stats()["decode_graphs"]["steps"] >= NEW_TOKENS - 1
    for rid, p in prompts.items():
        assert toks[rid] == hf_greedy(ckpt.reference, p, NEW_TOKENS), rid
        ref = torch.log_softmax(reference_logits(ckpt, torch.tensor(p + toks[rid])), dim=-1)
        want = [float(ref[len(p) - 1 + i, t]) for i, t in enumerate(toks[rid])]
        assert lps[rid] == pytest.approx(want, abs=TOL), rid
    if backend != "resident":
        loaded.executor.close()


def test_preempted_request_recomputes_its_state(checkpoints):
    """A pool too small for three requests: the newest is preempted (its state slot released with its pages) and
    recomputes from token 0; every logit still matches transformers."""
    ckpt = checkpoints("qwen3_next")
    loaded = load_model(ckpt.path)
    prompts = {f"r{n}": token_ids(n, ckpt.vocab_size, seed=n + 1).tolist() for n in (6, 11, 17)}
    out, rows, engine = _run_engine(loaded, prompts, new_tokens=12, num_pages=12)
    assert engine.scheduler.num_preemptions > 0
    refs = {rid: reference_logits(ckpt, torch.tensor(p + out[rid])) for rid, p in prompts.items()}
    assert max((row - refs[rid][pos]).abs().max().item() for rid, pos, row in rows) <= TOL


def test_layouts_store_kv_only_in_full_attention_layers(checkpoints):
    cfg = ModelConfig.from_folder(checkpoints("qwen3_next").path)
    kv = KVLayout.of(cfg)
    assert kv.layers == (1,) and kv.num_layers == 4
    st = StateLayout.of(cfg)
    assert st.layers == (0, 2, 3) and st.conv_channels == 2 * 2 * 16 + 4 * 8 and st.conv_kernel == 4
    # per slot: 3 layers x (3 conv rows x 96 channels x 4 bytes + 4 heads x 16 x 8 x 4 bytes)
    assert st.bytes_per_slot(torch.float32) == 3 * (3 * 96 * 4 + 4 * 16 * 8 * 4)
    cfg35 = ModelConfig.from_folder(checkpoints("qwen3_5_moe").path)
    assert KVLayout.of(cfg35).layers == (1, 3) and StateLayout.of(cfg35).layers == (0, 2)
    assert StateLayout.of(ModelConfig.from_folder(checkpoints("qwen3_moe").path)) is None


def test_prefix_cache_resumes_from_state_snapshots(checkpoints):
    """Prefix caching with recurrent-state snapshots: a repeated prompt maps all but its last token (a chunk ends
    one token before the prompt's end: a turn point with a snapshot), a follow-up turn (prompt + answer + more)
    maps everything but its new tokens and the answer's last token (the turn's end: a tail and a snapshot); every
    logit matches transformers."""
    ckpt = checkpoints("qwen3_5_moe")
    loaded = load_model(ckpt.path)
    p = token_ids(30, ckpt.vocab_size, seed=3).tolist()
    out, rows, engine = _run_engine(loaded, {"a": p}, new_tokens=6)
    assert engine.prefix_cache is not None and engine.state_snapshots.saves >= 5   # at 8, 16, 24, 28, 32
    turn2 = p + out["a"] + token_ids(5, ckpt.vocab_size, seed=4).tolist()
    prompts = {"b": p, "c": turn2}
    params = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5)
    cached: dict[str, int] = {}
    eager = engine.runner._eager

    def recording(seqs):
        logits = eager(seqs)
        for s, row in zip([s for s in seqs if s.sample], logits):
            rows.append((s.request.request_id, s.start + s.num_tokens - 1, row.clone()))
        return logits

    engine.runner._eager = recording
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_work():
        for o in engine.step():
            assert o.error_code is None, o.error_message
            got[o.request_id].extend(o.new_token_ids)
            if o.num_cached_tokens is not None:
                cached[o.request_id] = o.num_cached_tokens
    assert cached == {"b": 29, "c": 30 + 6 - 1}
    assert engine.state_snapshots.restores == 2
    prompts["a"] = p
    got["a"] = out["a"]
    refs = {rid: reference_logits(ckpt, torch.tensor(prompts[rid] + got[rid])) for rid in prompts}
    assert max((row - refs[rid][pos]).abs().max().item() for rid, pos, row in rows) <= TOL
    assert got["b"] == hf_greedy(ckpt.reference, p, 5) and got["c"] == hf_greedy(ckpt.reference, turn2, 5)


def test_without_prefix_caching_there_is_no_snapshot_store(checkpoints):
    loaded = load_model(checkpoints("qwen3_next").path)
    _, _, engine = _run_engine(loaded, {"a": [1, 2, 3, 4, 5, 6, 7]}, new_tokens=2, enable_prefix_caching=False)
    assert engine.prefix_cache is None and engine.state_snapshots is None


def test_engine_survives_a_deltanet_scratch_oom(checkpoints):
    """OOMs injected inside the DeltaNet layers of prefill steps (after their conv state was written): the guard's
    ladder runs, requests that lost their state recompute, and every token equals transformers' greedy choice."""
    from ferrylm.faults import FaultInjector
    from ferrylm.memory.guard import GuardConfig, NoElasticCache, OomGuard

    ckpt = checkpoints("qwen3_next")
    loaded = load_model(ckpt.path)
    # the 5th-7th DeltaNet layer calls of prefill steps fail: in the second step, whose chunks continue from states
    faults = FaultInjector.parse("deltanet_scratch:after=4:times=3")
    guard = OomGuard(torch.device("cpu"), NoElasticCache(), prefill_limit=9, config=GuardConfig(prefill_floor=2))
    engine = engine_for_model(loaded.model, loaded.config, EngineConfig(device="cpu", check_invariants=True, num_pages=40,
                                                              page_size=4, max_prefill_length=9,
                                                              max_running_requests=3, enable_prefix_caching=False),
                    device=torch.device("cpu"), dtype=torch.float32, faults=faults, guard=guard)
    prompts = {f"r{n}": token_ids(n, ckpt.vocab_size, seed=n + 7).tolist() for n in (8, 19, 26)}
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    out = {rid: [] for rid in prompts}
    for _ in range(300):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error_code is None, o.error_message
            out[o.request_id].extend(o.new_token_ids)
    assert faults._fired["deltanet_scratch"] == 3
    assert sum(engine.guard.recoveries.values()) >= 2 and engine.guard.failed_requests == 0
    assert engine.scheduler.num_preemptions > 0   # a chunk that had advanced its state was recomputed from 0
    for rid, p in prompts.items():
        assert out[rid] == hf_greedy(ckpt.reference, p, 6), rid
    assert engine.state_pool.num_free == engine.state_pool.num_slots


def _config(**raw) -> ModelConfig:
    base = dict(architectures=["Qwen3NextForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, num_hidden_layers=4, vocab_size=100, moe_intermediate_size=16, num_experts=8,
                num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4)
    return ModelConfig.from_dict({**base, **raw})


def test_layer_pattern_from_the_interval_and_default_rotary():
    from ferrylm.models.qwen3_next import Qwen3NextForCausalLM, layer_types

    assert layer_types(_config(full_attention_interval=2)) == ("linear_attention", "full_attention") * 2
    assert layer_types(_config()) == ("linear_attention",) * 3 + ("full_attention",)   # interval 4 by default
    # no partial_rotary_factor anywhere: a quarter of the head rotates (the reference config's default)
    from ferrylm.models.qwen3_next import HybridStack

    stack = HybridStack(_config(num_experts=0, intermediate_size=32), [torch.nn.Identity()] * 4,
                        Qwen3NextForCausalLM.linear_cls)
    assert stack.rotary.rotary_dim == 8


@pytest.mark.parametrize("raw,field", [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ({"full_attention_interval": 0}, "full_attention_interval"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_bad_configs_raise_model_load_error_naming_the_field(raw, field):
    from ferrylm.models.qwen3_next import Qwen3NextForCausalLM

    with pytest.raises(ModelLoadError, match=field):
        Qwen3NextForCausalLM.check_config(_config(**raw))


@pytest.mark.parametrize("name,layers,linear,experts,top_k,vocab", [
    ("qwen3-next-80b-a3b", 48, 36, 512, 10, 151936), ("qwen3.5-35b-a3b", 40, 30, 256, 8, 248320)])
def test_synthetic_presets_have_the_published_shapes(name, layers, linear, experts, top_k, vocab):
    from ferrylm.checkpoints.catalog import describe_models
    from ferrylm.synthetic.presets import PRESETS
    from ferrylm.synthetic.spec import parse_synthetic_spec

    cfg = ModelConfig.from_dict(PRESETS[name].config)
    assert (cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.vocab_size) == (layers, experts, top_k,
                                                                                          vocab)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.moe_intermediate_size) == (
        2048, 16, 2, 256, 512)
    st, kv = StateLayout.of(cfg), KVLayout.of(cfg)
    assert len(st.layers) == linear and len(kv.layers) == layers - linear and kv.layers[0] == 3
    # per linear layer: 3 conv rows of 2*16*128 + 32*128 channels (bf16) and a 32 x 128 x 128 float32 state
    assert st.bytes_per_slot(torch.bfloat16) == linear * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    assert kv.bytes_per_token(torch.bfloat16) == (layers - linear) * 2 * 2 * 256 * 2
    spec = parse_synthetic_spec(f"synthetic:{name}:layers=6")
    assert spec.routing == "qwen3" and spec.name == f"synthetic:{name}:layers=6"   # the qwen family's profile
    six = ModelConfig.from_dict(spec.config())
    assert StateLayout.of(six).layers == (0, 1, 2, 4, 5) and KVLayout.of(six).layers == (3,)
    from ferrylm.models.layers import config_rotary_dim
    from ferrylm.models.qwen3_next import _with_default_rotary

    assert config_rotary_dim(_with_default_rotary(cfg), allow_partial=True) == 64
    assert f"synthetic:{name}" in describe_models()


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "qwen3.5-35b-a3b"])
def test_synthetic_hybrid_model_serves_through_the_engine(name):
    """The preset's layer shapes with few experts and a small vocabulary (the memory of a test): built in memory,
    zero-centred norms at 0, two requests through the engine with the routing model choosing experts."""
    from ferrylm.synthetic.presets import PRESETS, SyntheticPreset
    from ferrylm.synthetic.spec import SyntheticSpec
    from ferrylm.checkpoints.synthetic_build import build_synthetic

    small = SyntheticPreset(name, "test", {**PRESETS[name].config, "num_experts": 8, "num_experts_per_tok": 2,
                                           "vocab_size": 512})
    loaded = build_synthetic(SyntheticSpec(small, 4, routing="qwen3"), dtype=torch.float32)
    layer0 = loaded.model.model.layers[0]
    assert layer0.kind == "linear_attention" and float(layer0.input_layernorm.weight.abs().max()) == 0.0
    assert float(layer0.linear_attn.norm.weight.min()) == 1.0
    engine = engine_for_model(loaded.model, loaded.config, EngineConfig(device="cpu", num_pages=16, page_size=16,
                                                              max_running_requests=2, check_invariants=True),
                    device=torch.device("cpu"), dtype=torch.float32)
    for rid, n in (("a", 39), ("b", 15)):
        engine.add_request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=3, temperature=0.0))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            assert o.error_code is None, o.error_message
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert {k: len(v) for k, v in out.items()} == {"a": 3, "b": 3}


def test_multimodal_qwen35_checkpoint_serves_its_text_model(checkpoints, tmp_path):
    """The published Qwen3.5-MoE form: ``Qwen3_5MoeForConditionalGeneration`` with the text model's config under
    ``text_config`` and its tensors under ``model.language_model.*``, beside a vision tower and MTP tensors (not
    read): the text model loads and gives transformers' logits."""
    from safetensors.torch import load_file, save_file

    ckpt = checkpoints("qwen3_5_moe")
    text = json.loads((ckpt.path / "config.json").read_text())
    dst = tmp_path / "mm"
    dst.mkdir()
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "tie_word_embeddings": text.pop("tie_word_embeddings", False), "text_config": text,
           "vision_config": {"depth": 1, "hidden_size": 16}}
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(str(ckpt.path / "model.safetensors")).items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(48, 16)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(dst / "model.safetensors"))
    loaded = load_model(dst)
    assert loaded.config.architecture == "Qwen3_5MoeForCausalLM"
    ids = token_ids(21, ckpt.vocab_size, seed=8)
    with torch.no_grad():
        got = loaded.model.compute_logits(loaded.model(ids, torch.arange(21), DenseCausalAttention()))
    assert (got - reference_logits(ckpt, ids)).abs().max().item() <= TOL
