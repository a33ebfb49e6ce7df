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
from ferrylm.models.attention import SequenceCacheAttention
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
        assert loaded.executor.stats()["needed"] > 0
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
