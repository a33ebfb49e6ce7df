"""Qwen4-Exp (Qwen4ExpForCausalLM, Qwen3.8-Flash-Next's text model) against transformers' own class on a tiny random
checkpoint: float32 logits within 1e-4 for a whole prompt and a chunked prefill + decode, and through the engine
(paged KV with the indexer's raw keys beside K/V, the recurrent-state pool, chunked prefill across pages and
compression blocks, three concurrent requests) on every expert backend, greedy tokens identical. Skipped where the
installed transformers has no Qwen4-Exp."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tests.experts.helpers import options
from tests.models.hf_checkpoints import reference_logits, token_ids
from tests.models.test_qwen3_next import _run_engine, hf_greedy

from ferrylm.checkpoints.loader import load_model
from ferrylm.config import ModelConfig
from ferrylm.engine.cache.kv_pool import KVLayout
from ferrylm.engine.cache.state_pool import StateLayout
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import ModelLoadError
from ferrylm.models.reference_attention import DenseCausalAttention, SequenceCacheAttention

pytestmark = pytest.mark.skipif(not hasattr(transformers, "Qwen4ExpTextConfig"),
                                reason=f"transformers {transformers.__version__} has no Qwen4-Exp (5.25+)")
TOL = 1e-4
NEW_TOKENS = 8


def test_logits_whole_and_chunked_match_transformers(checkpoints):
    ckpt = checkpoints("qwen4_exp")
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


def test_the_indexer_changes_what_long_prompts_attend_to(checkpoints, monkeypatch):
    """Reading every block instead of the indexer's choice moves the logits past the 12th token (3 blocks > the 2
    kept): the parity above depends on the selection."""
    import ferrylm.models.qwen4_exp as q4

    ckpt = checkpoints("qwen4_exp")
    model = load_model(ckpt.path).model
    ids = token_ids(30, ckpt.vocab_size, seed=11)
    ref = reference_logits(ckpt, ids)
    monkeypatch.setattr(q4, "select_blocks", lambda scores, positions, ratio, top: (
        torch.arange(scores.shape[1])[None, :] < ((positions + 1) // ratio)[:, None]))
    with torch.no_grad():
        dense = model.compute_logits(model(ids, torch.arange(30), DenseCausalAttention()))
    assert (dense[:11] - ref[:11]).abs().max().item() <= TOL
    assert (dense[11:] - ref[11:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("backend", ["resident", "offload", "cpu", "hybrid"])
def test_engine_matches_transformers_on_every_backend(checkpoints, backend):
    """Prompts of 5, 14 and 23 tokens in 9-token steps on 4-token pages (blocks of 4): chunks cross pages and
    compression blocks beside the other requests' decodes."""
    ckpt = checkpoints("qwen4_exp")
    k = int(json.loads((ckpt.path / "config.json").read_text())["num_experts_per_tok"])
    moe = "resident" if backend == "resident" else options(backend, max(1, k - 1), stream_prefill=False)
    loaded = load_model(ckpt.path, moe_backend=moe)
    prompts = {f"r{n}": token_ids(n, ckpt.vocab_size, seed=n).tolist() for n in (5, 14, 23)}
    out, rows, engine = _run_engine(loaded, prompts, new_tokens=NEW_TOKENS)
    refs = {rid: reference_logits(ckpt, torch.tensor(p + out[rid])) for rid, p in prompts.items()}
    assert len(rows) == 3 * NEW_TOKENS
    worst = max((row - refs[rid][pos]).abs().max().item() for rid, pos, row in rows)
    assert worst <= TOL, f"{backend}: logits differ by {worst}"
    for rid, p in prompts.items():
        assert out[rid] == hf_greedy(ckpt.reference, p, NEW_TOKENS), f"{backend}: {rid}"
    if backend != "resident":
        loaded.executor.close()


def test_prefix_cached_turn_reads_the_cached_index_keys(checkpoints):
    """A follow-up turn maps the first turn's pages (K/V and index keys) and its state snapshot; its logits and
    tokens still match transformers."""
    ckpt = checkpoints("qwen4_exp")
    loaded = load_model(ckpt.path)
    p = token_ids(26, ckpt.vocab_size, seed=3).tolist()
    out, rows, engine = _run_engine(loaded, {"a": p}, new_tokens=4)
    turn2 = p + out["a"] + token_ids(6, ckpt.vocab_size, seed=4).tolist()
    engine.add_request("b", turn2, SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4))
    got, cached = [], None
    while engine.has_work():
        for o in engine.step():
            assert o.error_code is None, o.error_message
            got.extend(o.new_token_ids)
            cached = o.num_cached_tokens if o.num_cached_tokens is not None else cached
    assert cached is not None and cached >= 24
    assert got == hf_greedy(ckpt.reference, turn2, 4)


def test_layouts_keep_index_keys_in_the_attention_layers(checkpoints):
    cfg = ModelConfig.from_folder(checkpoints("qwen4_exp").path)
    kv = KVLayout.of(cfg)
    assert kv.layers == (1, 3) and kv.index_dim == 24
    # per attention layer: K and V of 2 heads x 16, and one 24-wide index key (float32)
    assert kv.bytes_per_token(torch.float32) == 2 * (2 * 2 * 16 + 24) * 4
    assert StateLayout.of(cfg).layers == (0, 2)


def _config(**raw) -> ModelConfig:
    base = dict(architectures=["Qwen4ExpForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, num_hidden_layers=4, vocab_size=100, moe_intermediate_size=16, num_experts=8,
                num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, hc_count=2,
                hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                indexer_compress_ratio=4, layer_types=["linear_attention", "full_attention"] * 2)
    return ModelConfig.from_dict({**base, **raw})


@pytest.mark.parametrize("raw,field", [
    ({"hc_count": 1}, "hc_count"),
    ({"indexer_kv_heads": 2}, "indexer_kv_heads"),
    ({"indexer_budget": 6}, "indexer_budget"),
    ({"indexer_head_dim": 4}, "indexer_head_dim"),
    ({"indexer_n_heads": None}, "indexer_n_heads"),
    ({"output_gate_type": "gelu"}, "output_gate_type"),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
])
def test_bad_configs_raise_model_load_error_naming_the_field(raw, field):
    from ferrylm.models.qwen4_exp import Qwen4ExpForCausalLM

    Qwen4ExpForCausalLM.check_config(_config())
    with pytest.raises(ModelLoadError, match=field):
        Qwen4ExpForCausalLM.check_config(_config(**raw))


def test_indexed_attention_layer_types_name_the_same_layers():
    from ferrylm.models.qwen4_exp import layer_kinds

    named = _config(layer_types=["linear_attention", "indexed_attention"] * 2)
    assert layer_kinds(named) == layer_kinds(_config()) == ("linear_attention", "full_attention") * 2


def test_preset_has_the_published_shapes_and_parameter_totals():
    """Qwen3.8-Flash-Next (model cards and its GGUF metadata): 48 layers (3 DeltaNet : 1 indexed attention),
    hidden 2560, 24 query / 2 KV heads of 256, indexer 4 heads x 128 keeping 2048 tokens in blocks of 4, 512
    experts top-10 of width 640 and a shared expert of 640, 4 streams; 125B parameters plus a 51B n-gram table
    (176B total, 95 GiB in bf16), ~6B active. As built: 125,743,653,760 without the table, 51,200,245,760 in it
    (320,001,536 rows of 160), 6,035,596,160 active outside the embedding and the head."""
    from tests.models.test_synthetic import _parameter_counts

    from ferrylm.models.qwen4_exp import Qwen4ExpForCausalLM
    from ferrylm.synthetic.presets import PRESETS

    cfg = ModelConfig.from_dict(PRESETS["qwen3.8-flash-next"].config)
    total, active = _parameter_counts("qwen3.8-flash-next")
    ple = Qwen4ExpForCausalLM.ple_shape(cfg)
    table = ple.table_rows(0) * ple.head_dim
    assert (total, table, active) == (125_743_653_760, 51_200_245_760, 6_035_596_160)
    assert abs((total + table) / 176e9 - 1) < 0.01 and abs(active / 6e9 - 1) < 0.03
    assert ple.table_bytes(torch.bfloat16) / 2**30 == pytest.approx(95.37, abs=0.01)
    kv, st = KVLayout.of(cfg), StateLayout.of(cfg)
    assert len(kv.layers) == 12 and kv.index_dim == 128 and len(st.layers) == 36 and st.ple.layers == (0,)


def test_tool_calls_use_the_qwen35_format():
    from ferrylm.server.text.tool_parsers import choose_tool_parser

    assert choose_tool_parser(None, "Qwen4ExpForCausalLM") == "qwen3_coder"
