"""The torch paged-attention backend (engine/attention/torch_backend.py): a prefill sequence with nothing cached
attends over its new K/V as given (no gather back from the pool, which would return the same values), a chunk after
cached tokens gathers its whole context, and an fp8 pool is always read back (its values are the quantized ones)."""

from __future__ import annotations

import pytest
import torch

from ferrylm.engine.attention.torch_backend import PagedAttention, SeqSlice
from ferrylm.engine.cache.kv_pool import KVLayout, KVPool
from ferrylm.models.attention import causal_attention


def _pool(kv_cache_dtype: str) -> KVPool:
    layout = KVLayout(num_layers=1, layers=(0,), k_heads=2, k_dim=16, v_heads=2, v_dim=16)
    return KVPool(layout=layout, num_pages=8, page_size=4, dtype=torch.float32, device="cpu",
                  kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype, fresh_gathers", [("auto", False), ("fp8", True)])
def test_fresh_prefill_reads_its_kv_as_given(monkeypatch, kv_cache_dtype, fresh_gathers):
    g = torch.Generator().manual_seed(0)
    pool = _pool(kv_cache_dtype)
    gathered: list[int] = []
    keys = pool.keys
    monkeypatch.setattr(pool, "keys", lambda layer, idx, dtype: gathered.append(idx.numel()) or keys(layer, idx, dtype))
    q, k, v = (torch.randn(7, h, 16, generator=g) for h in (4, 2, 2))
    fresh = SeqSlice(q_start=0, q_len=7, ctx_len=0, slots=torch.arange(7))
    out = PagedAttention(pool, [fresh], "cpu").attend(0, q, k, v, 0.25)
    assert gathered == ([7] if fresh_gathers else [])
    if kv_cache_dtype == "auto":  # bit for bit what attention over the gathered K/V gives
        assert torch.equal(out, causal_attention(q, pool.keys(0, fresh.slots, q.dtype),
                                                 pool.values(0, fresh.slots, q.dtype), 0.25, q_offset=0))
    # the same tokens as a chunk after 4 cached ones: the whole context is gathered, and the last 3 rows agree
    tail = SeqSlice(q_start=0, q_len=3, ctx_len=4, slots=torch.arange(7))
    again = PagedAttention(pool, [tail], "cpu").attend(0, q[4:], k[4:], v[4:], 0.25)
    assert gathered[-1] == 7
    assert torch.allclose(again, out[4:], atol=1e-5, rtol=0)
