"""Decode attention on a CPU read from the paged KV pool in place (``NativeExpertKernel.decode_attention``,
experts/native/decode_attention.h): against SDPA over the gathered K/V for every instruction set, float32 and bf16
pools, GQA and plain multi-head, head sizes that do and do not fill the 16-key path, lengths of one position and of
several merged parts, scattered slots; the torch backend takes it for decode rows (alone and beside a prefill) and
keeps the gather where the kernel does not apply (fp8 pool, sinks)."""

from __future__ import annotations

import math

import pytest
import torch

from ferrylm.engine.attention.torch_backend import PagedAttention, SeqSlice
from ferrylm.engine.cache.kv_pool import KVLayout, KVPool
from ferrylm.experts.cpu_kernel import ISAS
from ferrylm.models.quant_linear import DenseKernel
from tests.experts.helpers import kernel_isa


def _reference(q, kp, vp, slots, lens, scale):
    """SDPA per sequence over its gathered positions, in float64."""
    out = []
    b, hq, d = q.shape
    hkv = kp.shape[1]
    for i in range(b):
        ks = kp[slots[i, :lens[i]]].double().transpose(0, 1)
        vs = vp[slots[i, :lens[i]]].double().transpose(0, 1)
        qi = q[i].double().view(hkv, hq // hkv, d)
        out.append(torch.nn.functional.scaled_dot_product_attention(qi, ks, vs, scale=scale).reshape(hq, d))
    return torch.stack(out)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d", [(8, 2, 128), (4, 4, 64), (6, 3, 80)])
def test_matches_sdpa_over_the_gathered_pool(kernel, isa, dtype, hq, hkv, d):
    k = kernel_isa(kernel, isa)
    g = torch.Generator().manual_seed(hq * d)
    slots_total = 1200
    kp = torch.randn(slots_total, hkv, d, generator=g).to(dtype)
    vp = torch.randn(slots_total, hkv, d, generator=g).to(dtype)
    lens = torch.tensor([1, 17, 33, 700])  # one position; a chunk and a bit; several 64-position parts merged
    slots = torch.stack([torch.randperm(slots_total, generator=g)[:700] for _ in range(4)])
    q = torch.randn(4, hq, d, generator=g)
    scale = 1 / math.sqrt(d)
    got = k.decode_attention(q, kp, vp, slots, lens, scale, threads=2)
    ref = _reference(q, kp, vp, slots, lens, scale)
    assert got.shape == (4, hq, d) and got.dtype == torch.float32
    assert (got.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("threads", [1, 3])
def test_any_thread_count_gives_the_same_result(kernel, threads):
    g = torch.Generator().manual_seed(1)
    kp, vp = torch.randn(300, 2, 32, generator=g), torch.randn(300, 2, 32, generator=g)
    slots, lens = torch.arange(600).view(2, 300) % 300, torch.tensor([300, 129])
    q = torch.randn(2, 4, 32, generator=g)
    got = kernel.decode_attention(q, kp, vp, slots, lens, 0.2, threads=threads)
    assert (got.double() - _reference(q, kp, vp, slots, lens, 0.2)).abs().max().item() < 1e-5


@pytest.mark.parametrize("bad", ["zero length", "past the slots", "heads", "dtype"])
def test_bad_arguments_raise(kernel, bad):
    kp = vp = torch.zeros(10, 2, 16)
    q, slots, lens = torch.zeros(1, 4, 16), torch.zeros(1, 5, dtype=torch.long), torch.tensor([5])
    if bad == "zero length":
        lens = torch.tensor([0])
    elif bad == "past the slots":
        lens = torch.tensor([6])
    elif bad == "heads":
        q = torch.zeros(1, 3, 16)
    else:
        kp = vp = torch.zeros(10, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError):
        kernel.decode_attention(q, kp, vp, slots, lens, 0.25, threads=2)


def _pool(kv_cache_dtype: str = "auto") -> KVPool:
    layout = KVLayout(num_layers=1, layers=(0,), k_heads=2, k_dim=32, v_heads=2, v_dim=32)
    return KVPool(layout=layout, num_pages=16, page_size=4, dtype=torch.float32, device="cpu",
                  kv_cache_dtype=kv_cache_dtype)


def _step(pool, native, calls, sinks=None):
    """A step of two decode rows (contexts 9 and 21) beside a 5-token prefill chunk; returns its attention."""
    g = torch.Generator().manual_seed(3)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    seqs = [SeqSlice(q_start=0, q_len=1, ctx_len=9, slots=torch.arange(10) + 3),
            SeqSlice(q_start=1, q_len=5, ctx_len=2, slots=torch.arange(7) + 20),
            SeqSlice(q_start=6, q_len=1, ctx_len=21, slots=torch.arange(22) + 30)]
    q, k, v = (torch.randn(7, h, 32, generator=g) for h in (4, 2, 2))
    attn = PagedAttention(pool, seqs, "cpu", native=native)
    if native is not None:
        run = native.native.decode_attention
        native.native.decode_attention = lambda *a, **kw: calls.append(a[3].shape) or run(*a, **kw)
    return attn.attend(0, q, k, v, 0.3, sinks=sinks)


def test_the_backend_decodes_natively_beside_a_prefill(kernel):
    calls: list = []
    got = _step(_pool(), DenseKernel(kernel.with_isa(kernel.isa), 2), calls)
    ref = _step(_pool(), None, [])
    assert calls == [torch.Size([2, 22])]  # one call for both decode rows, padded to the longer context
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["fp8", "sinks"])
def test_the_gather_stays_where_the_kernel_does_not_apply(kernel, case):
    calls: list = []
    sinks = torch.zeros(4) if case == "sinks" else None
    got = _step(_pool("fp8" if case == "fp8" else "auto"), DenseKernel(kernel.with_isa(kernel.isa), 2), calls, sinks)
    ref = _step(_pool("fp8" if case == "fp8" else "auto"), None, [], sinks)
    assert calls == [] and torch.equal(got, ref)
