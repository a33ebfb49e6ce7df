"""DeepSeek-V4's compressed sparse attention over the paged pool in Triton, for every sequence of a step at once (the
math: ``models/compressed_attention.py``; the storage: ``engine/attention/compressed_pages.py``). A layer's call:

1. the new window rows ``[T, D]`` into their slots (``triton_latent.store_rows``; padding rows skipped);
2. a compressing layer pools its entries and carries (``triton_compress.pool_entries``), a CSA layer also its
   indexer keys;
3. a CSA layer's lightning indexer: :func:`index_topk` scores every visible indexer entry of each query
   (``sum_h w_h relu(q_h . k_c) / sqrt(Di)``, read in place through the block table) and keeps the top ``k``
   (``torch.topk`` over an int64 key ``score, then lower entry first`` per column: the reference's stable order, so
   equal scores pick the same entries however the prompt was chunked). The scores are a ``[rows, C]`` workspace (``C``
   the block table's entries), computed in row chunks of at most ``INDEX_WORKSPACE_BYTES``, as the paged MQA logits
   + top-k of DeepSeek-V3.2 indexers;
4. :func:`attend`: one program per (query tile of one sequence, block of heads); the heads share the one key/value
   head, so they are rows of the same tile. It streams, with one online softmax (FlashAttention, Dao et al. 2022,
   Alg. 1): the window rows ``p - window < j <= p`` (through the block table, fp8 rows dequantized with their
   scales), then the compressed entries: all visible ones (``c < (p + 1) // m``, HCA) or the indexer's picks (one
   query per tile; the visible picks come first in ``torch.topk``'s sorted order, so a query reads ``min(k,
   visible)`` of them), and adds each head's sink to the denominator.

No host sync: lengths and page tables come from the step's metadata on the device, grids from host sizes, so a decode
step captures in a CUDA graph. Imported only where Triton and CUDA are (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrylm.engine.attention.metadata import AttentionMetadata
from ferrylm.engine.attention.triton_compress import pool_entries
from ferrylm.engine.attention.triton_latent import store_rows
from ferrylm.engine.attention.triton_paged import (MAX_SEQS_LOG2, block_row, e4m3_to_float, online_softmax,
                                                   query_tile)
from ferrylm.engine.cache.kv_pool import KVPool
from ferrylm.triton_util import dot_precision

INDEX_WORKSPACE_BYTES = 64 << 20   # the indexer's score rows of one launch at most
LOG2E = 1.4426950408889634
NONE, DENSE, SPARSE = 0, 1, 2      # which compressed entries a query reads


@triton.jit
def _index_scores_kernel(iq_ptr, w_ptr, keys_ptr, bt_ptr, lens_ptr, qsl_ptr, tok_seq_ptr, out_ptr, row0, n_cols,
                         page_size, scale, stride_iqt, stride_iqh, stride_wt, stride_keys, stride_bt, stride_out,
                         RATE: tl.constexpr, HEADS: tl.constexpr, H_PAD: tl.constexpr, DIM: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    """Row ``r`` (token ``row0 + r``), entries ``BLOCK_C`` from ``program_id(1) * BLOCK_C``: the int64 keys
    ``(order-preserving int32 of the score) << 32 | (2^32 - 1 - c)`` of the visible entries, ``-2^63`` elsewhere."""
    r = tl.program_id(0)
    t = row0 + r
    s = tl.load(tok_seq_ptr + t)
    pos = tl.load(lens_ptr + s) - tl.load(qsl_ptr + s + 1) + t     # seq_len - q_len + (t - q_start)
    visible = (pos + 1) // RATE                                    # pos >= -1 (a padding row: none)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < visible
    h = tl.arange(0, H_PAD)
    dd = tl.arange(0, D_PAD)
    d_ok = dd < DIM
    q = tl.load(iq_ptr + t.to(tl.int64) * stride_iqt + h[:, None] * stride_iqh + dd[None, :],
                mask=(h[:, None] < HEADS) & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + h, mask=h < HEADS, other=0.0)
    row = block_row(bt_ptr + s.to(tl.int64) * stride_bt, tl.where(c_ok, c, 0), page_size, RATE)
    kt = tl.load(keys_ptr + row[None, :] * stride_keys + dd[:, None], mask=c_ok[None, :] & d_ok[:, None], other=0.0)
    sc = tl.dot(q, kt.to(q.dtype), input_precision=PRECISION)          # [H, C] float32
    score = tl.sum(tl.maximum(sc, 0.0) * scale * w[:, None], 0)
    score = tl.where(score == 0.0, 0.0, score)                       # -0.0 ranks as 0.0
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)            # signed order of the floats
    ordered = tl.where(c_ok, ordered, -2147483648).to(tl.int64)
    low = tl.where(c_ok, 4294967295 - c.to(tl.int64), 0)
    tl.store(out_ptr + r.to(tl.int64) * stride_out + c, (ordered << 32) | low, mask=c < n_cols)


def index_topk(keys: torch.Tensor, ix, meta: AttentionMetadata, page_size: int) -> torch.Tensor:
    """The indexer's picks ``[T, K]`` int64 (entry numbers, best first; a query's picks past its visible entries are
    not visible: the attention masks them), ``K = min(ix.topk, C)`` with ``C`` the block table's entries.

    Args:
        keys: the layer's indexer entries ``[rows, Di]`` (model dtype) in the pool, this step's stored.
        ix: the :class:`~ferrylm.models.compressed_attention.IndexerQuery` (``q [T, Hi, Di]``, ``weights [T, Hi]``).
    """
    q, w = ix.q.contiguous(), ix.weights.float().contiguous()
    t, heads, dim = q.shape
    m = ix.compressor.rate
    n_cols = meta.block_table.shape[1] * page_size // m
    k = min(ix.topk, n_cols)
    qsl = meta.query_start_loc
    tok_seq = torch.searchsorted(qsl[1:].contiguous(), torch.arange(t, device=q.device, dtype=qsl.dtype), right=True)
    picks = torch.empty(t, k, dtype=torch.int64, device=q.device)
    rows = max(1, min(t, INDEX_WORKSPACE_BYTES // (8 * n_cols)))
    scores = torch.empty(rows, n_cols, dtype=torch.int64, device=q.device)
    block_c = 32 if dim <= 128 else 16
    for r0 in range(0, t, rows):
        r = min(rows, t - r0)
        _index_scores_kernel[(r, triton.cdiv(n_cols, block_c))](
            q, w, keys, meta.block_table, meta.seq_lens, qsl, tok_seq, scores, r0, n_cols, page_size,
            dim ** -0.5, q.stride(0), q.stride(1), w.stride(0), keys.stride(0), meta.block_table.stride(0),
            scores.stride(0), RATE=m, HEADS=heads, H_PAD=max(16, triton.next_power_of_2(heads)), DIM=dim,
            D_PAD=max(16, triton.next_power_of_2(dim)), BLOCK_C=block_c, PRECISION=dot_precision(q.dtype),
            num_warps=4)
        picks[r0:r0 + r] = torch.topk(scores[:r], k, dim=1).indices
    return picks


@triton.jit
def _attend_tile(q, acc, m_i, l_i, base_ptr, row, stride, n_ok, visible, d, d_ok, qk_scale, scale_ptr,
                 stride_scale, SCALED: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of ``N`` key rows (``row [N]``; keys are values) into the online softmax of the ``M`` query rows."""
    row = row.to(tl.int64)
    kt = tl.load(base_ptr + row[None, :] * stride + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0)
    if SCALED:
        kt = e4m3_to_float(kt)
    qk = tl.dot(q, kt.to(q.dtype), input_precision=PRECISION) * qk_scale          # [M, N]
    if SCALED:
        rs = tl.load(scale_ptr + row * stride_scale, mask=n_ok, other=0.0)
        qk = qk * rs[None, :]
    p, alpha, m_new, l_i = online_softmax(tl.where(visible, qk, float("-inf")), m_i, l_i)
    v = tl.load(base_ptr + row[:, None] * stride + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0)
    if SCALED:
        v = e4m3_to_float(v)
        p = p * rs[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _compressed_attention_kernel(
        q_ptr, out_ptr, win_ptr, win_scale_ptr, ent_ptr, picks_ptr, sinks_ptr, bt_ptr, lens_ptr, qsl_ptr,
        scale, num_seqs, num_heads, window, page_size, topk,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_win, stride_ws, stride_ent, stride_picks, stride_bt,
        RATE: tl.constexpr, ENTRIES: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_SEQS: tl.constexpr,
        PRECISION: tl.constexpr, SCALED: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    pid = tl.program_id(0)
    s, q_start, q_len, qb = query_tile(pid, qsl_ptr, num_seqs, BLOCK_Q, LOG2_SEQS)
    if qb * BLOCK_Q >= q_len:
        return
    ctx = tl.load(lens_ptr + s) - q_len            # -1 for a padding sequence: it sees nothing
    rows = tl.arange(0, BLOCK_M)
    q_tok = qb * BLOCK_Q + rows // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + rows % BLOCK_H
    row_ok = (q_tok < q_len) & (head < num_heads)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + q_tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx + q_tok
    p_first = ctx + qb * BLOCK_Q
    p_last = ctx + tl.minimum((qb + 1) * BLOCK_Q, q_len) - 1
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634          # softmax in base 2

    for n0 in range(tl.maximum(p_first - window + 1, 0), p_last + 1, BLOCK_N):       # the window rows
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n <= p_last
        slot = block_row(bt_row, tl.where(n_ok, n, 0), page_size, 1)
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, win_ptr, slot, stride_win, n_ok, visible, d, d_ok, qk_scale,
                                     win_scale_ptr, stride_ws, SCALED, PRECISION)
    if ENTRIES == 1:                               # every visible entry (HCA)
        for c0 in range(0, (p_last + 1) // RATE, BLOCK_N):
            c = c0 + tl.arange(0, BLOCK_N)
            c_ok = c < (p_last + 1) // RATE
            visible = c_ok[None, :] & (c[None, :] < ((q_pos + 1) // RATE)[:, None])
            row = block_row(bt_row, tl.where(c_ok, c, 0), page_size, RATE)
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, ent_ptr, row, stride_ent, c_ok, visible, d, d_ok,
                                         qk_scale, win_scale_ptr, stride_ws, False, PRECISION)
    if ENTRIES == 2:                               # the indexer's picks of this tile's one query (BLOCK_Q == 1)
        seen = (p_first + 1) // RATE
        pick_row = picks_ptr + (q_start + qb).to(tl.int64) * stride_picks
        for k0 in range(0, tl.minimum(topk, seen), BLOCK_N):
            kk = k0 + tl.arange(0, BLOCK_N)
            c = tl.load(pick_row + kk, mask=kk < topk, other=-1)
            c_ok = (c >= 0) & (c < seen)
            row = block_row(bt_row, tl.where(c_ok, c, 0), page_size, RATE)
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, ent_ptr, row, stride_ent, c_ok, c_ok[None, :], d, d_ok,
                                         qk_scale, win_scale_ptr, stride_ws, False, PRECISION)

    sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_fin = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_fin)
    l_i = l_i * alpha + tl.exp2(sink - m_fin)
    o = acc * alpha[:, None] / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def attend(q: torch.Tensor, pool: KVPool, layer: int, meta: AttentionMetadata, branch,
           picks: torch.Tensor | None) -> torch.Tensor:
    """Step 4 of the module docstring: ``q [T, H, D]`` over the layer's window rows (stored) and entries ->
    ``[T, H, D]`` in ``q``'s dtype (zeros for a padding sequence's rows). ``picks``: :func:`index_topk`'s, or
    None (every visible entry; none without a compressor)."""
    t, heads, dim = q.shape
    b = meta.num_seqs
    out = torch.empty_like(q)
    if t == 0 or b == 0:
        return out
    comp = branch.compressor
    kind = NONE if comp is None else DENSE if picks is None else SPARSE
    rate = 1 if comp is None else comp.rate
    ent = pool.blocks[(layer, "compressor")] if comp is not None else q
    win, ws = pool.k[layer], pool.k_scale[layer] if pool.scaled else None
    if ws is not None:                             # float8 as bytes (``triton_paged``)
        win = win.view(torch.uint8)
    d_pad = max(16, triton.next_power_of_2(dim))
    block_q = 1 if kind == SPARSE or meta.max_query_len <= 1 or d_pad > 128 else 4   # 16 rows of D > 128: registers
    block_h = max(16 // block_q, min(16, triton.next_power_of_2(heads)))
    sel = picks if picks is not None else q
    _compressed_attention_kernel[(t // block_q + b, triton.cdiv(heads, block_h))](
        q, out, win, win if ws is None else ws, ent, sel, branch.sinks, meta.block_table, meta.seq_lens,
        meta.query_start_loc, branch.scale, b, heads, branch.window, pool.page_size,
        0 if picks is None else picks.shape[1], q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        win.stride(0), 0 if ws is None else ws.stride(0), ent.stride(0), 0 if picks is None else picks.stride(0),
        meta.block_table.stride(0), RATE=rate, ENTRIES=kind, HEAD_DIM=dim, D_PAD=d_pad, BLOCK_Q=block_q,
        BLOCK_H=block_h, BLOCK_N=32 if d_pad <= 128 else 16, LOG2_SEQS=MAX_SEQS_LOG2,
        PRECISION=dot_precision(q.dtype), SCALED=ws is not None, num_warps=4 if d_pad <= 128 else 8)
    return out


def compressed_attention(pool: KVPool, meta: AttentionMetadata, layer: int, q: torch.Tensor, kv: torch.Tensor,
                         branch) -> torch.Tensor:
    """One layer's DeepSeek-V4 attention for the whole step (module docstring): ``q [T, H, D]``, ``kv [T, D]`` the
    new window rows, ``branch`` a :class:`~ferrylm.models.compressed_attention.CompressedBranch` -> ``[T, H, D]``."""
    store_rows(kv.contiguous(), pool.k[layer], meta.slot_mapping, pool.k_scale[layer] if pool.scaled else None)
    comp, picks = branch.compressor, None
    if comp is not None:
        pool_entries(pool, layer, "compressor", comp, branch.kv, branch.score, meta)
    if branch.indexer is not None:
        ix = branch.indexer
        pool_entries(pool, layer, "indexer", ix.compressor, ix.kv, ix.score, meta)
        picks = index_topk(pool.blocks[(layer, "indexer")], ix, meta, pool.page_size)
    return attend(q.contiguous(), pool, layer, meta, branch, picks)
