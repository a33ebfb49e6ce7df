"""The per-token layer kernels (``models/kernels/norm_rope.py``) against the torch reference they replace on the GPU:
RMSNorm (one weight, and per-head stacked weights), per-head q/k norm + RoPE (and RoPE alone), routing top-k (with and
without renormalisation). Interpreter (float32) on CPU, bfloat16 on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferrylm.models.layers import RotaryEmbedding, apply_rotary_full, rope_frequencies
from ferrylm.models.moe import softmax_topk
from tests.kernels.interp import kernel_device, load_kernels


def _dtype(dev):
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def _close(a, b, dtype):
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows,d,wrows", [(5, 64, 1), (3, 200, 1), (12, 32, 6)])
def test_rms_norm_matches_reference(rows, d, wrows):
    k = load_kernels("ferrylm.models.kernels.norm_rope")
    dev = kernel_device()
    dt = _dtype(dev)
    g = torch.Generator().manual_seed(rows + d)
    x = (torch.randn(rows, d, generator=g) * 3).to(dev, dt)
    w = torch.randn(wrows, d, generator=g).to(dev, dt)
    ref = w.repeat(rows // wrows, 1) * F.rms_norm(x, (d,), eps=1e-5)
    _close(k.rms_norm(x, w if wrows > 1 else w[0], 1e-5), ref, dt)


@pytest.mark.parametrize("rows,d", [(3, 200), (1, 2048)])
def test_zero_centred_rms_norm_matches_the_module(rows, d):
    """Qwen3-Next's norm: ``(1 + w) * RMSNorm(x)`` in float32, one rounding (``models/gated_deltanet.py``'s torch
    form, which CPU tensors take)."""
    from ferrylm.models.gated_deltanet import ZeroCentredRMSNorm

    k = load_kernels("ferrylm.models.kernels.norm_rope")
    dev = kernel_device()
    dt = _dtype(dev)
    g = torch.Generator().manual_seed(d)
    norm = ZeroCentredRMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g) * 0.5)
    x = torch.randn(rows, d, generator=g) * 3
    ref = norm.to(dt)(x.to(dt))  # CPU: the torch form
    _close(k.rms_norm(x.to(dev, dt), norm.weight.to(dev), 1e-6, zero_centred=True).cpu(), ref, dt)


@pytest.mark.parametrize("norm", [True, False])
def test_norm_rope_matches_reference(norm):
    k = load_kernels("ferrylm.models.kernels.norm_rope")
    dev = kernel_device()
    dt = _dtype(dev)
    t, hq, hk, d = 7, 8, 2, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, hq + 2 * hk, d, generator=g).to(dev, dt)
    qk = qkv[:, :hq + hk]                       # a strided view, as in the fused projection
    inv, fac = rope_frequencies(d, 10000.0, None, max_positions=256)
    rot = RotaryEmbedding(d, 256, inv, fac, device=dev)
    pos = torch.tensor([0, 5, 9, 100, 3, 255, 17], device=dev)
    w = torch.randn(hq + hk, d, generator=g).to(dev, dt) if norm else None
    ref_in = w * F.rms_norm(qk, (d,), eps=1e-6) if norm else qk
    ref = rot.rotate(pos, ref_in)
    got = k.norm_rope(qk, pos, rot.cos_table, rot.sin_table, w, 1e-6)
    _close(got, ref, dt)
    assert torch.equal(ref, apply_rotary_full(ref_in, *rot._tables(pos, dt)))


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("e,topk", [(128, 8), (8, 2), (60, 4)])
def test_topk_softmax_matches_reference(renorm, e, topk):
    k = load_kernels("ferrylm.models.kernels.norm_rope")
    dev = kernel_device()
    g = torch.Generator().manual_seed(e + topk)
    logits = torch.randn(9, e, generator=g).to(dev, _dtype(dev))
    ids, w = k.topk_softmax(logits, topk, renormalize=renorm)
    rids, rw = softmax_topk(logits, topk, renormalize=renorm)
    # bfloat16 logits tie often; among equal logits the order of ids is free, so compare the chosen logits
    assert torch.equal(logits.gather(1, ids), logits.gather(1, rids))
    assert all(len(set(r)) == topk for r in ids.tolist())
    if logits.dtype == torch.float32:
        assert torch.equal(ids.cpu(), rids.cpu())
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        k.topk_softmax(logits, 3, renormalize=renorm)
