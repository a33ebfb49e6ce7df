"""The fused q/k/v projection (Attention.fuse_projections, applied by the loaders) gives the separate
projections' outputs bit for bit, shares their memory, survives dtype moves, and falls back when a parameter is
replaced."""

from __future__ import annotations

import pytest
import torch

from ferrylm.models.reference_attention import DenseCausalAttention
from ferrylm.models.layers import Attention, RotaryEmbedding, rope_frequencies


def _attention(qk_norm, qkv_bias, clip=None, seed=0):
    torch.manual_seed(seed)
    inv, factor = rope_frequencies(16, 10000.0, None, max_positions=64)
    rot = RotaryEmbedding(16, 64, inv, factor)
    a = Attention(0, 64, 4, 2, 16, rot, qkv_bias=qkv_bias, qk_norm=qk_norm, clip_qkv=clip)
    with torch.no_grad():
        for p in a.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return a.eval()


@pytest.mark.parametrize("qk_norm,qkv_bias,clip", [(None, False, None), (None, True, None), ("head", False, None),
                                                   ("proj", False, None), (None, False, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_separate(qk_norm, qkv_bias, clip, dtype):
    a = _attention(qk_norm, qkv_bias, clip).to(dtype)
    x = torch.randn(7, 64, dtype=dtype)
    pos = torch.arange(3, 10)
    with torch.inference_mode():
        ref = a(pos, x, DenseCausalAttention())
        a.fuse_projections()
        assert a._fused_valid()
        got = a(pos, x, DenseCausalAttention())
    assert torch.equal(got, ref)
    # views of the fused weight: no second copy
    assert a.q_proj.weight.untyped_storage().data_ptr() == a.v_proj.weight.untyped_storage().data_ptr()
    assert a.q_proj.weight.untyped_storage().nbytes() == sum(p.weight.numel() * p.weight.element_size()
                                                             for p in (a.q_proj, a.k_proj, a.v_proj))


def test_fusion_survives_dtype_move_and_falls_back_when_replaced():
    a = _attention("head", True)
    a.fuse_projections()
    a = a.to(torch.float64)
    assert a._fused_valid() and a.q_proj.weight.dtype == torch.float64
    assert a.q_proj.weight.untyped_storage().data_ptr() == a.k_proj.weight.untyped_storage().data_ptr()
    x, pos = torch.randn(5, 64, dtype=torch.float64), torch.arange(5)
    with torch.inference_mode():
        fused = a(pos, x, DenseCausalAttention())
    new = {k: torch.randn_like(v) for k, v in a.state_dict().items()}
    a.load_state_dict(new, assign=True)  # replaces the parameters: the fused tensors are stale
    assert not a._fused_valid()
    with torch.inference_mode():
        after = a(pos, x, DenseCausalAttention())  # separate projections with the new weights
        b = _attention("head", True).to(torch.float64)
        b.load_state_dict(new)
        ref = b(pos, x, DenseCausalAttention())
    assert torch.equal(after, ref) and not torch.equal(after, fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_the_two_half_formula(dtype):
    """apply_rotary_full == (x1 cos - x2 sin, x2 cos + x1 sin), bit for bit (RoFormer, half-split pairing)."""
    from ferrylm.models.layers import apply_rotary_full

    x = torch.randn(5, 3, 16, dtype=dtype)
    ang = torch.randn(5, 8)
    c, s = ang.cos().to(dtype)[:, None, :], ang.sin().to(dtype)[:, None, :]
    x1, x2 = x[..., :8], x[..., 8:]
    ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    got = apply_rotary_full(x, torch.cat((c, c), -1)[:, 0], torch.cat((-s, s), -1)[:, 0])
    assert torch.equal(got, ref)
