"""Triton kernels that read the paged KV pool in place: the K/V store and one attention kernel for prefill chunks
over a cached prefix, ragged batches and decode steps with mixed lengths (a flattened batch of any mix).

Layout (``engine/cache/kv_pool.py``): a layer's K and V are ``[num_slots, Hkv, D]`` with ``slot = page * page_size +
offset``; a sequence's pages are a row of the ``[B, max_pages]`` int32 block table.

Attention (the online-softmax tiling of Dao et al. 2022, "FlashAttention", Alg. 1, over KV tiles gathered
through the block table as in Kwon et al. 2023, "PagedAttention"): one program computes a tile of ``BLOCK_Q``
query tokens x the ``G = Hq / Hkv`` query heads of ONE KV head (GQA without expanding K/V: the ``G`` heads are
rows of the same tile), so each K/V tile is read once per query tile. Causal alignment is bottom-right: the new
tokens of a sequence are its last ``q_len`` positions, query ``i`` sees keys ``0 .. ctx_len + i`` with ``ctx_len =
seq_len - q_len``. Scores never leave registers: memory is linear in tokens.

Programs of sequence ``s`` are ``[qs[s] // BLOCK_Q + s, qs[s + 1] // BLOCK_Q + s + 1)`` with ``qs`` the query
start offsets: the count covers ``ceil(q_len / BLOCK_Q)`` and the grid ``T // BLOCK_Q + B`` bounds the total, so
the grid depends on host sizes only (capturable in a CUDA graph); a program finds its sequence by binary search.

Sliding window and attention sinks (gpt-oss): with a window, query ``p`` sees keys ``p - window < j <= p`` only and
a tile starts at its first query's window (keys before it are never read); a sink adds ``exp(sink)`` (one logit per
query head, no value) to each row's softmax denominator, after the last tile (or in the split merge).

Split-KV (flash-decoding): with ``num_splits > 1`` the keys of each sequence are cut into ``num_splits`` ranges
computed by separate programs; each writes its unnormalised output, running max and sum, and a second kernel
merges them (``m = max m_i``, ``l = sum l_i e^{m_i - m}``, ``o = sum o_i e^{m_i - m} / l``). Decode steps use it so
a batch of one still fills the GPU.

An fp8 pool (``engine/cache/kv_pool.py``) stores float8 e4m3 values and one float32 scale per (token, KV head):
:func:`store_quantized` writes both; the attention kernel multiplies each key's scores by its key scale and each
probability by its value scale (``q . (k s_k) = (q . k) s_k``, ``sum p_j (v_j s_v,j) = sum (p_j s_v,j) v_j``), so
the float8 tiles are only converted (exactly) to the query dtype. The kernels see the float8 tensors as bytes and
convert by bit arithmetic (:func:`e4m3_to_float`, :func:`float_to_e4m3`), so fp8 needs no hardware float8 type: any
GPU Triton runs on, and the CPU interpreter.

Imported only where Triton and CUDA are (or under ``TRITON_INTERPRET=1`` in tests): see ``engine/attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrylm.triton_util import dot_precision

MAX_SEQS_LOG2 = 16  # binary-search rounds: batches of up to 65536 sequences (one compiled variant)


@triton.jit
def copy_row(src_ptr, dst_ptr, t, slot, n_cols, stride_src, stride_dst, BLOCK: tl.constexpr):
    """Row ``t`` of ``src`` (``n_cols`` contiguous values) to row ``slot`` of ``dst``, cast to ``dst``'s dtype, in
    tiles of ``BLOCK`` values."""
    for c0 in range(0, n_cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < n_cols
        x = tl.load(src_ptr + t * stride_src + c, mask=m)
        tl.store(dst_ptr + slot * stride_dst + c, x.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_cols,
                     stride_k, stride_v, stride_kc, stride_vc, BLOCK: tl.constexpr):
    """Row ``t`` of ``k``/``v`` (``n_cols = Hkv * D`` contiguous values) to cache slot ``slot[t]``; a negative slot
    (a padding row of a captured batch) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        copy_row(k_ptr, kc_ptr, t, slot, n_cols, stride_k, stride_kc, BLOCK)
        copy_row(v_ptr, vc_ptr, t, slot, n_cols, stride_v, stride_vc, BLOCK)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write the step's new keys/values into their cache slots, in one kernel (two for an fp8 pool).

    Args:
        k, v: ``[T, Hkv, D]`` (each row's ``Hkv * D`` values contiguous).
        k_cache, v_cache: ``[num_slots, Hkv, D]`` contiguous (any float dtype; values are cast).
        slot_mapping: ``[T]`` int64 cache slot of each row; ``-1`` = skip (padding).
        k_scale, v_scale: ``[num_slots, Hkv]`` float32 of an fp8 pool (then values are quantized,
            :func:`store_quantized`), else None.
    """
    t = k.shape[0]
    if t == 0:
        return
    if k_scale is not None:
        store_quantized(k, k_cache, k_scale, slot_mapping)
        store_quantized(v, v_cache, v_scale, slot_mapping)
        return
    n_cols = k.shape[1] * k.shape[2]
    block = min(1024, triton.next_power_of_2(n_cols))
    _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, n_cols, k.stride(0), v.stride(0),
                           k_cache.stride(0), v_cache.stride(0), BLOCK=block)


@triton.jit
def e4m3_to_float(bits):
    """float8 e4m3fn bytes (an integer tensor, 0..255) -> float32: ``(1 + m/8) 2^(e - 7)``, subnormals ``m 2^-9``."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def float_to_e4m3(y):
    """float32 values on the e4m3 grid with ``|y| <= 448`` -> float8 e4m3fn bytes (uint8)."""
    a = tl.abs(y)
    b = a.to(tl.int32, bitcast=True)
    normal = (((b >> 23) - 120) << 3) | ((b >> 20) & 7)
    mag = tl.where(a >= 0.015625, normal, (a * 512.0).to(tl.int32))
    return (mag | tl.where(y < 0, 128, 0)).to(tl.uint8)


@triton.jit
def _store_quantized_kernel(x_ptr, cache_ptr, scale_ptr, slot_ptr, stride_xt, stride_xh, stride_cs, stride_ch,
                            stride_ss, D: tl.constexpr, D_PAD: tl.constexpr, FP8_MAX: tl.constexpr):
    """Head ``h`` of row ``t``: ``scale = max(amax |x| / FP8_MAX, tiny)``, ``x / scale`` as float8 to slot
    ``slot[t]`` (``cache_ptr``: the float8 cache as bytes); a negative slot writes nothing. ``x / scale`` is rounded
    to the e4m3 grid in float32 (nearest, ties away from zero; the step of a value with exponent ``e`` is
    ``2^(e - 3)``, subnormals share ``2^-9``), then encoded exactly."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, D_PAD)
    m = d < D
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh + d, mask=m, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / FP8_MAX, 1e-12)
    y = x / scale
    binade = (tl.maximum(tl.abs(y), 0.015625).to(tl.int32, bitcast=True) >> 23) & 0xFF    # biased exponent, >= -6
    step = ((binade - 3) << 23).to(tl.float32, bitcast=True)                             # 2^(e - 3)
    q = tl.minimum(tl.maximum(tl.floor(tl.abs(y) / step + 0.5) * step, 0.0), FP8_MAX)
    q = tl.where(y < 0, -q, q)
    tl.store(cache_ptr + slot * stride_cs + h * stride_ch + d, float_to_e4m3(q), mask=m)
    tl.store(scale_ptr + slot * stride_ss + h, scale)


def store_quantized(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``x [T, H, D]`` (last dim contiguous) per (row, head) into the float8 ``cache [num_slots, H, D]`` and
    its float32 ``scale [num_slots, H]`` at ``slot_mapping [T]`` (``-1`` = skip); one program per (row, head)."""
    t, h, d = x.shape
    if t == 0:
        return
    _store_quantized_kernel[(t, h)](x, cache.view(torch.uint8), scale, slot_mapping, x.stride(0), x.stride(1),
                                    cache.stride(0),
                                    cache.stride(1), scale.stride(0), D=d, D_PAD=triton.next_power_of_2(d),
                                    FP8_MAX=448.0)


@triton.jit
def find_seq(pid, qsl_ptr, num_seqs, BLOCK_Q: tl.constexpr, PER_SEQ: tl.constexpr, LOG2_SEQS: tl.constexpr):
    """The last sequence ``s`` whose first program ``qsl[s] // BLOCK_Q + PER_SEQ * s`` is ``<= pid`` (binary search
    over the strictly increasing first programs; ``LOG2_SEQS >= log2(num_seqs)`` rounds). A sequence of ``n`` new
    tokens owns ``n // BLOCK_Q + PER_SEQ`` programs at least."""
    lo = 0
    hi = num_seqs
    for _ in range(LOG2_SEQS):
        mid = (lo + hi) // 2
        ok = tl.load(qsl_ptr + mid) // BLOCK_Q + PER_SEQ * mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def query_tile(pid, qsl_ptr, num_seqs, BLOCK_Q: tl.constexpr, LOG2_SEQS: tl.constexpr):
    """The query tile program ``pid`` of an attention grid computes (module docstring): its sequence ``s``, the
    sequence's first query row ``q_start`` and count of new tokens ``q_len``, and the tile ``qb`` among them
    (``qb * BLOCK_Q >= q_len``: a spare program, nothing to compute)."""
    s = find_seq(pid, qsl_ptr, num_seqs, BLOCK_Q, 1, LOG2_SEQS)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    return s, q_start, q_len, pid - (q_start // BLOCK_Q + s)


@triton.jit
def block_row(bt_row, block, page_size, RATE: tl.constexpr):
    """The pool row of block ``block`` (an int tensor, each value ``>= 0`` and inside the sequence's pages) of
    ``RATE`` tokens of the sequence whose block-table row starts at ``bt_row``: for ``RATE`` 1 a token's KV slot
    ``page * page_size + offset``, else a per-block cache's row (``page_size // RATE`` rows a page,
    ``compressed_pages.py``)."""
    per_page = page_size // RATE
    page = tl.load(bt_row + (block * RATE) // page_size).to(tl.int64)
    return page * per_page + block % per_page


@triton.jit
def online_softmax(qk, m_i, l_i):
    """One tile of scores ``qk [M, N]`` (base 2, ``-inf`` where hidden) into each row's running max ``m_i`` and sum
    ``l_i``: the tile's probabilities ``p`` (relative to the new max), the factor ``alpha`` that rescales what came
    before, the new max and the new sum. A row that has seen nothing keeps max ``-inf`` and sum 0."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr,
        part_o_ptr, part_ml_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
        scale, num_seqs, num_kv_heads, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
        stride_bt, page_size, stride_ks, stride_vs,
        G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, LOG2_SEQS: tl.constexpr,
        PRECISION: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr, SCALED: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    s, q_start, q_len, qb = query_tile(pid, qsl_ptr, num_seqs, BLOCK_Q, LOG2_SEQS)
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx_len = seq_len - q_len                      # cached tokens before the new ones

    rows = tl.arange(0, BLOCK_M)
    q_tok = qb * BLOCK_Q + rows // G_PAD           # token within the sequence's new tokens
    head = rows % G_PAD
    row_ok = (q_tok < q_len) & (head < G)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_head = kvh * G + head
    q_rows = (q_start + q_tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx_len + q_tok                        # absolute position of each query row

    # keys this tile may see: 0 (or, with a window, the first query's window start) .. last query's position
    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum((qb + 1) * BLOCK_Q, q_len))
    kv_start = 0
    if WINDOW:
        kv_start = tl.maximum(0, ctx_len + qb * BLOCK_Q - window + 1)
        kv_start = (kv_start // BLOCK_N) * BLOCK_N
    if NUM_SPLITS == 1:
        lo = kv_start
        hi = kv_end
    else:
        per = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = kv_start + split * per
        hi = tl.minimum(kv_end, lo + per)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634          # softmax in base 2
    bt_row = block_table_ptr + s.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        slot = block_row(bt_row, tl.where(n_ok, n, 0), page_size, 1)
        k = tl.load(k_cache_ptr + slot[None, :] * stride_kc_slot + kvh * stride_kc_h + d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0)              # [D, N]
        if SCALED:
            k = e4m3_to_float(k)
        qk = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * qk_scale                              # [M, N] fp32
        if SCALED:
            ks = tl.load(k_scale_ptr + slot * stride_ks + kvh, mask=n_ok, other=0.0)
            qk = qk * ks[None, :]
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        p, alpha, m_new, l_i = online_softmax(tl.where(visible, qk, float("-inf")), m_i, l_i)
        v = tl.load(v_cache_ptr + slot[:, None] * stride_vc_slot + kvh * stride_vc_h + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0)              # [N, D]
        if SCALED:
            v = e4m3_to_float(v)
            vs = tl.load(v_scale_ptr + slot * stride_vs + kvh, mask=n_ok, other=0.0)
            p = p * vs[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        if SINKS:  # one more softmax entry per row, with no value (module docstring)
            sink = tl.load(sinks_ptr + q_head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_fin)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_fin)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + q_head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # partials [T, Hq, NUM_SPLITS, D] (o) and [T, Hq, NUM_SPLITS, 2] (m, l), fp32
        hq = num_kv_heads * G
        base = (q_rows * hq + q_head) * NUM_SPLITS + split
        tl.store(part_o_ptr + base[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + base * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_ml_ptr, out_ptr, sinks_ptr, num_heads, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SINKS: tl.constexpr):
    """One (token, head): merge its ``NUM_SPLITS`` partial outputs (module docstring)."""
    row = tl.program_id(0)          # token * num_heads + head
    t = row // num_heads
    h = row % num_heads
    sp = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + (row * NUM_SPLITS + sp) * 2)
    l = tl.load(part_ml_ptr + (row * NUM_SPLITS + sp) * 2 + 1)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    l_sum = tl.sum(l * w, 0)
    if SINKS:
        l_sum += tl.exp2(sink - m_max)
    d = tl.arange(0, D_PAD)
    o = tl.load(part_o_ptr + (row * NUM_SPLITS + sp)[:, None] * HEAD_DIM + d[None, :],
                mask=d[None, :] < HEAD_DIM, other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, scale: float, page_size: int,
                    max_query_len: int, num_splits: int = 1, out: torch.Tensor | None = None,
                    window: int | None = None, sinks: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of a flattened batch over the paged KV pool (module docstring), the step's new K/V
    already stored (:func:`store_kv`).

    Args:
        q: ``[T, Hq, D]`` queries (RoPE applied); rows of sequence ``s`` are ``query_start_loc[s] ..
            query_start_loc[s + 1] - 1``, its last ``q_len`` positions.
        k_cache, v_cache: ``[num_slots, Hkv, D]`` one layer's pool.
        block_table: ``[B, P]`` int32 pages of each sequence (entries past its length unused).
        seq_lens: ``[B]`` int32 tokens of each sequence after this step (cached + new); 0 for a padding sequence.
        query_start_loc: ``[B + 1]`` int32 cumulative query counts (``query_start_loc[B] == T``).
        scale: softmax scale. page_size: tokens per page.
        max_query_len: the most new tokens of any sequence (host int: picks the query tile).
        num_splits: KV ranges per sequence computed apart then merged (1 = none); a power of two.
        out: ``[T, Hq, D]`` to write into (e.g. a CUDA graph's static buffer), else allocated.
        window: sliding window (a query at position ``p`` sees keys ``p - window < j <= p``); None = all.
        sinks: ``[Hq]`` float32 attention-sink logits (added to each row's softmax denominator as ``exp(sink)``,
            no value), or None.
        k_scale, v_scale: ``[num_slots, Hkv]`` float32 scales of an fp8 pool (module docstring), else None.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype. A padding sequence (``seq_len`` 0) gets zeros.
    """
    t, hq, dim = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or num_seqs == 0:
        return out
    if num_seqs > 1 << MAX_SEQS_LOG2:
        raise ValueError(f"{num_seqs} sequences in one step; at most {1 << MAX_SEQS_LOG2}")
    g_pad = max(1, triton.next_power_of_2(g))
    # query tile: 16+ rows for tl.dot; decode (1 token) packs the G heads only
    block_q = max(1, 16 // g_pad) if max_query_len <= 1 else max(1, 64 // g_pad)
    block_n = 64 if max_query_len > 1 else 32
    d_pad = triton.next_power_of_2(dim)
    grid = (t // block_q + num_seqs, hkv, num_splits)
    if num_splits > 1:
        part_o = torch.empty(t, hq, num_splits, dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t, hq, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # unused
    sink_arg = out if sinks is None else sinks
    scaled = k_scale is not None
    ks, vs = (k_scale, v_scale) if scaled else (out, out)
    if scaled:   # float8 as bytes (module docstring)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, part_o, part_ml, sink_arg, ks, vs,
        scale, num_seqs, hkv, 0 if window is None else int(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_table.stride(0), page_size,
        ks.stride(0) if scaled else 0, vs.stride(0) if scaled else 0,
        G=g, G_PAD=g_pad, HEAD_DIM=dim, D_PAD=d_pad, BLOCK_Q=block_q, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        LOG2_SEQS=MAX_SEQS_LOG2, PRECISION=dot_precision(q.dtype), WINDOW=window is not None,
        SINKS=sinks is not None, SCALED=scaled, num_warps=4, num_stages=2)
    if num_splits > 1:
        _merge_splits_kernel[(t * hq,)](part_o, part_ml, out, sink_arg, hq, out.stride(0), out.stride(1),
                                        HEAD_DIM=dim, D_PAD=d_pad, NUM_SPLITS=num_splits, SINKS=sinks is not None)
    return out
