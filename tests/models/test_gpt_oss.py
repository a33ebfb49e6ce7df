"""gpt-oss (GptOssForCausalLM) against transformers' own implementation (5.x) on a tiny random checkpoint written by
``save_pretrained``: float32 logits within 1e-4 (whole prompt, and chunked prefill + decode across the sliding
window), greedy tokens equal to transformers' on every expert backend; the sinks, the window and the expert biases
each change the output (they are really used); bad config fields are refused by name."""

from __future__ import annotations

import pytest
import torch
from tests.experts.helpers import greedy_trace, options
from tests.models.hf_checkpoints import hf_greedy, reference_logits, token_ids
from tests.models.test_parity import full_logits

from ferrylm.checkpoints.loader import load_model
from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.models.reference_attention import SequenceCacheAttention

TOL = 1e-4
NEW_TOKENS = 12


def test_logits_and_chunked_decode_match_transformers(checkpoints):
    ckpt = checkpoints("gpt_oss")
    model = load_model(ckpt.path).model
    ids = token_ids(30, ckpt.vocab_size, seed=11)
    ref = reference_logits(ckpt, ids)
    assert (full_logits(model, ids) - ref).abs().max().item() <= TOL
    cache, pieces = SequenceCacheAttention(), []
    with torch.no_grad():
        for lo, hi in [(0, 9), (9, 14)] + [(t, t + 1) for t in range(14, 30)]:
            pieces.append(model.compute_logits(model(ids[lo:hi], torch.arange(lo, hi), cache)))
    assert (torch.cat(pieces) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", ["resident", "offload", "cpu", "hybrid"])
def test_greedy_tokens_equal_transformers_on_every_backend(checkpoints, backend):
    """One slot (less than a token's two experts) for the offloading backends: waves, eviction."""
    ckpt = checkpoints("gpt_oss")
    moe = "resident" if backend == "resident" else options(backend, 1, stream_prefill=False)
    loaded = load_model(ckpt.path, moe_backend=moe)
    prompt = token_ids(13, ckpt.vocab_size, seed=5).tolist()
    tokens, logits = greedy_trace(loaded.model, prompt, NEW_TOKENS)
    assert tokens == hf_greedy(ckpt.reference, prompt, NEW_TOKENS), backend
    ref = reference_logits(ckpt, torch.tensor(prompt + tokens))[len(prompt) - 1:-1]
    assert (torch.stack(logits) - ref).abs().max().item() <= TOL
    if backend != "resident":
        assert loaded.executor.stats().totals.needed > 0
        loaded.executor.close()


@pytest.mark.parametrize("what", ["sinks", "window", "expert_bias", "clamp"])
def test_each_gpt_oss_part_changes_the_output(checkpoints, what):
    ckpt = checkpoints("gpt_oss")
    loaded = load_model(ckpt.path)
    layers = loaded.model.model.layers
    assert [layer.self_attn.window for layer in layers] == [5, None, 5]
    for i, layer in enumerate(layers):
        math = loaded.executor.layers[i].math
        if what == "sinks":
            layer.self_attn.sinks.data.zero_()
        elif what == "window":
            layer.self_attn.window = None
        elif what == "expert_bias":
            math.gate_bias.zero_()
        else:
            math.limit = 1e9
    ids = token_ids(24, ckpt.vocab_size, seed=2)
    assert (full_logits(loaded.model, ids) - reference_logits(ckpt, ids)).abs().max().item() > 1e-3


@pytest.mark.parametrize("raw,field", [({"layer_types": ["full_attention"]}, "layer_types"),
                                       ({"sliding_window": 0}, "sliding_window"),
                                       ({"swiglu_limit": 0}, "swiglu_limit")])
def test_bad_configs_name_the_field(raw, field):
    from ferrylm.models.registry import get_model_class

    base = dict(architectures=["GptOssForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_hidden_layers=2, vocab_size=100, intermediate_size=32, num_local_experts=4,
                num_experts_per_tok=2)
    with pytest.raises(ModelLoadError, match=field):
        get_model_class("GptOssForCausalLM").check_config(ModelConfig.from_dict({**base, **raw}))


def test_mxfp4_checkpoint_keeps_its_bytes_and_matches_transformers(checkpoints, tmp_path):
    """The published layout: ``*_blocks`` / ``*_scales`` experts (gate / up rows interleaved) beside plain biases;
    reference: transformers' model with the experts its own ``convert_moe_packed_tensors`` dequantizes. The experts
    stay fp4 codes (no dequantized copy); offload gives the resident greedy tokens."""
    import copy
    import json

    from safetensors.torch import load_file, save_file
    from tests.models.quant_checkpoints import mxfp4_blocks_pack
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ckpt = checkpoints("gpt_oss")
    src = load_file(str(ckpt.path / "model.safetensors"))
    reference = copy.deepcopy(ckpt.reference)
    out = {}
    for name, t in src.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = t
            continue
        blocks, scales = mxfp4_blocks_pack(t.transpose(1, 2))  # [E, N, K] rows of outputs
        out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        module, attr = name.rsplit(".", 1)
        getattr(reference.get_submodule(module), attr).data.copy_(
            convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    qdir = tmp_path / "mxfp4"
    qdir.mkdir()
    save_file({k: v.contiguous() for k, v in out.items()}, str(qdir / "model.safetensors"))
    cfg = json.loads((ckpt.path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (qdir / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(qdir)
    assert loaded.executor.layers[0].quant is not None
    ids = token_ids(24, ckpt.vocab_size, seed=3)
    with torch.no_grad():
        want = reference(input_ids=ids[None]).logits[0].float()
    assert (full_logits(loaded.model, ids) - want).abs().max().item() <= TOL
    assert (want - reference_logits(ckpt, ids)).abs().max().item() > 1e-3  # really quantized
    prompt = token_ids(10, ckpt.vocab_size, seed=7).tolist()
    offload = load_model(qdir, moe_backend=options("offload", 1))
    assert greedy_trace(offload.model, prompt, 6)[0] == greedy_trace(loaded.model, prompt, 6)[0]
    offload.executor.close()
