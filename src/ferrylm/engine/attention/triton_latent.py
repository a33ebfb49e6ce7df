"""Triton kernels for the latent KV pool of multi-head latent attention (``models/latent_attention.py``):

* :func:`store_rows`: each new token's row ``[c_kv ; k_pe]`` into its slot, skipping padding rows (slot ``-1``) of a
  captured batch, which a torch ``index_copy_`` cannot do without a host decision;
* :func:`latent_decode_attention`: absorbed decode attention read in place through the block table. One program
  per (sequence, block of ``BLOCK_H`` query heads): the heads' absorbed queries ``[BLOCK_H, R]`` and rope queries
  ``[BLOCK_H, P]`` stay in registers while the sequence's latent rows stream by in tiles of ``BLOCK_N`` tokens
  (score ``q_abs . c + q_pe . k_pe``, online softmax as FlashAttention, Dao et al. 2022, Alg. 1), accumulating
  ``sum_j p_j c_j`` ``[BLOCK_H, R]``; every latent tile is read once per head block (MQA-style: the latent is the one
  KV head of all query heads). Reads only each sequence's own ``seq_len`` rows; grid from host sizes only
  (capturable). Split-KV (flash-decoding) with ``num_splits > 1``: each sequence's rows cut into ``num_splits``
  ranges computed by separate programs (grid ``(B, head blocks, splits)``), whose unnormalised outputs, running
  maxima and sums are merged by a second kernel (``m = max m_i``, ``l = sum l_i e^{m_i - m}``,
  ``o = sum o_i e^{m_i - m} / l``), so one long sequence fills the GPU instead of ``H / BLOCK_H`` programs.

An fp8 pool keeps one float32 scale per row (``engine/cache/kv_pool.py``): :func:`store_rows` quantizes through
``triton_paged.store_quantized`` and the decode kernel scales each row's scores and probabilities (as
``triton_paged``).

Imported only where Triton and CUDA are (or under ``TRITON_INTERPRET=1`` in tests), as ``triton_paged``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrylm.engine.attention.triton_paged import block_row, copy_row, e4m3_to_float, store_quantized
from ferrylm.triton_util import dot_precision


@triton.jit
def _store_rows_kernel(src_ptr, dst_ptr, slot_ptr, n_cols, stride_src, stride_dst, BLOCK: tl.constexpr):
    """Row ``t`` of ``src`` (``n_cols`` contiguous values) to row ``slot[t]`` of ``dst``; a negative slot writes
    nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        copy_row(src_ptr, dst_ptr, t, slot, n_cols, stride_src, stride_dst, BLOCK)


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
               scale: torch.Tensor | None = None) -> None:
    """Write ``rows [T, C]`` (each row contiguous) into ``cache [num_slots, 1, C]`` (contiguous, any float dtype:
    values are cast) at ``slot_mapping [T]`` (int64; ``-1`` = skip), one program per row; with ``scale``
    ``[num_slots, 1]`` float32 (an fp8 pool) each row is quantized with its own scale."""
    t = rows.shape[0]
    if t == 0:
        return
    if scale is not None:
        store_quantized(rows[:, None, :], cache, scale, slot_mapping)
        return
    n_cols = rows.shape[1]
    block = min(1024, triton.next_power_of_2(n_cols))
    _store_rows_kernel[(t,)](rows, cache, slot_mapping, n_cols, rows.stride(0), cache.stride(0), BLOCK=block)


@triton.jit
def _latent_decode_kernel(qa_ptr, qp_ptr, cache_ptr, bt_ptr, lens_ptr, out_ptr, scale, num_heads, page_size,
                          stride_qa_b, stride_qa_h, stride_qp_b, stride_qp_h, stride_cache, stride_bt,
                          stride_o_b, stride_o_h, part_o_ptr, part_ml_ptr, scale_ptr, stride_scale,
                          R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          PRECISION: tl.constexpr, SCALED: tl.constexpr):
    b = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = heads < num_heads
    r = tl.arange(0, R_PAD)
    rm = r < R
    p = tl.arange(0, P_PAD)
    pm = p < P
    qa = tl.load(qa_ptr + b * stride_qa_b + heads[:, None] * stride_qa_h + r[None, :],
                 mask=hm[:, None] & rm[None, :], other=0.0)
    qp = tl.load(qp_ptr + b * stride_qp_b + heads[:, None] * stride_qp_h + p[None, :],
                 mask=hm[:, None] & pm[None, :], other=0.0)
    seq_len = tl.load(lens_ptr + b)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    if NUM_SPLITS == 1:
        lo = 0
        hi = seq_len
    else:
        per = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per
        hi = tl.minimum(seq_len, lo + per)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nm = n < hi
        slot = block_row(bt_ptr + b * stride_bt, tl.where(nm, n, 0), page_size, 1)
        row = slot * stride_cache
        c = tl.load(cache_ptr + row[:, None] + r[None, :], mask=nm[:, None] & rm[None, :], other=0)
        kp = tl.load(cache_ptr + row[:, None] + R + p[None, :], mask=nm[:, None] & pm[None, :], other=0)
        if SCALED:   # float8 bytes (``triton_paged``)
            c = e4m3_to_float(c)
            kp = e4m3_to_float(kp)
        s = tl.dot(qa, tl.trans(c.to(qa.dtype)), input_precision=PRECISION)
        s += tl.dot(qp, tl.trans(kp.to(qp.dtype)), input_precision=PRECISION)
        if SCALED:
            rs = tl.load(scale_ptr + slot * stride_scale, mask=nm, other=0.0)
            s = s * rs[None, :]
        s = tl.where(nm[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        e = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(e, 1)
        if SCALED:
            e = e * rs[None, :]
        acc = acc * alpha[:, None] + tl.dot(e.to(qa.dtype), c.to(qa.dtype), input_precision=PRECISION)
        m_i = m_new
    if NUM_SPLITS == 1:
        l_i = tl.where(l_i > 0, l_i, 1.0)  # a padding sequence (seq_len 0) reads nothing: output 0
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_o_b + heads[:, None] * stride_o_h + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hm[:, None] & rm[None, :])
    else:
        # partials [B, H, NUM_SPLITS, R] (unnormalised o) and [B, H, NUM_SPLITS, 2] (m, l), fp32; an empty range
        # leaves m = -inf, l = 0, o = 0
        base = ((b * num_heads + heads) * NUM_SPLITS + split).to(tl.int64)
        tl.store(part_o_ptr + base[:, None] * R + r[None, :], acc, mask=hm[:, None] & rm[None, :])
        tl.store(part_ml_ptr + base * 2, m_i, mask=hm)
        tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=hm)


@triton.jit
def _merge_latent_splits_kernel(part_o_ptr, part_ml_ptr, out_ptr, num_heads, stride_o_b, stride_o_h,
                                R: tl.constexpr, R_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """One (sequence, head): merge its ``NUM_SPLITS`` partial outputs (module docstring)."""
    row = tl.program_id(0)          # sequence * num_heads + head
    b = row // num_heads
    h = row % num_heads
    sp = tl.arange(0, NUM_SPLITS)
    base = (row * NUM_SPLITS + sp).to(tl.int64)
    m = tl.load(part_ml_ptr + base * 2)
    l = tl.load(part_ml_ptr + base * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    l_sum = tl.sum(l * w, 0)
    r = tl.arange(0, R_PAD)
    o = tl.load(part_o_ptr + base[:, None] * R + r[None, :], mask=r[None, :] < R, other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h + r, o.to(out_ptr.dtype.element_ty), mask=r < R)


def latent_decode_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, page_size: int,
                            num_splits: int = 1, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA decode over the latent pool (module docstring).

    Args:
        q_abs: ``[B, H, R]`` absorbed queries (``LatentProjection.absorb_query``); q_pe: ``[B, H, P]`` rotated.
        cache: the layer's pool ``[num_slots, 1, R + P]`` (contiguous rows).
        block_table: ``[B, pages]`` integer pages of each sequence; seq_lens: ``[B]`` tokens of each (new one
            included; 0 = a padding sequence, whose output is zeros).
        scale: softmax scale; page_size: tokens per page.
        num_splits: KV ranges per sequence computed apart, then merged (split-KV; 1 = none); a power of two
            (``engine.attention.decode_splits``). Its fp32 partials take ``B * H * num_splits * (R + 2) * 4`` bytes.
        row_scale: ``[num_slots, 1]`` float32 scales of an fp8 pool, else None.

    Returns:
        ``[B, H, R]`` in ``q_abs``'s dtype: the attention-weighted latents (apply ``LatentProjection.value_out``).

    Raises:
        ValueError: ``num_splits`` not a power of two.
    """
    b, h, r = q_abs.shape
    p = q_pe.shape[-1]
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    q_abs, q_pe = q_abs.contiguous(), q_pe.contiguous()
    out = torch.empty_like(q_abs)
    if b == 0:
        return out
    block_h = 16
    r_pad = triton.next_power_of_2(max(16, r))
    grid = (b, triton.cdiv(h, block_h), num_splits)
    part_o = part_ml = out
    if num_splits > 1:
        part_o = torch.empty(b, h, num_splits, r, dtype=torch.float32, device=q_abs.device)
        part_ml = torch.empty(b, h, num_splits, 2, dtype=torch.float32, device=q_abs.device)
    if row_scale is not None:   # float8 as bytes
        cache = cache.view(torch.uint8)
    _latent_decode_kernel[grid](q_abs, q_pe, cache, block_table, seq_lens, out, float(scale), h, page_size,
                                q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0),
                                block_table.stride(0), out.stride(0), out.stride(1), part_o, part_ml,
                                out if row_scale is None else row_scale,
                                0 if row_scale is None else row_scale.stride(0), R=r, P=p,
                                R_PAD=r_pad, P_PAD=triton.next_power_of_2(max(16, p)),
                                BLOCK_H=block_h, BLOCK_N=32, NUM_SPLITS=num_splits,
                                PRECISION=dot_precision(q_abs.dtype), SCALED=row_scale is not None,
                                num_warps=8 if r >= 256 else 4)
    if num_splits > 1:
        _merge_latent_splits_kernel[(b * h,)](part_o, part_ml, out, h, out.stride(0), out.stride(1), R=r,
                                              R_PAD=r_pad, NUM_SPLITS=num_splits)
    return out
