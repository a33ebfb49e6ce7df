"""Our models vs transformers on the same tiny random checkpoints: full sequence, chunked prefill + decode,
and every on-disk expert layout."""

from __future__ import annotations

import pytest
import torch
from tests.models.hf_checkpoints import CASES, copy_config, is_moe_case, reference_logits, token_ids
from safetensors.torch import load_file, save_file

from ferrylm.models.reference_attention import DenseCausalAttention, SequenceCacheAttention
from ferrylm.checkpoints.loader import load_model

TOL = 1e-4


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(ids, torch.arange(ids.shape[0]), DenseCausalAttention())
        return model.compute_logits(hidden)


@pytest.mark.parametrize("case", list(CASES))
def test_full_sequence_logits_match_transformers(checkpoints, case):
    ckpt = checkpoints(case)
    loaded = load_model(ckpt.path)
    assert (loaded.executor is not None) == is_moe_case(case)
    assert loaded.model.num_layers == loaded.config.num_layers
    ids = token_ids(40, ckpt.vocab_size)
    ours = full_logits(loaded.model, ids)
    ref = reference_logits(ckpt, ids)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("case", ["llama", "llama_llama3", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe_clip"])
def test_chunked_prefill_and_decode_match_full_sequence(checkpoints, case):
    ckpt = checkpoints(case)
    model = load_model(ckpt.path).model
    ids = token_ids(24, ckpt.vocab_size, seed=3)
    full = full_logits(model, ids)
    cache, pieces = SequenceCacheAttention(), []
    bounds = [(0, 7), (7, 12)] + [(t, t + 1) for t in range(12, 24)]  # prompt, a chunk, then 1-token steps
    with torch.no_grad():
        for lo, hi in bounds:
            hidden = model(ids[lo:hi], torch.arange(lo, hi), cache)
            pieces.append(model.compute_logits(hidden))
    stepped = torch.cat(pieces)
    assert (stepped - full).abs().max().item() <= 1e-5
    assert (stepped - reference_logits(ckpt, ids)).abs().max().item() <= TOL


def _rewrite(src, dst, rename):
    copy_config(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({rename(k): v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def test_mixtral_on_disk_layouts(checkpoints, tmp_path):
    """Per-expert w1/w2/w3 (what save_pretrained writes), sharded with an index, Qwen-MoE style per-expert
    names, and the transformers-v5 fused layout (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    ckpt = checkpoints("mixtral")
    ref_model = ckpt.reference
    ids = token_ids(32, ckpt.vocab_size, seed=5)
    ref = reference_logits(ckpt, ids)

    sharded = tmp_path / "sharded"
    ref_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()

    qwen_names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def to_qwen(name):
        parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
        return ".".join(qwen_names.get(p, p) if "experts" in parts else p for p in parts)

    qwen = _rewrite(ckpt.path, tmp_path / "qwen", to_qwen)

    fused = copy_config(ckpt.path, tmp_path / "fused")
    state = {k: v.contiguous() for k, v in ref_model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 2 * 96, 64)  # transformers v5 layout
    save_file(state, str(fused / "model.safetensors"))

    for folder in (sharded, qwen, fused):
        ours = full_logits(load_model(folder).model, ids)
        assert (ours - ref).abs().max().item() <= TOL, folder.name


def test_bfloat16_load(checkpoints):
    ckpt = checkpoints("mixtral")
    loaded = load_model(ckpt.path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.executor.layers[0].gate.dtype == torch.bfloat16
    ids = token_ids(16, ckpt.vocab_size)
    ours = full_logits(loaded.model, ids)
    assert ours.dtype == torch.float32
    assert (ours - reference_logits(ckpt, ids)).abs().max().item() < 0.25


@pytest.mark.parametrize("case,moe_layers", [("qwen3_moe", [1, 2]), ("qwen3_moe_step2", [1, 3]),
                                             ("qwen2_moe_mixed", [0, 2]), ("olmoe", [0, 1])])
def test_dense_and_moe_layers_follow_the_config(checkpoints, case, moe_layers):
    """mlp_only_layers / decoder_sparse_step pick the same layers as transformers; shared experts only in Qwen2-MoE."""
    from ferrylm.models.moe import SparseMoeBlock

    ckpt = checkpoints(case)
    loaded = load_model(ckpt.path)
    assert sorted(loaded.executor.layers) == moe_layers
    for i, (ours, ref) in enumerate(zip(loaded.model.model.layers, ckpt.reference.model.layers)):
        assert isinstance(ours.mlp, SparseMoeBlock) == (i in moe_layers) == ("Sparse" in type(ref.mlp).__name__)
        if i in moe_layers:
            assert (ours.mlp.shared_expert is not None) == case.startswith("qwen2_moe")
