"""The fused Gated DeltaNet decode kernel (``models/kernels/gated_delta_decode.py``) against the layer's torch path
(``models/gated_deltanet.py``, the reference on CPU): outputs and both recurrent states, for fresh and continuing
sequences in shuffled slots, one or several value heads per key head, head dims not powers of two, SiLU and sigmoid
output gates, float32 and bfloat16. Interpreter on CPU, compiled on a GPU."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from ferrylm.engine.cache.state_pool import RecurrentStep, StateLayout, StatePool
from ferrylm.models.gated_deltanet import LinearShape, Qwen35GatedDeltaNet
from tests.kernels.interp import kernel_device, load_kernels

H = 24


def _layer(shape: LinearShape, activation: str, dtype: torch.dtype, seed: int) -> Qwen35GatedDeltaNet:
    torch.manual_seed(seed)
    layer = Qwen35GatedDeltaNet(3, H, shape, 1e-6, activation)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.copy_(torch.rand_like(layer.A_log) - 1.0)
        layer.dt_bias.copy_(torch.linspace(-25.0, 25.0, shape.value_heads))  # both softplus branches
    return layer.to(dtype)


def _pool(shape: LinearShape, dtype: torch.dtype, slots: int, seed: int) -> StatePool:
    layout = StateLayout((3,), shape.conv_channels, shape.conv_kernel, shape.value_heads, shape.key_dim,
                         shape.value_dim)
    pool = StatePool(layout, slots, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    pool.conv[3].copy_(torch.randn(pool.conv[3].shape, generator=g))
    pool.rec[3].copy_(torch.randn(pool.rec[3].shape, generator=g) * 0.5)
    return pool


@pytest.mark.parametrize("hk,dk,hv,dv,kw,activation,dtype", [
    (2, 16, 4, 16, 4, "silu", torch.float32),
    (2, 12, 2, 20, 3, "sigmoid", torch.float32),
    (1, 32, 3, 8, 4, "silu", torch.bfloat16),
    (1, 32, 3, 8, 4, "silu", torch.float32),
    (2, 16, 4, 16, 4, "silu", torch.bfloat16),
])
def test_fused_decode_matches_the_torch_layer(hk, dk, hv, dv, kw, activation, dtype):
    kern = load_kernels("ferrylm.models.kernels.gated_delta_decode")
    dev = kernel_device()
    shape = LinearShape(hk, dk, hv, dv, kw)
    layer = _layer(shape, activation, dtype, seed=hk + dk)
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(7)).to(dtype)
    slots = torch.tensor([4, 0, 2])
    fresh = torch.tensor([False, True, False])
    pool = _pool(shape, dtype, 5, seed=dv)
    ref_pool = copy.deepcopy(pool)
    rs = RecurrentStep(pool=ref_pool, slots=slots, fresh=fresh, query_start_loc=torch.arange(4), num_tokens=3,
                       q_lens=[1, 1, 1])
    with torch.no_grad():
        ref = layer(hidden, SimpleNamespace(recurrent=rs))
        layer.fuse_projections()  # strided views of one product, as the engine serves them
        qkv, z, b, a = layer.project(hidden)
        assert not qkv.is_contiguous()
        w = layer.decode_weights()
        w = kern.DeltaNetDecodeWeights(*(t.to(dev) for t in (w.conv, w.a_log, w.dt_bias, w.norm)), w.eps,
                                       w.sigmoid_gate)
        conv, rec = pool.conv[3].clone().to(dev), pool.rec[3].clone().to(dev)
        inputs = [t.to(dev) for t in (qkv, z, b, a)]
        again = [conv.clone(), rec.clone()]
        o = kern.fused_decode(*inputs, w, conv, rec, slots.to(dev), fresh.to(dev), hk)
        o2 = kern.fused_decode(*inputs, w, *again, slots.to(dev), fresh.to(dev), hk)
        assert torch.equal(o, o2) and torch.equal(rec, again[1]) and torch.equal(conv, again[0])  # deterministic
        got = layer.to(dev).out_proj(o).cpu()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(rec.cpu(), ref_pool.rec[3], **tol)
    torch.testing.assert_close(conv.cpu(), ref_pool.conv[3], atol=0, rtol=0)  # moved inputs, no arithmetic
    assert not torch.equal(rec.cpu(), pool.rec[3])  # the states did move
