"""Modules serving several projections of one input from one matrix multiply (``models/quant_linear.FusedLinears``):
a gated MLP's gate/up and a Gated DeltaNet's input projections give what the separate layers give, the weights stay
views of the fused matrix (no memory added, names kept), and a dtype change fuses again."""

from __future__ import annotations

import torch

from ferrylm.models.gated_deltanet import LinearShape, Qwen35GatedDeltaNet
from ferrylm.models.layers import SwiGLUMLP


def test_gated_mlp_fused_equals_separate_and_survives_a_dtype_change():
    torch.manual_seed(0)
    mlp = SwiGLUMLP(32, 48)
    x = torch.randn(5, 32)
    with torch.no_grad():
        ref = mlp(x)
        mlp.fuse_projections()
        assert mlp.is_fused
        base = mlp.gate_proj.weight.data_ptr()
        assert mlp.up_proj.weight.data_ptr() == base + 48 * 32 * 4  # one matrix, up after gate
        torch.testing.assert_close(mlp(x), ref, rtol=1e-6, atol=1e-6)
        mlp.to(torch.float64)
        assert mlp.is_fused and mlp.up_proj.weight.dtype == torch.float64
        torch.testing.assert_close(mlp(x.double()), ref.double(), rtol=1e-5, atol=1e-5)
    assert set(mlp.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}


def test_deltanet_projections_fused_equal_separate():
    torch.manual_seed(1)
    layer = Qwen35GatedDeltaNet(0, 24, LinearShape(2, 8, 4, 8, 3), 1e-6)
    x = torch.randn(3, 24)
    with torch.no_grad():
        ref = layer.project(x)
        layer.fuse_projections()
        got = layer.project(x)
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_moe_block_fuses_router_shared_gate_and_shared_gate_up_once(tmp_path):
    """Qwen2-MoE's block: router, shared-expert gate and the shared expert's gate/up read one input: one product,
    the shared expert's own fusion skipped (each linear joins one matrix), logits equal to the reference's."""
    from ferrylm.checkpoints.loader import load_model
    from ferrylm.models.moe import SparseMoeBlock
    from tests.models.hf_checkpoints import build_checkpoint, reference_logits, token_ids

    ckpt = build_checkpoint("qwen2_moe", tmp_path / "m", seed=4)
    model = load_model(ckpt.path, device="cpu", dtype=torch.float32).model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.is_fused and not b.shared_expert.is_fused for b in blocks)
    b = blocks[0]
    base = b.gate.weight.data_ptr()
    assert b.shared_expert.up_proj.weight.data_ptr() > base   # views of the block's one matrix
    ids = token_ids(12, ckpt.vocab_size, seed=1)
    from ferrylm.models.reference_attention import DenseCausalAttention

    with torch.no_grad():
        got = model.compute_logits(model(ids, torch.arange(12), DenseCausalAttention()))
    torch.testing.assert_close(got, reference_logits(ckpt, ids), rtol=1e-4, atol=1e-4)


def test_children_of_different_dtypes_stay_unfused():
    """A float32 router beside bf16 projections: one matrix would promote them (and the bf16 input could not
    multiply it); the children stay as they are, computed in turn."""
    from ferrylm.models.quant_linear import FusedLinears

    class Pair(FusedLinears):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 4, bias=False)
            self.b = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)

        def fused_children(self):
            return [self.a, self.b]

    pair = Pair()
    pair.fuse_projections()
    assert not pair.is_fused and pair.a.weight.dtype == torch.float32 and pair.b.weight.dtype == torch.bfloat16
    pair.b.to(torch.float32)
    pair.fuse_projections()
    assert pair.is_fused   # one dtype: one product
