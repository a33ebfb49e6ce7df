"""The sequential part of the gated delta rule's chunk form as one Triton kernel (CUDA; Triton's CPU interpreter in
tests): the scan over chunks that :func:`ferrylm.models.kernels.gated_delta.scan_chunks` runs as three batched
torch kernels a chunk. The formulas and their sources are in ``gated_delta.py``'s module docstring; its torch loop
is the reference.

One program per (value head, block of ``BV`` value columns) walks every chunk in order with its ``[Dk, BV]`` slice
of the state on chip: ``U = W_v - W_k S``, ``O = Q_G S + (Q K^T * D) U``, ``S <- G_C S + K_G^T U``. The state's
value columns are independent of each other in all three, so the blocks never exchange data. Products are exact
float32 (``input_precision=PREC``), as torch's float32 matmuls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scan_kernel(w_ptr, k_ptr, q_ptr, attn_ptr, decay_ptr, s_ptr, o_ptr, N, H, C: tl.constexpr, DK: tl.constexpr,
                 DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr = "tf32x3"):
    """The state's key rows in two halves of ``BK`` (``DK <= 2 BK``): smaller products keep it in registers."""
    h = tl.program_id(0)
    r1 = tl.arange(0, BK)
    r2 = BK + r1
    m1, m2 = r1 < DK, r2 < DK
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    rc = tl.arange(0, C)
    mv = rv < DV
    s1_at = s_ptr + h * DK * DV + r1[:, None] * DV + rv[None, :]
    s2_at = s_ptr + h * DK * DV + r2[:, None] * DV + rv[None, :]
    s1 = tl.load(s1_at, mask=m1[:, None] & mv[None, :], other=0.0)
    s2 = tl.load(s2_at, mask=m2[:, None] & mv[None, :], other=0.0)
    width = DV + DK
    for c in range(N):
        chunk = (c * H + h).to(tl.int64)
        w_row = w_ptr + chunk * C * width + rc[:, None] * width + DV
        u = tl.load(w_ptr + chunk * C * width + rc[:, None] * width + rv[None, :], mask=mv[None, :], other=0.0)
        u -= tl.dot(tl.load(w_row + r1[None, :], mask=m1[None, :], other=0.0), s1, input_precision=PREC)
        u -= tl.dot(tl.load(w_row + r2[None, :], mask=m2[None, :], other=0.0), s2, input_precision=PREC)
        q_row = q_ptr + chunk * C * DK + rc[:, None] * DK
        o = tl.dot(tl.load(attn_ptr + chunk * C * C + rc[:, None] * C + rc[None, :]), u, input_precision=PREC)
        o += tl.dot(tl.load(q_row + r1[None, :], mask=m1[None, :], other=0.0), s1, input_precision=PREC)
        o += tl.dot(tl.load(q_row + r2[None, :], mask=m2[None, :], other=0.0), s2, input_precision=PREC)
        tl.store(o_ptr + chunk * C * DV + rc[:, None] * DV + rv[None, :], o, mask=mv[None, :])
        k_col = k_ptr + chunk * C * DK + rc[None, :] * DK
        decay = tl.load(decay_ptr + chunk)
        s1 = s1 * decay + tl.dot(tl.load(k_col + r1[:, None], mask=m1[:, None], other=0.0), u, input_precision=PREC)
        s2 = s2 * decay + tl.dot(tl.load(k_col + r2[:, None], mask=m2[:, None], other=0.0), u, input_precision=PREC)
    tl.store(s1_at, s1, mask=m1[:, None] & mv[None, :])
    tl.store(s2_at, s2, mask=m2[:, None] & mv[None, :])


def scan_chunks_fused(w: torch.Tensor, k_to_end: torch.Tensor, q_decayed: torch.Tensor, attn: torch.Tensor,
                      end_decay: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over ``n`` chunks of ``C`` tokens (module docstring), every operand float32 and contiguous in
    chunk-major layout.

    Args:
        w: ``[n, H, C, Dv + Dk]`` :func:`~ferrylm.models.kernels.gated_delta.chunk_solve`'s output (read only).
        k_to_end: ``[n, H, C, Dk]`` keys decayed to their chunk's end (``K * G_C / G``).
        q_decayed: ``[n, H, C, Dk]`` queries decayed from their chunk's start (``Q * G``).
        attn: ``[n, H, C, C]`` the masked, decayed ``Q K^T`` of each chunk.
        end_decay: ``[n, H]`` each chunk's total decay ``G_C``.
        state: ``[H, Dk, Dv]`` the state before the first chunk (not modified).

    Returns:
        ``(o [n, H, C, Dv], final state [H, Dk, Dv])`` float32.

    Raises:
        ValueError: an operand not contiguous float32, or ``C`` not a power of two >= 16 (a ``tl.dot`` side).
    """
    n, h, c, width = w.shape
    dk = k_to_end.shape[-1]
    dv = width - dk
    if any(not t.is_contiguous() or t.dtype != torch.float32 for t in (w, k_to_end, q_decayed, attn, end_decay)):
        raise ValueError("scan_chunks_fused takes contiguous float32 operands")
    if c < 16 or c & (c - 1):
        raise ValueError(f"scan_chunks_fused: the chunk must be a power of two >= 16, got {c}")
    out = torch.empty(n, h, c, dv, dtype=torch.float32, device=w.device)
    final = state.float().clone(memory_format=torch.contiguous_format)
    bk = max(16, triton.next_power_of_2(dk) // 2)
    bv = min(32, max(16, triton.next_power_of_2(dv)))
    _scan_kernel[(h, triton.cdiv(dv, bv))](w, k_to_end, q_decayed, attn, end_decay, final, out, n, h, C=c,
                                          DK=dk, DV=dv, BK=bk, BV=bv, num_warps=4, num_stages=1)
    return out, final
