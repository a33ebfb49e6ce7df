"""DeepSeek-V3 (DeepseekV3ForCausalLM) against transformers' own implementation (5.x) on tiny random checkpoints
written by ``save_pretrained`` (``tests/models/hf_checkpoints.py``: ``deepseek_v3`` with a low-rank query, yarn and
interleaved rope, group-limited routing, two dense layers; ``deepseek_v3_lite`` with ``q_lora_rank`` null, biases,
half-split rope): float32 logits within 1e-4, through the reference backends and through the engine (paged latent
pool, chunked prefill across pages, a prefix mapped from the prefix cache, decodes beside a prefill), greedy tokens
equal, on every expert backend; the latent pool's layout; the typed config errors; FP8 block checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.experts.helpers import greedy_trace, options
from tests.models.hf_checkpoints import hf_greedy, reference_logits, token_ids
from tests.models.test_parity import full_logits

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.boot import engine_for_model
from ferrylm.engine.engine import Engine
from ferrylm.engine.cache.kv_pool import KVLayout
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import ModelLoadError
from ferrylm.models.reference_attention import SequenceCacheAttention
from ferrylm.models.deepseek_v3 import DeepseekV3ForCausalLM, LatentAttention
from ferrylm.checkpoints.loader import load_model
from ferrylm.models.sigmoid_moe import SigmoidMoeBlock, SigmoidRouting

TOL = 1e-4
CASES = ["deepseek_v3", "deepseek_v3_lite"]
BACKENDS = ["resident", "offload", "cpu", "hybrid"]


@pytest.fixture(params=["absorbed", "expanded", "cost"])
def prefill_path(request, monkeypatch):
    """Which form prefill chunks take: forced absorbed, forced expanded, or the cost model's choice (absorbed at
    these tiny shapes). Decodes are absorbed whatever this says."""
    import ferrylm.models.latent_attention as la

    if request.param != "cost":
        monkeypatch.setattr(la, "absorb_wins", lambda *a, **k: request.param == "absorbed")
    return request.param


def _moe(backend: str, ckpt):
    k = int(json.loads((ckpt.path / "config.json").read_text())["num_experts_per_tok"])
    return "resident" if backend == "resident" else options(backend, max(1, k - 1), stream_prefill=False)


@pytest.mark.parametrize("case", CASES)
def test_logits_and_chunked_decode_match_transformers(checkpoints, case, prefill_path):
    ckpt = checkpoints(case)
    model = load_model(ckpt.path).model
    ids = token_ids(30, ckpt.vocab_size, seed=11)
    ref = reference_logits(ckpt, ids)
    assert (full_logits(model, ids) - ref).abs().max().item() <= TOL
    cache, pieces = SequenceCacheAttention(), []
    with torch.no_grad():
        for lo, hi in [(0, 9), (9, 14)] + [(t, t + 1) for t in range(14, 30)]:
            pieces.append(model.compute_logits(model(ids[lo:hi], torch.arange(lo, hi), cache)))
    assert (torch.cat(pieces) - ref).abs().max().item() <= TOL


def test_layers_follow_the_config(checkpoints):
    """first_k_dense_replace = 2 of 4 layers; the routing rule is the config's; each layer's attention is MLA with
    the published names; the pool stores one kv_lora_rank + qk_rope_head_dim row per token."""
    loaded = load_model(checkpoints("deepseek_v3").path)
    assert sorted(loaded.executor.layers) == [2, 3]
    layers = loaded.model.model.layers
    assert not isinstance(layers[1].mlp, SigmoidMoeBlock)
    assert all(isinstance(layer.self_attn, LatentAttention) for layer in layers)
    assert layers[2].mlp.rule == SigmoidRouting(top_k=3, n_group=4, topk_group=2, renormalize=True, scale=2.5,
                                                eps=1e-20)
    assert layers[2].mlp.shared_experts is not None
    assert hasattr(layers[0].self_attn, "q_a_proj") and not hasattr(layers[0].self_attn, "q_proj")
    lite = load_model(checkpoints("deepseek_v3_lite").path).model.model.layers[0].self_attn
    assert hasattr(lite, "q_proj") and not hasattr(lite, "q_a_proj")
    layout = KVLayout.of(loaded.config)
    assert (layout.k_heads, layout.k_dim, layout.v_heads, layout.v_dim) == (1, 32 + 8, 0, 0)
    assert layout.bytes_per_token(torch.bfloat16) == 4 * 40 * 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers(checkpoints, case, backend):
    """A cache smaller than one token's experts (top_k - 1 slots) for the offloading backends: waves, eviction."""
    ckpt = checkpoints(case)
    loaded = load_model(ckpt.path, moe_backend=_moe(backend, ckpt))
    prompt = token_ids(13, ckpt.vocab_size, seed=5).tolist()
    tokens, logits = greedy_trace(loaded.model, prompt, 10)
    assert tokens == hf_greedy(ckpt.reference, prompt, 10), f"{case}/{backend}"
    ref = reference_logits(ckpt, torch.tensor(prompt + tokens))[len(prompt) - 1:-1]
    assert (torch.stack(logits) - ref).abs().max().item() <= TOL
    if backend != "resident":
        assert loaded.executor.stats().totals.needed > 0
        loaded.executor.close()


def _run(engine: Engine, requests: dict[str, list[int]], params: SamplingParams) -> dict[str, list]:
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    for _ in range(400):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error_code is None, o.error_message
            outs[o.request_id].append(o)
    assert not engine.has_work()
    return outs


def _check_against_reference(ckpt, prompt: list[int], outs: list, n: int) -> None:
    """The engine's tokens are transformers' greedy ones; each token's logprob and its top-5 are transformers'
    log-softmax at that position within TOL."""
    tokens = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    assert tokens == hf_greedy(ckpt.reference, prompt, n)
    ref = torch.log_softmax(reference_logits(ckpt, torch.tensor(prompt + tokens))[len(prompt) - 1:-1], dim=-1)
    assert len(lps) == n
    for i, lp in enumerate(lps):
        assert lp.token_id == tokens[i]
        assert abs(lp.logprob - ref[i, tokens[i]].item()) <= TOL
        for tok, value in lp.top:
            assert abs(value - ref[i, tok].item()) <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_engine_path_matches_transformers(checkpoints, case, backend, prefill_path):
    """Through the engine: 4-token pages, 8-token step budget (chunks across pages, a decode beside a prefill);
    the second turn re-sends the first prompt's first 12 tokens, so its first three pages come from the prefix
    cache and only its suffix is computed over the mapped latent rows."""
    ckpt = checkpoints(case)
    loaded = load_model(ckpt.path, moe_backend=_moe(backend, ckpt))
    cfg = EngineConfig(device="cpu", check_invariants=True, num_pages=48, page_size=4, max_prefill_length=8,
                       max_running_requests=2, max_model_len=128, enable_prefix_caching=True)
    engine = engine_for_model(loaded.model, loaded.config, cfg, device=torch.device("cpu"), dtype=torch.float32)
    n = 8
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)
    first = {"a": token_ids(14, ckpt.vocab_size, seed=21).tolist(), "b": token_ids(9, ckpt.vocab_size, seed=22).tolist()}
    outs = _run(engine, first, params)
    second = {"c": first["a"][:12] + token_ids(7, ckpt.vocab_size, seed=23).tolist()}
    outs.update(_run(engine, second, params))
    cached = next(o.num_cached_tokens for o in outs["c"] if o.num_cached_tokens is not None)
    assert cached == 12
    for rid, prompt in {**first, **second}.items():
        _check_against_reference(ckpt, prompt, outs[rid], n)
    if backend != "resident":
        loaded.executor.close()


def test_routing_bias_and_latent_norm_are_used(checkpoints):
    """Zeroing e_score_correction_bias, or the kv_a_layernorm weight's spread, moves the logits away from
    transformers' (the tensors are really read)."""
    ckpt = checkpoints("deepseek_v3")
    ids = token_ids(24, ckpt.vocab_size, seed=2)
    model = load_model(ckpt.path).model
    for layer in model.model.layers[2:]:
        layer.mlp.gate.e_score_correction_bias.data.zero_()
    assert (full_logits(model, ids) - reference_logits(ckpt, ids)).abs().max().item() > 1e-2
    model = load_model(ckpt.path).model
    model.model.layers[0].self_attn.kv_a_layernorm.weight.data.fill_(1.0)
    assert (full_logits(model, ids) - reference_logits(ckpt, ids)).abs().max().item() > 1e-2


def test_published_config_form_and_mtp_layer(checkpoints, tmp_path):
    """The published config.json form (rope_scaling with ``type``, topk_method / scoring_func, an MTP layer
    ``model.layers.<num_hidden_layers>.*`` in the checkpoint, which is skipped)."""
    ckpt = checkpoints("deepseek_v3")
    cfg = json.loads((ckpt.path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"], topk_method="noaux_tc", scoring_func="sigmoid",
               num_nextn_predict_layers=1, rope_scaling={**{k: v for k, v in rope.items()
                                                            if k not in ("rope_type", "rope_theta")}, "type": "yarn"})
    dst = tmp_path / "published"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(ckpt.path / "model.safetensors"))
    mtp = {k.replace("model.layers.3.", "model.layers.4."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.3.")}
    mtp["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, str(dst / "model.safetensors"))
    ids = token_ids(20, ckpt.vocab_size, seed=4)
    assert (full_logits(load_model(dst).model, ids) - reference_logits(ckpt, ids)).abs().max().item() <= TOL


def test_bfloat16_load_keeps_the_router_in_float32(checkpoints):
    ckpt = checkpoints("deepseek_v3")
    loaded = load_model(ckpt.path, dtype=torch.bfloat16)
    gate = loaded.model.model.layers[2].mlp.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert loaded.model.model.layers[2].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    ids = token_ids(16, ckpt.vocab_size)
    assert (full_logits(loaded.model, ids) - reference_logits(ckpt, ids)).abs().max().item() < 0.25


def _config(**raw) -> ModelConfig:
    base = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=64, num_attention_heads=4,
                num_hidden_layers=2, vocab_size=100, intermediate_size=48, moe_intermediate_size=16,
                n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    return ModelConfig.from_dict({k: v for k, v in {**base, **raw}.items() if v != "drop"})


@pytest.mark.parametrize("raw,field", [
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"kv_lora_rank": "drop"}, "kv_lora_rank"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"q_lora_rank": 0}, "q_lora_rank"),
    ({"n_group": 3}, "n_group"),
    ({"n_group": 2, "topk_group": 3}, "topk_group"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_configs_raise_model_load_error_naming_the_field(raw, field):
    with pytest.raises(ModelLoadError, match=field):
        DeepseekV3ForCausalLM.check_config(_config(**raw))


def test_ferry_models_lists_deepseek():
    from ferrylm.checkpoints.catalog import ARCHITECTURE_NOTES, describe_models
    from ferrylm.models.registry import supported_architectures

    assert set(ARCHITECTURE_NOTES) == set(supported_architectures())
    text = describe_models()
    assert "DeepseekV3ForCausalLM" in text and "Kimi-K2" in text
    assert "synthetic:deepseek-v3" in text and "synthetic:kimi-k2" in text


@pytest.mark.parametrize("case", CASES)
def test_fp8_block_checkpoint_matches_its_dequantized_reference(checkpoints, tmp_path, case):
    """FP8 e4m3 with 16x16 block scales (128x128 in the published checkpoints), quantized by transformers' own FP8
    quantizer, on every linear the published DeepSeek-V3 quantizes: MLA's (q_a / q_b / q_proj, kv_a_proj_with_mqa,
    whose 40 rows are 2.5 blocks, kv_b_proj, o_proj), the dense and shared MLPs and the routed experts. Reference:
    transformers on the dequantized weights. Routed experts stay FP8 (moved as FP8 bytes by offload); MLA's linears
    are dequantized to the model dtype."""
    from tests.models.quant_checkpoints import dense_reference, fp8_quantizer, write_quantized

    from ferrylm.experts.quantized import QuantTensor

    linears = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
               "up_proj", "down_proj")

    def select(name: str, t: torch.Tensor) -> bool:
        return name.endswith(".weight") and t.dim() == 2 and name.split(".")[-2] in linears

    ckpt = checkpoints(case)
    qcfg, quantize = fp8_quantizer((16, 16))
    qdir = write_quantized(ckpt.path, tmp_path / "fp8", qcfg, quantize, select=select)
    q = load_file(str(qdir / "model.safetensors"))
    dequant = {}
    for name, t in q.items():
        if t.dtype == torch.float8_e4m3fn:
            s = q[name + "_scale_inv"].float()
            full = s.repeat_interleave(16, 0)[:t.shape[0]].repeat_interleave(16, 1)[:, :t.shape[1]]
            dequant[name] = t.float() * full
    assert "model.layers.0.self_attn.kv_b_proj.weight" in dequant
    ref = dense_reference(ckpt.path, tmp_path / "deq", dequant)
    ids = token_ids(24, ckpt.vocab_size, seed=2)
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0].float()
    loaded = load_model(qdir)
    attn = loaded.model.model.layers[0].self_attn
    assert attn.kv_b_proj.weight.dtype == torch.float32
    layer = max(loaded.executor.layers)
    assert isinstance(loaded.executor.layers[layer].gate, QuantTensor)
    assert (full_logits(loaded.model, ids) - want).abs().max().item() <= TOL
    assert (want - reference_logits(ckpt, ids)).abs().max().item() > 1e-3  # really quantized
    prompt = token_ids(10, ckpt.vocab_size, seed=7).tolist()
    offload = load_model(qdir, moe_backend=_moe("offload", ckpt))
    assert greedy_trace(offload.model, prompt, 6)[0] == greedy_trace(loaded.model, prompt, 6)[0]
    offload.executor.close()


@pytest.mark.parametrize("backend", ["resident", "offload", "hybrid"])
def test_piecewise_decode_pieces_match_transformers(checkpoints, backend):
    """``decode_graphs="eager"``: decode steps run the pieces the CUDA graphs capture (static buffers, the KV
    bucket's slot table and mask, ``StaticDecodeAttention.attend_latent``, RoPE rows over the ``P`` rope dims bound
    from static buffers) without capturing them; tokens are transformers', logprobs the plain forward's."""
    from ferrylm.engine.boot import build_engine

    ckpt = checkpoints("deepseek_v3")
    prompts = {"a": token_ids(9, ckpt.vocab_size, seed=1).tolist(), "b": token_ids(21, ckpt.vocab_size, seed=2).tolist()}
    runs = {}
    for mode in ("off", "eager"):
        cfg = EngineConfig(device="cpu", check_invariants=True, num_pages=80, page_size=4, max_prefill_length=64,
                           max_running_requests=2, decode_graphs=mode, moe_backend=backend, moe_cache_size=2)
        engine = build_engine(ckpt.path, cfg)
        outs = _run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1))
        runs[mode] = {rid: ([t for o in v for t in o.new_token_ids], [lp.logprob for o in v for lp in o.logprobs])
                      for rid, v in outs.items()}
        if mode == "eager":
            assert engine.stats()["decode_graphs"]["steps"] >= 7
    for rid, p in prompts.items():
        assert runs["eager"][rid][0] == runs["off"][rid][0] == hf_greedy(ckpt.reference, p, 8)
        assert runs["eager"][rid][1] == pytest.approx(runs["off"][rid][1], abs=1e-4)


def _tiny_synthetic(preset: str):
    """The ``preset`` (deepseek-v3 / kimi-k2) at test size: its architecture and options, MLA and MoE shrunk, the
    vocabulary kept (129280 / 163840 ids: the embedding and head are the large tensors at this size)."""
    from ferrylm.synthetic.presets import PRESETS, SyntheticPreset

    cfg = {**PRESETS[preset].config, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
           "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 3, "kv_lora_rank": 16,
           "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 16,
           "max_position_embeddings": 256, "first_k_dense_replace": 1}
    cfg["n_group"], cfg["topk_group"] = (4, 2) if cfg["n_group"] > 1 else (1, 1)
    return SyntheticPreset(f"tiny-{preset}", "test", cfg)


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2"])
def test_synthetic_presets_route_by_the_qwen3_profile_and_generate(monkeypatch, tmp_path, preset):
    """Default routing of the DeepSeek family's presets is the calibrated ``qwen3`` profile: the sigmoid blocks take
    the routing model's ids (weights their sigmoid scores); token ids in and out at the published vocabularies
    through the offline API, prompt ids drawn across the whole vocabulary."""
    from ferrylm.engine.sampling_params import SamplingParams
    from ferrylm.llm import LLM
    from ferrylm.synthetic.presets import PRESETS
    from ferrylm.synthetic.spec import default_prompt_ids, parse_synthetic_spec
    from ferrylm.checkpoints.synthetic_build import build_synthetic

    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))
    tiny = _tiny_synthetic(preset)
    monkeypatch.setitem(PRESETS, tiny.name, tiny)
    spec = parse_synthetic_spec(f"synthetic:{tiny.name}")
    assert spec.routing == "qwen3" and parse_synthetic_spec(f"synthetic:{preset}:layers=2").routing == "qwen3"
    loaded = build_synthetic(spec, dtype=torch.float32)
    block = loaded.model.model.layers[1].mlp
    assert isinstance(block, SigmoidMoeBlock) and block.routing is not None
    ids = torch.tensor([5, tiny.config["vocab_size"] - 1, 3, 90_000])
    seen = {}
    original = block.executor.run

    def run(layer, hidden, topk_ids, topk_weights, **kw):
        seen.setdefault(layer, (topk_ids.clone(), topk_weights.clone()))
        return original(layer, hidden, topk_ids, topk_weights, **kw)

    monkeypatch.setattr(block.executor, "run", run)
    with torch.no_grad():
        loaded.model(ids, torch.arange(4), SequenceCacheAttention())
        want = block.routing_context.choose(block.routing, 1)
    got_ids, got_w = seen[1]
    assert torch.equal(got_ids, want)
    assert torch.allclose(got_w.sum(-1), torch.full((4,), block.rule.scale))  # renormalised, then scaled
    llm = LLM(f"synthetic:{tiny.name}", device="cpu", num_pages=32, check_invariants=True)
    prompt = default_prompt_ids(tiny.config["vocab_size"])
    assert max(prompt) > 100_000 and max(prompt) < tiny.config["vocab_size"]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    toks = out[0].outputs[0].token_ids
    assert len(toks) == 4 and all(0 <= t < tiny.config["vocab_size"] for t in toks)
