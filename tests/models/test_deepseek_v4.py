"""DeepSeek-V4 (DeepseekV4ForCausalLM) against transformers' own implementation (5.25) on a tiny random checkpoint
written by ``save_pretrained`` (``tests/models/hf_checkpoints.py``: ``deepseek_v4``: sliding, CSA, HCA and CSA
layers, hyper-connections, two hash-routed layers, clamped SwiGLU): float32 logits within 1e-4 through the reference
backends, whole and in chunks across compression-block boundaries; greedy tokens equal on every expert backend; the
typed config errors."""

from __future__ import annotations

import json

import pytest
import torch
from tests.experts.helpers import greedy_trace, options
from tests.models.hf_checkpoints import hf_greedy, reference_logits, token_ids
from tests.models.test_parity import full_logits

from ferrylm.checkpoints.loader import load_model
from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.models.reference_attention import SequenceCacheAttention
from ferrylm.models.deepseek_v4 import DeepseekV4ForCausalLM, HashMoeBlock

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("the installed transformers has no DeepseekV4 reference (5.25 or later)", allow_module_level=True)

TOL = 1e-4
BACKENDS = ["resident", "offload", "cpu", "hybrid"]
CASE = "deepseek_v4"


def _moe(backend: str):
    return "resident" if backend == "resident" else options(backend, 1, stream_prefill=False)


def test_logits_whole_and_in_chunks_match_transformers(checkpoints):
    """Chunks 0-9, 9-14 (across the CSA rate-4 and HCA rate-8 blocks and the 6-token window), then one token each."""
    ckpt = checkpoints(CASE)
    model = load_model(ckpt.path).model
    ids = token_ids(30, ckpt.vocab_size, seed=11)
    ref = reference_logits(ckpt, ids)
    assert (full_logits(model, ids) - ref).abs().max().item() <= TOL
    cache, pieces = SequenceCacheAttention(), []
    with torch.no_grad():
        for lo, hi in [(0, 9), (9, 14)] + [(t, t + 1) for t in range(14, 30)]:
            pieces.append(model.compute_logits(model(ids[lo:hi], torch.arange(lo, hi), cache)))
    assert (torch.cat(pieces) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_equal_transformers(checkpoints, backend):
    """One expert slot for the offloading backends (fewer than a token's two): waves, eviction."""
    ckpt = checkpoints(CASE)
    loaded = load_model(ckpt.path, moe_backend=_moe(backend))
    prompt = token_ids(13, ckpt.vocab_size, seed=5).tolist()
    tokens, logits = greedy_trace(loaded.model, prompt, 10)
    assert tokens == hf_greedy(ckpt.reference, prompt, 10), backend
    ref = reference_logits(ckpt, torch.tensor(prompt + tokens))[len(prompt) - 1:-1]
    assert (torch.stack(logits) - ref).abs().max().item() <= TOL
    if backend != "resident":
        assert loaded.executor.stats().totals.needed > 0
        loaded.executor.close()


def test_each_mechanism_is_read(checkpoints):
    """Changing the indexer's top-k, the hash table, the clamp or the Sinkhorn iterations moves the logits away from
    transformers' (each is really computed)."""
    ckpt = checkpoints(CASE)
    ids = token_ids(28, ckpt.vocab_size, seed=2)
    ref = reference_logits(ckpt, ids)

    def moved(edit) -> float:
        model = load_model(ckpt.path).model
        edit(model)
        return (full_logits(model, ids) - ref).abs().max().item()

    assert moved(lambda m: setattr(m.model.layers[1].attn.indexer, "topk", 100)) > 1e-3
    assert moved(lambda m: m.model.layers[0].mlp.gate.tid2eid.copy_(m.model.layers[0].mlp.gate.tid2eid.flip(1)
                                                                     .roll(1, 0))) > 1e-3
    assert moved(lambda m: [setattr(layer.mlp.shared_experts, "limit", 100.0) for layer in m.model.layers]) > 1e-3
    layers = load_model(ckpt.path).model.model.layers
    assert isinstance(layers[0].mlp, HashMoeBlock) and not isinstance(layers[2].mlp, HashMoeBlock)
    assert layers[0].attn.compressor is None and layers[2].attn.indexer is None
    assert layers[1].attn.compressor.rate == 4 and layers[2].attn.compressor.rate == 8


def _config(**raw) -> ModelConfig:
    base = dict(architectures=["DeepseekV4ForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                head_dim=32, num_hidden_layers=2, vocab_size=100, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=4, index_topk=2, partial_rotary_factor=0.25,
                max_position_embeddings=128)
    return ModelConfig.from_dict({**base, **raw})


@pytest.mark.parametrize("raw,words", [
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(o_groups=3), "o_groups"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(scoring_func="tanh"), "scoring_func"),
    (dict(mlp_layer_types=["moe"]), "mlp_layer_types"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(partial_rotary_factor=0.1), "partial_rotary_factor"),
])
def test_config_errors_name_the_field(raw, words):
    with pytest.raises(ModelLoadError, match=words):
        DeepseekV4ForCausalLM.check_config(_config(**raw))


def test_published_names_load(checkpoints, tmp_path):
    """The published checkpoint's names (no ``model.`` prefix, ``embed``, ``hc_head_fn``, ``layers.N.ffn``) and an
    ``mtp.*`` module (skipped) load to the same logits."""
    from safetensors.torch import load_file, save_file

    ckpt = checkpoints(CASE)
    tensors = load_file(str(ckpt.path / "model.safetensors"))
    published = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.").replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_")
        published[name] = t
    published["mtp.0.eh_proj.weight"] = torch.zeros(4, 4)
    dst = tmp_path / "published"
    dst.mkdir()
    (dst / "config.json").write_text((ckpt.path / "config.json").read_text())
    save_file(published, str(dst / "model.safetensors"))
    ids = token_ids(20, ckpt.vocab_size, seed=4)
    assert (full_logits(load_model(dst).model, ids) - reference_logits(ckpt, ids)).abs().max().item() <= TOL
    assert json.loads((dst / "config.json").read_text())["architectures"] == ["DeepseekV4ForCausalLM"]


def _run(engine, requests: dict[str, list[int]], params) -> dict[str, list]:
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    for _ in range(600):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error_code is None, o.error_message
            outs[o.request_id].append(o)
    assert not engine.has_work()
    return outs


def _engine(loaded, page_size: int, budget: int, caching: bool = True):
    from ferrylm.config import EngineConfig
    from ferrylm.engine.boot import engine_for_model

    cfg = EngineConfig(device="cpu", check_invariants=True, num_pages=24, page_size=page_size,
                       max_prefill_length=budget, max_running_requests=2, max_model_len=128,
                       enable_prefix_caching=caching)
    return engine_for_model(loaded.model, loaded.config, cfg, device=torch.device("cpu"), dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_path_matches_transformers(checkpoints, backend):
    """Through the engine's paged pool: 16-token pages, a 6-token step budget (chunks across pages and compression
    blocks, a decode beside a prefill); the second turn re-sends the first prompt's first 26 tokens: one full page
    from the prefix cache and 8 of the 10 tokens of a kept tail (reuse stops at a multiple of the largest rate, 8),
    so only its suffix is computed over the mapped rows, entries and pools."""
    from ferrylm.engine.sampling_params import SamplingParams

    ckpt = checkpoints(CASE)
    loaded = load_model(ckpt.path, moe_backend=_moe(backend))
    engine = _engine(loaded, 16, 6)
    n = 6
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)
    first = {"a": token_ids(30, ckpt.vocab_size, seed=21).tolist(), "b": token_ids(9, ckpt.vocab_size, seed=22).tolist()}
    outs = _run(engine, first, params)
    second = {"c": first["a"][:26] + token_ids(7, ckpt.vocab_size, seed=23).tolist()}
    outs.update(_run(engine, second, params))
    assert next(o.num_cached_tokens for o in outs["c"] if o.num_cached_tokens is not None) == 24
    for rid, prompt in {**first, **second}.items():
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        assert tokens == hf_greedy(ckpt.reference, prompt, n), rid
        ref = torch.log_softmax(reference_logits(ckpt, torch.tensor(prompt + tokens))[len(prompt) - 1:-1], dim=-1)
        lps = [lp for o in outs[rid] for lp in (o.logprobs or [])]
        assert max(abs(lp.logprob - ref[i, lp.token_id].item()) for i, lp in enumerate(lps)) <= TOL
    if backend != "resident":
        loaded.executor.close()


def test_turn_two_reuses_the_aligned_prefix(checkpoints):
    """An agent's second turn (prompt + answer + a new message) reuses its history up to the last multiple of 8
    tokens (8-token pages) and answers as an engine without the prefix cache."""
    from ferrylm.engine.sampling_params import SamplingParams

    ckpt = checkpoints(CASE)
    loaded = load_model(ckpt.path)
    prompt = token_ids(22, ckpt.vocab_size, seed=7).tolist()
    new = token_ids(5, ckpt.vocab_size, seed=8).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        engine = _engine(loaded, 8, 64, caching)
        out1 = [t for o in _run(engine, {"t1": prompt}, params)["t1"] for t in o.new_token_ids]
        turn2 = prompt + out1 + new
        outs = _run(engine, {"t2": turn2}, params)["t2"]
        cached = next(o.num_cached_tokens for o in outs if o.num_cached_tokens is not None)
        runs[caching] = (out1, [t for o in outs for t in o.new_token_ids], cached, len(turn2))
    assert runs[True][:2] == runs[False][:2]
    assert runs[False][2] == 0 and runs[True][2] == (runs[True][3] - len(new) - 1) // 8 * 8 > 0


def test_pool_layout_holds_the_blocks(checkpoints):
    """One window row per token and layer; per CSA block (4 tokens) an entry, an indexer key and their pools; per
    HCA block (8 tokens) an entry and its pool; a page size that is not a multiple of 8 is refused by name."""
    from ferrylm.engine.cache.kv_pool import KVLayout, KVPool

    layout = KVLayout.of(load_model(checkpoints(CASE).path).config)
    assert (layout.k_heads, layout.k_dim, layout.v_heads, layout.align) == (1, 32, 0, 8)
    assert {(b.layer, b.name, b.rate, b.width) for b in layout.blocks} == {
        (1, "compressor", 4, 32), (1, "compressor_carry", 4, 128), (1, "indexer", 4, 16), (1, "indexer_carry", 4, 64),
        (2, "compressor", 8, 32), (2, "compressor_carry", 8, 128),
        (3, "compressor", 4, 32), (3, "compressor_carry", 4, 128), (3, "indexer", 4, 16), (3, "indexer_carry", 4, 64)}
    per_token = 4 * 32 * 4 + 2 * (32 * 4 + 128 * 4 + 16 * 4 + 64 * 4) // 4 + (32 * 4 + 128 * 4) // 8
    assert layout.bytes_per_token(torch.float32) == per_token
    with pytest.raises(ValueError, match="--page-size must be a multiple of 8"):
        KVPool(layout=layout, num_pages=4, page_size=12, dtype=torch.float32, device="cpu")


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (int8 ``[N, K / 2]`` e2m1 codes, low nibble first; uint8 E8M0 ``[N, K / 32]``)."""
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(1e-30) / 6.0))
    v = g / torch.exp2(exp)[..., None]
    code = (v.abs()[..., None] - _E2M1).abs().argmin(-1) + 8 * (v < 0)
    code = code.view(n, k).to(torch.uint8)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8), (exp + 127).to(torch.uint8)


def test_fp4_experts_kept_as_stored_match_transformers(checkpoints, tmp_path):
    """A checkpoint in the format of transformers' FP8Experts with ``expert_dtype: fp4`` (int8 e2m1 pairs, E8M0 per
    32): the experts stay fp4 bytes (the file's), and the logits are transformers' with the experts its own
    ``Fp8Dequantize`` decodes, on the resident and the offload backends."""
    import copy

    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    ckpt = checkpoints(CASE)
    tensors, out, deq = load_file(str(ckpt.path / "model.safetensors")), {}, {}
    for name, t in tensors.items():
        if ".experts." in name:
            q, s = _fp4(t)
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = q, s
            deq[name] = Fp8Dequantize(None)._dequantize_one(q, s, torch.float32)
        else:
            out[name] = t
    cfg = json.loads((ckpt.path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic", "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    dst = tmp_path / "fp4"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(out, str(dst / "model.safetensors"))
    ref = copy.deepcopy(ckpt.reference)
    for i, layer in enumerate(ref.model.layers):
        ex, p = layer.mlp.experts, f"model.layers.{i}.ffn.experts"
        e = ex.gate_up_proj.shape[0]
        ex.gate_up_proj.data = torch.stack([torch.cat((deq[f"{p}.{j}.w1.weight"], deq[f"{p}.{j}.w3.weight"]))
                                            for j in range(e)])
        ex.down_proj.data = torch.stack([deq[f"{p}.{j}.w2.weight"] for j in range(e)])
    ids = token_ids(24, ckpt.vocab_size, seed=3)
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0].float()
    assert (want - reference_logits(ckpt, ids)).abs().max().item() > 1e-3     # fp4 really changed the experts
    for backend in ("resident", "offload"):
        loaded = load_model(dst, moe_backend=_moe(backend))
        assert (full_logits(loaded.model, ids) - want).abs().max().item() <= TOL, backend
        stacks = loaded.executor.layers if backend == "resident" else None
        if stacks is not None:
            gate = stacks[0].gate
            assert gate.fmt.kind == "fp4" and gate.fmt.group == 32
            assert torch.equal(gate.data[1], out["model.layers.0.ffn.experts.1.w1.weight"].view(torch.uint8))
        else:
            loaded.executor.close()


def test_boot_raises_the_page_size_to_whole_compression_blocks(checkpoints, caplog):
    """`ferry serve` with default flags serves a model whose compressed blocks span more tokens than a page: the
    boot raises the page size to their multiple (rates 4 and 8 here: 4 -> 8) and says so."""
    import logging

    from ferrylm.config import EngineConfig
    from ferrylm.engine.boot import fit_page_size

    mcfg = ModelConfig.from_folder(checkpoints("deepseek_v4").path)
    caplog.set_level(logging.WARNING, logger="ferrylm.engine")
    got = fit_page_size(EngineConfig(device="cpu", page_size=4), mcfg)
    assert got.page_size == 8 and "--page-size 4 raised to 8" in caplog.text
    assert fit_page_size(got, mcfg) is got


def test_decode_graph_modes_run_the_whole_step_forward(checkpoints):
    """The piecewise decode graphs cut a single-stream decoder layer at its MoE block; DeepSeek-V4's layers mix
    hyper-connection streams around both blocks, so with ``--decode-graphs eager`` (the piecewise path without
    capture) its decode steps run the model's own forward, not the pieces, and give transformers' tokens."""
    from ferrylm.config import EngineConfig
    from ferrylm.engine.boot import engine_for_model
    from ferrylm.engine.sampling_params import SamplingParams

    ckpt = checkpoints(CASE)
    loaded = load_model(ckpt.path)
    cfg = EngineConfig(device="cpu", check_invariants=True, num_pages=24, page_size=8, max_prefill_length=16,
                       max_running_requests=2, max_model_len=128, decode_graphs="eager")
    engine = engine_for_model(loaded.model, loaded.config, cfg, device=torch.device("cpu"), dtype=torch.float32)
    prompt = token_ids(11, ckpt.vocab_size, seed=31).tolist()
    outs = _run(engine, {"a": prompt}, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [t for o in outs["a"] for t in o.new_token_ids] == hf_greedy(ckpt.reference, prompt, 5)
    assert "decode_graphs" not in engine.stats()     # no graph runner
