"""Triton kernels for the latent KV pool of multi-head latent attention (``models/latent_attention.py``):

* :func:`store_rows`: each new token's row ``[c_kv ; k_pe]`` into its slot, skipping padding rows (slot ``-1``) of a
  captured batch, which a torch ``index_copy_`` cannot do without a host decision;
* :func:`latent_decode_attention`: absorbed decode attention read in place through the block table. One program
  per (sequence, block of ``BLOCK_H`` query heads): the heads' absorbed queries ``[BLOCK_H, R]`` and rope queries
  ``[BLOCK_H, P]`` stay in registers while the sequence's latent rows stream by in tiles of ``BLOCK_N`` tokens
  (score ``q_abs . c + q_pe . k_pe``, online softmax as FlashAttention, Dao et al. 2022, Alg. 1), accumulating
  ``sum_j p_j c_j`` ``[BLOCK_H, R]``; every latent tile is read once per head block (MQA-style: the latent is the one
  KV head of all query heads). Reads only each sequence's own ``seq_len`` rows; grid from host sizes only
  (capturable). Not tuned (no split-KV yet).

Imported only where Triton and CUDA are (or under ``TRITON_INTERPRET=1`` in tests), as ``triton_paged``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrylm.triton_util import dot_precision


@triton.jit
def _store_rows_kernel(src_ptr, dst_ptr, slot_ptr, n_cols, stride_src, stride_dst, BLOCK: tl.constexpr):
    """Row ``t`` of ``src`` (``n_cols`` contiguous values) to row ``slot[t]`` of ``dst``; a negative slot writes
    nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    for c0 in range(0, n_cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < n_cols
        x = tl.load(src_ptr + t * stride_src + c, mask=m)
        tl.store(dst_ptr + slot * stride_dst + c, x.to(dst_ptr.dtype.element_ty), mask=m)


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``rows [T, C]`` (each row contiguous) into ``cache [num_slots, 1, C]`` (contiguous, any float dtype:
    values are cast) at ``slot_mapping [T]`` (int64; ``-1`` = skip), one program per row."""
    t = rows.shape[0]
    if t == 0:
        return
    n_cols = rows.shape[1]
    block = min(1024, triton.next_power_of_2(n_cols))
    _store_rows_kernel[(t,)](rows, cache, slot_mapping, n_cols, rows.stride(0), cache.stride(0), BLOCK=block)


@triton.jit
def _latent_decode_kernel(qa_ptr, qp_ptr, cache_ptr, bt_ptr, lens_ptr, out_ptr, scale, num_heads, page_size,
                          stride_qa_b, stride_qa_h, stride_qp_b, stride_qp_h, stride_cache, stride_bt,
                          stride_o_b, stride_o_h,
                          R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
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
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nm = n < seq_len
        page = tl.load(bt_ptr + b * stride_bt + n // page_size, mask=nm, other=0).to(tl.int64)
        row = (page * page_size + n % page_size) * stride_cache
        c = tl.load(cache_ptr + row[:, None] + r[None, :], mask=nm[:, None] & rm[None, :], other=0.0)
        kp = tl.load(cache_ptr + row[:, None] + R + p[None, :], mask=nm[:, None] & pm[None, :], other=0.0)
        s = tl.dot(qa, tl.trans(c.to(qa.dtype)), input_precision=PRECISION)
        s += tl.dot(qp, tl.trans(kp.to(qp.dtype)), input_precision=PRECISION)
        s = tl.where(nm[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        e = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(e, 1)
        acc = acc * alpha[:, None] + tl.dot(e.to(qa.dtype), c.to(qa.dtype), input_precision=PRECISION)
        m_i = m_new
    l_i = tl.where(l_i > 0, l_i, 1.0)  # a padding sequence (seq_len 0) reads nothing: output 0
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_o_b + heads[:, None] * stride_o_h + r[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & rm[None, :])


def latent_decode_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, page_size: int) -> torch.Tensor:
    """Absorbed MLA decode over the latent pool (module docstring).

    Args:
        q_abs: ``[B, H, R]`` absorbed queries (``LatentProjection.absorb_query``); q_pe: ``[B, H, P]`` rotated.
        cache: the layer's pool ``[num_slots, 1, R + P]`` (contiguous rows).
        block_table: ``[B, pages]`` int32 pages of each sequence; seq_lens: ``[B]`` tokens of each (new one
            included; 0 = a padding sequence, whose output is zeros).
        scale: softmax scale; page_size: tokens per page.

    Returns:
        ``[B, H, R]`` in ``q_abs``'s dtype: the attention-weighted latents (apply ``LatentProjection.value_out``).
    """
    b, h, r = q_abs.shape
    p = q_pe.shape[-1]
    q_abs, q_pe = q_abs.contiguous(), q_pe.contiguous()
    out = torch.empty_like(q_abs)
    if b == 0:
        return out
    block_h = 16
    grid = (b, triton.cdiv(h, block_h))
    _latent_decode_kernel[grid](q_abs, q_pe, cache, block_table, seq_lens, out, float(scale), h, page_size,
                                q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0),
                                block_table.stride(0), out.stride(0), out.stride(1), R=r, P=p,
                                R_PAD=triton.next_power_of_2(max(16, r)), P_PAD=triton.next_power_of_2(max(16, p)),
                                BLOCK_H=block_h, BLOCK_N=32, PRECISION=dot_precision(q_abs.dtype),
                                num_warps=8 if r >= 256 else 4)
    return out
