"""The Triton paged-attention kernels against the torch reference (``models/attention.causal_attention`` over each
sequence's gathered K/V): prefill chunks over a cached prefix, ragged decode, mixed batches, GQA 1/4/8, head_dim
64/128 (and a non-power-of-two 80), page sizes 16 and 1, split-KV. On CPU through Triton's interpreter (float32);
on a GPU in bfloat16."""

from __future__ import annotations

import pytest
import torch

from ferrylm.models.attention import causal_attention
from tests.kernels.interp import kernel_device, load_kernels


def _case(hq, hkv, d, ps, q_lens, ctx_lens, splits, seed, window=None, with_sinks=False):
    k = load_kernels("ferrylm.engine.attention.triton_paged")
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(c + q) // ps) for c, q in zip(ctx_lens, q_lens)) + 3
    kc = torch.randn(num_pages * ps, hkv, d, generator=g).to(dev, dtype)
    vc = torch.randn(num_pages * ps, hkv, d, generator=g).to(dev, dtype)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=g).to(dev, dtype)
    knew = torch.randn(t, hkv, d, generator=g).to(dev, dtype)
    vnew = torch.randn(t, hkv, d, generator=g).to(dev, dtype)
    perm = torch.randperm(num_pages, generator=g)
    width = max(-(-(c + ql) // ps) for c, ql in zip(ctx_lens, q_lens))
    bt = torch.zeros(len(q_lens), width, dtype=torch.int32)
    seq_slots, new_slots, used = [], [], 0
    for b, (c, ql) in enumerate(zip(ctx_lens, q_lens)):
        n = -(-(c + ql) // ps)
        pages = perm[used:used + n]
        used += n
        bt[b, :n] = pages
        slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)[:c + ql]
        seq_slots.append(slots)
        new_slots.append(slots[c:])
    k.store_kv(knew, vnew, kc, vc, torch.cat(new_slots).to(dev))
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist(), dtype=torch.int32, device=dev)
    lens = torch.tensor([c + ql for c, ql in zip(ctx_lens, q_lens)], dtype=torch.int32, device=dev)
    out = torch.full_like(q, float("nan"))
    sinks = (2 * torch.randn(hq, generator=g)).to(dev) if with_sinks else None
    k.paged_attention(q, kc, vc, bt.to(dev), lens, qsl, scale=d ** -0.5, page_size=ps,
                      max_query_len=max(q_lens), num_splits=splits, out=out, window=window, sinks=sinks)
    for b, (c, ql) in enumerate(zip(ctx_lens, q_lens)):
        s0 = int(qsl[b])
        sl = seq_slots[b].to(dev)
        # the new K/V must be in the pool, at the sequence's last positions
        assert torch.equal(kc[sl[c:]], knew[s0:s0 + ql]) and torch.equal(vc[sl[c:]], vnew[s0:s0 + ql])
        ref = causal_attention(q[s0:s0 + ql].double(), kc[sl].double(), vc[sl].double(), d ** -0.5, q_offset=c,
                               window=window, sinks=sinks)
        got = out[s0:s0 + ql].double()
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-5), (b, rel)


@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 64), (16, 4, 128), (16, 2, 64), (6, 2, 80)])
@pytest.mark.parametrize("ps", [16, 1])
def test_prefill_with_prefix_and_ragged_decode_in_one_call(hq, hkv, d, ps):
    # a fresh prompt, a chunk after a cached prefix, two decodes of different lengths, a one-token prompt
    _case(hq, hkv, d, ps, q_lens=[19, 7, 1, 1, 1], ctx_lens=[0, 33, 40, 5, 0], splits=1, seed=hq * 131 + d + ps)


@pytest.mark.parametrize("splits", [2, 8])
def test_split_kv_decode_matches_reference(splits):
    # lengths shorter than a split, one split exactly, many tiles
    _case(16, 2, 64, 16, q_lens=[1, 1, 1, 1], ctx_lens=[3, 0, 64, 150], splits=splits, seed=splits)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window,with_sinks", [(5, False), (None, True), (70, True)])
def test_sliding_window_and_sinks_match_reference(splits, window, with_sinks):
    """gpt-oss's attention: a window shorter than a tile and longer than one, sinks, prefill over a prefix and
    decodes in one call; a split-KV decode merges the sink once."""
    q_lens, ctx = ([1, 1, 1], [3, 90, 150]) if splits > 1 else ([19, 7, 1, 1], [0, 100, 40, 2])
    _case(8, 2, 64, 16, q_lens=q_lens, ctx_lens=ctx, splits=splits, seed=splits + (window or 0),
          window=window, with_sinks=with_sinks)


def test_padding_rows_store_nothing_and_read_nothing():
    k = load_kernels("ferrylm.engine.attention.triton_paged")
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kc = torch.randn(64, 2, 64, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    before_k, before_v = kc.clone(), vc.clone()
    q = torch.randn(3, 4, 64, device=dev, dtype=dtype)
    k.store_kv(q[:, :2], q[:, 2:], kc, vc, torch.full((3,), -1, dtype=torch.int64, device=dev))
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)
    out = torch.full_like(q, float("nan"))
    k.paged_attention(q, kc, vc, torch.zeros(3, 4, dtype=torch.int32, device=dev),
                      torch.zeros(3, dtype=torch.int32, device=dev), torch.arange(4, dtype=torch.int32, device=dev),
                      scale=0.125, page_size=16, max_query_len=1, num_splits=2, out=out)
    assert torch.equal(out, torch.zeros_like(out))
