"""Multi-head latent attention over the paged latent pool (``attend_latent``): the absorbed form equals attention over
the expanded keys and values; the torch backend (decodes batched, prefill chunks over a prefix, both forms), the
decode-graph backend and the Triton backend's captured-decode path (padding rows write nothing) agree with it."""

from __future__ import annotations

import pytest
import torch

import ferrylm.models.latent_attention as la
from ferrylm.engine.attention.metadata import AttentionMetadata
from ferrylm.engine.attention.torch_backend import torch_attention
from ferrylm.engine.attention.triton_backend import TritonPagedAttention
from ferrylm.engine.attention.torch_backend import StaticDecodeAttention
from ferrylm.engine.cache.kv_pool import KVLayout, KVPool
from ferrylm.models.attention import causal_attention

H, N, P, V, R = 4, 16, 8, 12, 32
PS = 4  # tokens per page
SCALE = (N + P) ** -0.5


def _proj(seed: int = 0) -> la.LatentProjection:
    g = torch.Generator().manual_seed(seed)
    return la.LatentProjection.of(torch.randn(H * (N + V), R, generator=g) * 0.3, H, N, V)


def _reference(q_nope, q_pe, c, k_pe, proj, q_offset: int) -> torch.Tensor:
    """Causal attention over expanded keys ``[W_UK c ; k_pe]`` and values ``W_UV c`` (written out, no helper)."""
    k_nope = torch.einsum("hnr,lr->lhn", proj.w_uk, c)
    v = torch.einsum("hvr,lr->lhv", proj.w_uv, c)
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, H, -1)), dim=-1)
    return causal_attention(torch.cat((q_nope, q_pe), dim=-1), k, v, SCALE, q_offset=q_offset)


def _rand(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, H, N, generator=g), torch.randn(t, H, P, generator=g), torch.randn(t, R, generator=g),
            torch.randn(t, P, generator=g))


def test_absorbed_decode_equals_expanded_attention():
    proj = _proj()
    q_nope, q_pe, c, k_pe = _rand(9, 1)
    want = _reference(q_nope, q_pe, c, k_pe, proj, 0)[-1]
    latent = la.latent_row(c, k_pe)[:, 0]
    got = la.latent_decode(q_nope[-1:], q_pe[-1:], latent[None], proj, SCALE, None)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a padded row past the length changes nothing when masked
    padded = torch.cat((latent, torch.randn(3, R + P)))[None]
    mask = torch.arange(12)[None] < 9
    torch.testing.assert_close(la.latent_decode(q_nope[-1:], q_pe[-1:], padded, proj, SCALE, mask)[0], want,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("absorbed", [True, False])
def test_chunk_forms_equal_the_reference(monkeypatch, absorbed):
    monkeypatch.setattr(la, "absorb_wins", lambda *a, **k: absorbed)
    proj = _proj(2)
    q_nope, q_pe, c, k_pe = _rand(11, 3)
    latent = la.latent_row(c, k_pe)[:, 0]
    got = la.latent_chunk_attention(q_nope[6:], q_pe[6:], latent, proj, SCALE, q_offset=6)
    torch.testing.assert_close(got, _reference(q_nope[6:], q_pe[6:], c, k_pe, proj, 6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("absorbed", [True, False])
@pytest.mark.parametrize("q_offset,tq,key_block,score_bytes", [
    (0, 23, 5, 12 * H * 5 * 3),     # no prefix: 5 key blocks, query blocks of 3 rows crossing the diagonal
    (17, 9, 4, 12 * H * 4 * 2),     # a prefix not a multiple of the key block; 2-row query blocks
    (40, 1, 7, 1 << 30),            # one query over a long prefix (one query block)
    (8, 16, 8, 12 * H * 8 * 5),     # key blocks aligned with the prefix; query block (5) not dividing the chunk
])
def test_blocked_chunk_attention_equals_the_reference(monkeypatch, absorbed, q_offset, tq, key_block, score_bytes):
    """The online-softmax key blocks (small blocks, so every boundary case runs) give the unblocked result; rows of
    the latent past the chunk are never read (they are NaN here)."""
    monkeypatch.setattr(la, "absorb_wins", lambda *a, **k: absorbed)
    monkeypatch.setattr(la, "KEY_BLOCK", key_block)
    monkeypatch.setattr(la, "SCORE_BLOCK_BYTES", score_bytes)
    real = la.blocked_causal_attention
    reads: list[tuple[int, int]] = []

    def spy(q_main, q_pe, key_block_fn, length, q_off, scale):
        def counted(j0, j1):
            reads.append((j0, j1))
            return key_block_fn(j0, j1)
        return real(q_main, q_pe, counted, length, q_off, scale, key_block_size=la.KEY_BLOCK,
                    score_bytes=la.SCORE_BLOCK_BYTES)

    monkeypatch.setattr(la, "blocked_causal_attention", spy)
    proj = _proj(8)
    q_nope, q_pe, c, k_pe = _rand(q_offset + tq, 9)
    latent = torch.cat((la.latent_row(c, k_pe)[:, 0], torch.full((3, R + P), float("nan"))))
    got = la.latent_chunk_attention(q_nope[q_offset:], q_pe[q_offset:], latent, proj, SCALE, q_offset=q_offset)
    want = _reference(q_nope[q_offset:], q_pe[q_offset:], c, k_pe, proj, q_offset)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert max(j1 - j0 for j0, j1 in reads) <= key_block and reads[-1][1] == q_offset + tq
    assert [j0 for j0, _ in reads] == list(range(0, q_offset + tq, key_block))   # each key block expanded once


def _flash_reference(q, k, v, scale, causal):
    """What ``aten._scaled_dot_product_flash_attention`` returns (output, log-sum-exp), written out."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype), torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("q_offset,tq", [(0, 11), (7, 9), (12, 1), (5, 4)])
def test_flash_expanded_blocks_equal_the_reference(monkeypatch, q_offset, tq):
    """The flash form's query blocks, key blocks and diagonal blocks, merged by log-sum-exp (small blocks so every
    boundary runs; the kernel replaced by its written-out semantics), give causal attention over the expanded
    keys; rows of the latent past the chunk are never read (NaN here)."""
    monkeypatch.setattr(la, "_flash", _flash_reference)
    monkeypatch.setattr(la, "flash_usable", lambda x: True)
    monkeypatch.setattr(la, "absorb_wins", lambda *a, **k: False)
    monkeypatch.setattr(la, "FLASH_QUERY_BLOCK", 4)
    monkeypatch.setattr(la, "FLASH_KEY_BLOCK", 3)
    proj = _proj(12)
    q_nope, q_pe, c, k_pe = _rand(q_offset + tq, 13)
    latent = torch.cat((la.latent_row(c, k_pe)[:, 0], torch.full((2, R + P), float("nan"))))
    got = la.latent_chunk_attention(q_nope[q_offset:], q_pe[q_offset:], latent, proj, SCALE, q_offset=q_offset)
    want = _reference(q_nope[q_offset:], q_pe[q_offset:], c, k_pe, proj, q_offset)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_blocked_attention_bf16_close_to_float32():
    """In bfloat16 (scores in the input dtype, softmax in float32) within bfloat16 rounding of the float32 result."""
    proj = _proj(10)
    q_nope, q_pe, c, k_pe = _rand(300, 11)
    latent = la.latent_row(c, k_pe)[:, 0]
    want = la.latent_chunk_attention(q_nope[100:], q_pe[100:], latent, proj, SCALE, q_offset=100)
    bf = la.LatentProjection.of(proj.weight.bfloat16(), H, N, V)
    got = la.latent_chunk_attention(q_nope[100:].bfloat16(), q_pe[100:].bfloat16(), latent.bfloat16(), bf, SCALE,
                                    q_offset=100)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)


def test_absorb_threshold_at_deepseek_v3_shapes():
    assert la.absorb_wins(170, 512, 128, 64, 128) and not la.absorb_wins(171, 512, 128, 64, 128)
    assert la.absorb_wins(1, 512, 128, 64, 128)


def _pool(layers: int = 1, kv_cache_dtype: str = "auto") -> KVPool:
    layout = KVLayout(num_layers=layers, layers=tuple(range(layers)), k_heads=1, k_dim=R + P, v_heads=0, v_dim=0)
    return KVPool(layout=layout, num_pages=16, page_size=PS, dtype=torch.float32, device="cpu",
                  kv_cache_dtype=kv_cache_dtype)


def _meta(pool: KVPool, seqs: list[tuple[int, int, list[int]]], host: bool) -> AttentionMetadata:
    """Metadata of ``(q_len, ctx_len, pages)`` sequences (slots from the pages)."""
    slots, qsl, width = [], [0], max(len(p) for _, _, p in seqs)
    for q_len, ctx, pages in seqs:
        slots += [pages[i // PS] * PS + i % PS for i in range(ctx, ctx + q_len)]
        qsl.append(qsl[-1] + q_len)
    table = torch.tensor([p + [p[0]] * (width - len(p)) for _, _, p in seqs], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.tensor(slots), block_table=table,
                             seq_lens=torch.tensor([q + c for q, c, _ in seqs], dtype=torch.int32),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             max_query_len=max(q for q, _, _ in seqs), host_seqs=seqs if host else None)


def _fill_prefix(pool: KVPool, pages: list[int], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, c, k_pe = _rand(n, seed)
    slots = torch.tensor([pages[i // PS] * PS + i % PS for i in range(n)])
    pool.store(0, slots, la.latent_row(c, k_pe))
    return c, k_pe


@pytest.mark.parametrize("absorbed", [True, False])
def test_torch_backend_mixed_step_equals_reference(monkeypatch, absorbed):
    """One step: sequence A decodes its 10th token, sequence B computes a 5-token chunk after 6 cached tokens (its
    chunk crosses a page boundary)."""
    monkeypatch.setattr(la, "absorb_wins", lambda *a, **k: absorbed)
    pool, proj = _pool(), _proj(4)
    a_pages, b_pages = [3, 7, 1], [5, 2, 9]
    ca, pa = _fill_prefix(pool, a_pages, 9, 10)
    cb, pb = _fill_prefix(pool, b_pages, 6, 11)
    q_nope, q_pe, c, k_pe = _rand(6, 12)
    attn = torch_attention(pool, _meta(pool, [(1, 9, a_pages), (5, 6, b_pages)], host=True), torch.device("cpu"))
    out = attn.attend_latent(0, q_nope, q_pe, c, k_pe, proj, SCALE)
    want_a = _reference(q_nope[:1], q_pe[:1], torch.cat((ca, c[:1])), torch.cat((pa, k_pe[:1])), proj, 9)
    want_b = _reference(q_nope[1:], q_pe[1:], torch.cat((cb, c[1:])), torch.cat((pb, k_pe[1:])), proj, 6)
    torch.testing.assert_close(out, torch.cat((want_a, want_b)), atol=1e-5, rtol=1e-5)
    assert pool.v[0].numel() == 0  # the latent layout keeps no V


def _decode_batch(pool: KVPool):
    """Three decoding sequences of lengths 10, 3 and 7 (new token included) with their prefixes in the pool."""
    pages = [[3, 7, 1], [5], [2, 9]]
    lens = [10, 3, 7]
    for i, (p, n) in enumerate(zip(pages, lens)):
        _fill_prefix(pool, p, n - 1, 20 + i)
    return pages, lens


def test_static_decode_backend_equals_torch_backend():
    pool, proj = _pool(), _proj(5)
    pages, lens = _decode_batch(pool)
    q_nope, q_pe, c, k_pe = _rand(3, 30)
    torch_pool = _pool()
    torch_pool.k[0].copy_(pool.k[0])
    want = torch_attention(torch_pool, _meta(torch_pool, [(1, n - 1, p) for p, n in zip(pages, lens)], host=True),
                           torch.device("cpu")).attend_latent(0, q_nope, q_pe, c, k_pe, proj, SCALE)
    width = 12
    slot_table = torch.stack([torch.tensor([p[min(i // PS, len(p) - 1)] * PS + i % PS for i in range(width)])
                              for p in pages])
    mask = torch.arange(width)[None] < torch.tensor(lens)[:, None]
    new_slots = slot_table[torch.arange(3), torch.tensor(lens) - 1]
    got = StaticDecodeAttention(pool, slot_table, new_slots, mask).attend_latent(0, q_nope, q_pe, c, k_pe, proj,
                                                                                 SCALE)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.k[0], torch_pool.k[0])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("host", [False, True])
def test_triton_backend_decode_equals_torch_backend_and_skips_padding(host, kv_cache_dtype):
    """A decode step, captured (no host figures) or eager: the rows go through the Triton store (a padding row,
    slot -1, writes nothing), attention through the Triton latent decode kernel over each sequence's own rows;
    equals the torch backend's, over an unquantized or an fp8 pool (rows and their scales)."""
    from tests.kernels.interp import load_kernels

    load_kernels("ferrylm.engine.attention.triton_latent")
    pool, proj = _pool(kv_cache_dtype=kv_cache_dtype), _proj(6)
    pages, lens = _decode_batch(pool)
    q_nope, q_pe, c, k_pe = _rand(4, 40)                        # the 4th row is a padding sequence
    torch_pool = _pool(kv_cache_dtype=kv_cache_dtype)
    torch_pool.k[0].copy_(pool.k[0])
    torch_pool.k_scale[0].copy_(pool.k_scale[0])
    want = torch_attention(torch_pool, _meta(torch_pool, [(1, n - 1, p) for p, n in zip(pages, lens)], host=True),
                           torch.device("cpu")).attend_latent(0, q_nope[:3], q_pe[:3], c[:3], k_pe[:3], proj, SCALE)
    meta = _meta(pool, [(1, n - 1, p) for p, n in zip(pages, lens)] + [(1, 0, [0])], host=host)
    meta.slot_mapping[3] = -1
    meta.seq_lens[3] = 0
    before = pool.k[0].clone()
    got = TritonPagedAttention(pool, meta).attend_latent(0, q_nope, q_pe, c, k_pe, proj, SCALE)
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros_like(got[3]))       # a padding sequence reads nothing
    torch.testing.assert_close(pool.k[0].float(), torch_pool.k[0].float())   # the same three rows, nothing else
    torch.testing.assert_close(pool.k_scale[0], torch_pool.k_scale[0])
    assert not torch.equal(pool.k[0].float(), before.float())


def test_triton_backend_eager_step_uses_the_torch_dispatch():
    pool, proj = _pool(), _proj(7)
    b_pages = [5, 2, 9]
    cb, pb = _fill_prefix(pool, b_pages, 6, 11)
    q_nope, q_pe, c, k_pe = _rand(5, 50)
    got = TritonPagedAttention(pool, _meta(pool, [(5, 6, b_pages)], host=True)).attend_latent(
        0, q_nope, q_pe, c, k_pe, proj, SCALE)
    want = _reference(q_nope, q_pe, torch.cat((cb, c)), torch.cat((pb, k_pe)), proj, 6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_latent_decode_kernel_over_head_blocks_and_tiles(num_splits):
    """20 heads (two head blocks, the second partly masked), lengths 70 / 1 / 33 / 0 (several 32-token tiles, one
    row, a tile boundary, a padding sequence), pages in any order, with and without split-KV (4 splits: a range of
    32 rows each at length 70, empty ranges at the shorter ones): the kernel equals the torch absorbed decode, and a
    padding sequence's output is zeros."""
    from tests.kernels.interp import load_kernels

    k = load_kernels("ferrylm.engine.attention.triton_latent")
    g = torch.Generator().manual_seed(9)
    heads, lens, ps = 20, [70, 1, 33, 0], 8
    cache = torch.randn(40 * ps, 1, R + P, generator=g)
    perm = torch.randperm(40, generator=g)
    tables = [perm[:9], perm[9:10], perm[10:15], perm[15:16]]
    width = max(len(t) for t in tables)
    block_table = torch.stack([torch.cat((t, t[:1].repeat(width - len(t)))) for t in tables]).to(torch.int32)
    q_abs, q_pe = torch.randn(4, heads, R, generator=g), torch.randn(4, heads, P, generator=g)
    got = k.latent_decode_attention(q_abs, q_pe, cache, block_table, torch.tensor(lens, dtype=torch.int32), SCALE, ps,
                                    num_splits=num_splits)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    for b, n in enumerate(lens[:3]):
        slots = (block_table[b].long()[:, None] * ps + torch.arange(ps)).reshape(-1)[:n]
        want = la.absorbed_attention(q_abs[b:b + 1, :, None], q_pe[b:b + 1, :, None], cache[slots, 0][None], R, SCALE)
        torch.testing.assert_close(got[b], want[0, :, 0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_splits"):
        k.latent_decode_attention(q_abs, q_pe, cache, block_table, torch.tensor(lens, dtype=torch.int32), SCALE, ps,
                                  num_splits=3)
