"""The fp8 KV pool (``--kv-cache-dtype fp8``, ``engine/cache/kv_pool.py``): float8 e4m3 values with one float32 scale
per (token, head). The torch store and the Triton store round-trip within float8's rounding; the Triton paged and
latent attention kernels over an fp8 pool equal the torch reference over the same pool's dequantized K/V, and stay
within a few percent of attention over the unquantized K/V. On CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from ferrylm.engine.cache.kv_pool import FP8, KVLayout, KVPool, dequantize_fp8, quantize_fp8
from ferrylm.models.attention import causal_attention
from tests.kernels.interp import kernel_device, load_kernels

# float8 e4m3: 3 mantissa bits. Round to nearest: |error| <= |x| / 16 (normal numbers) or half the subnormal step,
# 2^-10 * scale; one step (truncation, or a rounding mode that differs) is twice that.
HALF_STEP, ONE_STEP = 2.0 ** -4, 2.0 ** -3
_paged = None   # the triton_paged module, once loaded (test_the_kernels_byte_codec_...)


def _within(x: torch.Tensor, back: torch.Tensor, scale: torch.Tensor, rel: float) -> bool:
    subnormal_step = scale[..., None] * 2.0 ** -9
    bound = x.abs() * rel + subnormal_step * (rel / HALF_STEP) + 1e-12
    return bool(((x - back).abs() <= bound).all())


def _layout(heads: int, dim: int, v_heads: int | None = None) -> KVLayout:
    v = heads if v_heads is None else v_heads
    return KVLayout(num_layers=1, layers=(0,), k_heads=heads, k_dim=dim, v_heads=v, v_dim=dim if v else 0)


def test_torch_store_round_trips_within_half_a_step_and_scales_each_head():
    g = torch.Generator().manual_seed(0)
    pool = KVPool(layout=_layout(4, 64), num_pages=4, page_size=4, dtype=torch.float32, device="cpu",
                  kv_cache_dtype="fp8")
    assert pool.k[0].dtype == FP8 and pool.k_scale[0].shape == (16, 4)
    k = torch.randn(5, 4, 64, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0])[None, :, None]   # one zero head
    v = torch.randn(5, 4, 64, generator=g) * 100
    slots = torch.tensor([3, 0, 9, 15, 4])
    pool.store(0, slots, k, v)
    back_k, back_v = pool.keys(0, slots, torch.float32), pool.values(0, slots, torch.float32)
    assert _within(k, back_k, pool.k_scale[0][slots], HALF_STEP)
    assert _within(v, back_v, pool.v_scale[0][slots], HALF_STEP)
    assert torch.equal(back_k[:, 3], torch.zeros(5, 64))                      # an all-zero head stays zero
    torch.testing.assert_close(pool.k_scale[0][slots], k.abs().amax(-1).clamp_min(1e-12) / 448)
    err = (back_k[:, :3] - k[:, :3]).norm(dim=-1) / k[:, :3].norm(dim=-1)
    print(f"fp8 round trip: per-head relative error max {err.max():.4f}, mean {err.mean():.4f}")
    assert err.max() < 0.05


def test_triton_store_equals_the_torch_quantization_within_one_step_and_skips_padding():
    k = load_kernels("ferrylm.engine.attention.triton_paged")
    dev = kernel_device()
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 2, 80, generator=g) * torch.tensor([0.01, 20.0])[None, :, None]).to(dev)
    cache = torch.zeros(12, 2, 80, dtype=FP8, device=dev)
    scale = torch.ones(12, 2, device=dev)
    slots = torch.tensor([7, 1, -1, 11, 0, 5], device=dev)
    k.store_quantized(x, cache, scale, slots)
    ok = slots >= 0
    want_q, want_s = quantize_fp8(x[ok])
    torch.testing.assert_close(scale[slots[ok]], want_s)
    back = dequantize_fp8(cache[slots[ok]], scale[slots[ok]], torch.float32)
    assert _within(x[ok].float(), back, want_s, ONE_STEP)
    untouched = torch.ones(12, dtype=torch.bool, device=dev)
    untouched[slots[ok]] = False
    assert torch.equal(scale[untouched], torch.ones_like(scale[untouched]))     # the padding row wrote nothing
    assert not cache[untouched].float().any()


@pytest.mark.parametrize("splits", [1, 2])
def test_paged_attention_over_an_fp8_pool_equals_the_reference_over_its_values(splits):
    """A prefill chunk of 5 over a 7-token prefix and a decode at length 12, GQA 2: the kernel over the fp8 pool
    equals causal attention over the pool's dequantized K/V, and is within 5% of attention over the unquantized
    K/V."""
    kmod = load_kernels("ferrylm.engine.attention.triton_paged")
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, ps = 4, 2, 64, 4
    pool = KVPool(layout=_layout(hkv, d), num_pages=8, page_size=ps, dtype=dtype, device=dev, kv_cache_dtype="fp8")
    seqs = [(5, 7, [6, 2, 0]), (1, 11, [1, 7, 3])]                  # (q_len, ctx_len, pages)
    full_k, full_v, slots_of = [], [], []
    for q_len, ctx, pages in seqs:
        slots = (torch.tensor(pages)[:, None] * ps + torch.arange(ps)).reshape(-1)[:ctx + q_len].to(dev)
        kx = torch.randn(ctx + q_len, hkv, d, generator=g).to(dev, dtype)
        vx = torch.randn(ctx + q_len, hkv, d, generator=g).to(dev, dtype)
        pool.store(0, slots[:ctx], kx[:ctx], vx[:ctx])                # the cached prefix (torch store)
        full_k.append(kx), full_v.append(vx), slots_of.append(slots)
    new_k = torch.cat([kx[c:] for kx, (_, c, _) in zip(full_k, seqs)])
    new_v = torch.cat([vx[c:] for vx, (_, c, _) in zip(full_v, seqs)])
    new_slots = torch.cat([s[c:] for s, (_, c, _) in zip(slots_of, seqs)])
    q = torch.randn(new_k.shape[0], hq, d, generator=g).to(dev, dtype)
    kmod.store_kv(new_k, new_v, pool.k[0], pool.v[0], new_slots, pool.k_scale[0], pool.v_scale[0])
    bt = torch.tensor([p for _, _, p in seqs], dtype=torch.int32, device=dev)
    lens = torch.tensor([c + ql for ql, c, _ in seqs], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, 5, 6], dtype=torch.int32, device=dev)
    out = kmod.paged_attention(q, pool.k[0], pool.v[0], bt, lens, qsl, scale=d ** -0.5, page_size=ps,
                               max_query_len=5, num_splits=splits, k_scale=pool.k_scale[0], v_scale=pool.v_scale[0])
    start = 0
    for (ql, ctx, _), slots, kx, vx in zip(seqs, slots_of, full_k, full_v):
        qs = q[start:start + ql].double()
        ref = causal_attention(qs, pool.keys(0, slots, torch.float64), pool.values(0, slots, torch.float64),
                               d ** -0.5, q_offset=ctx)
        exact = causal_attention(qs, kx.double(), vx.double(), d ** -0.5, q_offset=ctx)
        got = out[start:start + ql].double()
        rel = ((got - ref).norm() / ref.norm()).item()
        drift = ((got - exact).norm() / exact.norm()).item()
        print(f"paged fp8 q_len {ql}: vs dequantized pool {rel:.2e}, vs unquantized K/V {drift:.4f}")
        assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-5)
        assert drift < 0.05
        start += ql


def test_latent_decode_over_an_fp8_pool_equals_the_reference_over_its_rows():
    """Latent rows ``[c_kv ; k_pe]`` stored quantized (one scale per row; a padding row writes nothing), then the
    absorbed decode kernel over them equals the torch absorbed attention over the dequantized rows."""
    import ferrylm.models.latent_attention as la

    kmod = load_kernels("ferrylm.engine.attention.triton_latent")
    dev = kernel_device()
    g = torch.Generator().manual_seed(3)
    r, p, heads, ps = 32, 8, 4, 4
    pool = KVPool(layout=KVLayout(1, (0,), 1, r + p, 0, 0), num_pages=6, page_size=ps, dtype=torch.float32,
                  device=dev, kv_cache_dtype="fp8")
    lens, tables = [9, 3], [[4, 1, 5], [2]]
    rows = [torch.randn(n, r + p, generator=g).to(dev) for n in lens]
    slots = [(torch.tensor(t)[:, None] * ps + torch.arange(ps)).reshape(-1)[:n].to(dev) for t, n in zip(tables, lens)]
    pad = torch.tensor([-1], device=dev)
    kmod.store_rows(torch.cat((*rows, torch.randn(1, r + p, generator=g).to(dev))), pool.k[0],
                    torch.cat((*slots, pad)), pool.k_scale[0])
    assert int((pool.k_scale[0] != 1).sum()) == sum(lens)           # the padding row left its slot alone
    q_abs, q_pe = torch.randn(2, heads, r, generator=g).to(dev), torch.randn(2, heads, p, generator=g).to(dev)
    bt = torch.tensor([tables[0], tables[1] * 3], dtype=torch.int32, device=dev)
    got = kmod.latent_decode_attention(q_abs, q_pe, pool.k[0], bt, torch.tensor(lens, dtype=torch.int32, device=dev),
                                       0.2, ps, row_scale=pool.k_scale[0])
    for b in range(2):
        stored = pool.keys(0, slots[b], torch.float32)[:, 0]
        assert _within(rows[b], stored, pool.k_scale[0][slots[b], 0], ONE_STEP)
        want = la.absorbed_attention(q_abs[b:b + 1, :, None], q_pe[b:b + 1, :, None], stored[None], r, 0.2)
        torch.testing.assert_close(got[b], want[0, :, 0], atol=1e-5, rtol=1e-5)


def test_triton_backend_over_an_fp8_pool_equals_the_torch_backend():
    """One step through the backends (``TritonPagedAttention.attend`` / the torch ``PagedAttention``), each over its
    own fp8 pool holding the same prefix: a 3-token chunk after 5 cached tokens and a decode at length 9. Both
    store the new K/V quantized (the same bytes and scales) and give the same attention."""
    load_kernels("ferrylm.engine.attention.triton_paged")
    from ferrylm.engine.attention.metadata import AttentionMetadata
    from ferrylm.engine.attention.torch_backend import torch_attention
    from ferrylm.engine.attention.triton_backend import TritonPagedAttention

    dev = kernel_device()
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, ps = 4, 2, 32, 4
    seqs = [(3, 5, [3, 0]), (1, 8, [5, 1, 4])]
    pools = [KVPool(layout=_layout(hkv, d), num_pages=6, page_size=ps, dtype=torch.float32, device=dev,
                    kv_cache_dtype="fp8") for _ in range(2)]
    new_slots = []
    for q_len, ctx, pages in seqs:
        slots = (torch.tensor(pages)[:, None] * ps + torch.arange(ps)).reshape(-1)[:ctx + q_len].to(dev)
        kx, vx = torch.randn(2, ctx, hkv, d, generator=g).to(dev)
        for pool in pools:
            pool.store(0, slots[:ctx], kx, vx)
        new_slots.append(slots[ctx:])
    q = torch.randn(4, hq, d, generator=g).to(dev)
    k, v = torch.randn(2, 4, hkv, d, generator=g).to(dev)
    meta = AttentionMetadata(slot_mapping=torch.cat(new_slots), block_table=torch.tensor(
        [[3, 0, 0], [5, 1, 4]], dtype=torch.int32, device=dev), seq_lens=torch.tensor([8, 9], dtype=torch.int32,
        device=dev), query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32, device=dev), max_query_len=3,
        host_seqs=seqs)
    got = TritonPagedAttention(pools[0], meta).attend(0, q, k, v, d ** -0.5)
    want = torch_attention(pools[1], meta, dev).attend(0, q, k, v, d ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in ((pools[0].k_scale[0], pools[1].k_scale[0]), (pools[0].v_scale[0], pools[1].v_scale[0])):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(pools[0].v[0].float(), pools[1].v[0].float())


def test_the_kernels_byte_codec_equals_torchs_float8_for_every_value():
    """``e4m3_to_float`` decodes each of the 254 finite e4m3fn bytes to torch's value, and ``float_to_e4m3``
    encodes each value back to its byte, -0.0 to +0.0 (the kernels' fp8 needs no hardware float8 type)."""
    import triton
    import triton.language as tl

    global _paged   # a jitted function reads module globals, not closures
    _paged = load_kernels("ferrylm.engine.attention.triton_paged")

    @triton.jit
    def codec(bits_ptr, out_ptr, back_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        f = _paged.e4m3_to_float(tl.load(bits_ptr + i))
        tl.store(out_ptr + i, f)
        tl.store(back_ptr + i, _paged.float_to_e4m3(f))

    dev = kernel_device()
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)   # 0x7F / 0xFF: NaN
    pad = torch.zeros(256, dtype=torch.uint8)
    pad[:len(bits)] = bits
    out, back = torch.empty(256, device=dev), torch.empty(256, dtype=torch.uint8, device=dev)
    codec[(1,)](pad.to(dev), out, back, BLOCK=256)
    want = bits.view(FP8).float()
    assert torch.equal(out[:len(bits)].cpu(), want)
    signed_zero = bits == 0x80                                   # -0.0 encodes as +0.0: the same value
    assert torch.equal(back[:len(bits)].cpu()[~signed_zero], bits[~signed_zero])
    assert int(back[:len(bits)].cpu()[signed_zero]) == 0


def test_a_partial_page_copy_carries_the_fp8_scales():
    """The prefix cache's tails (``KVPool.copy_page_prefix``) copy values and their per-token scales: the copied
    tokens read back equal to the source's."""
    g = torch.Generator().manual_seed(1)
    pool = KVPool(layout=_layout(2, 32), num_pages=4, page_size=4, dtype=torch.float32, device="cpu",
                  kv_cache_dtype="fp8")
    k, v = torch.randn(3, 2, 32, generator=g) * 50, torch.randn(3, 2, 32, generator=g) * 0.01
    src = torch.tensor([4, 5, 6])                         # page 1, slots 0..2
    pool.store(0, src, k, v)
    pool.copy_page_prefix(1, 3, 3)
    dst = torch.tensor([12, 13, 14])                      # page 3, slots 0..2
    assert torch.equal(pool.keys(0, dst, torch.float32), pool.keys(0, src, torch.float32))
    assert torch.equal(pool.values(0, dst, torch.float32), pool.values(0, src, torch.float32))
