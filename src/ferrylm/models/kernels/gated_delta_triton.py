"""The sequential scan of the gated delta rule's chunk form as one Triton kernel (CUDA; Triton's CPU interpreter in
tests).

Same math as :func:`ferrylm.models.kernels.gated_delta.scan_chunks` (formulas and sources in that module's
docstring): the chunk-local triangular solve ``W`` is done before, for all chunks at once
(:func:`~ferrylm.models.kernels.gated_delta.chunk_solve`), so what is left per chunk is five small products. One
program per (head, block of ``BV`` value columns): the state slice ``S[:, cols]`` ``[Dk, BV]`` stays on chip while
the program walks the chunks; per chunk ``U = W_v - W_k S``, ``O = diag(G) Q S + ((Q K^T) * D) U`` and
``S <- G_C S + (K * (G_C / G))^T U`` with ``tl.dot`` in float32 (``input_precision="ieee"``: no TF32 rounding).

Shapes (one sequence, heads already expanded): ``q, k [T, H, Dk]``, ``g [T, H]`` float32, ``w [H, n, C, Dv + Dk]``;
``Dk`` and ``Dv`` are padded to powers of two >= 16 inside the kernel (masked loads and stores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built for these shapes on this device (Triton's compile or resource limits); not an
    allocation failure, which propagates as itself."""


@triton.jit
def _scan_kernel(q_ptr, k_ptr, g_ptr, w_ptr, s0_ptr, o_ptr, s_ptr, T, H, N,
                 DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk = rk < DK
    mv = rv < DV
    s_off = h * DK * DV + rk[:, None] * DV + rv[None, :]
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(s0_ptr + s_off, mask=s_mask, other=0.0)
    lower = rc[:, None] >= rc[None, :]
    w_row = DV + DK
    for c in range(0, N):
        rows = c * C + rc
        mr = rows < T
        qk_off = rows[:, None] * (H * DK) + h * DK + rk[None, :]
        qk_mask = mr[:, None] & mk[None, :]
        Q = tl.load(q_ptr + qk_off, mask=qk_mask, other=0.0)
        K = tl.load(k_ptr + qk_off, mask=qk_mask, other=0.0)
        G = tl.load(g_ptr + rows * H + h, mask=mr, other=0.0)        # padded rows: no decay
        w_base = w_ptr + (h * N + c) * C * w_row + rc[:, None] * w_row
        Wv = tl.load(w_base + rv[None, :], mask=mv[None, :], other=0.0)
        Wk = tl.load(w_base + DV + rk[None, :], mask=mk[None, :], other=0.0)
        gamma = tl.cumsum(G, 0)                                      # log G_t from the chunk start
        D = tl.where(lower, tl.exp(tl.where(lower, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
        U = Wv - tl.dot(Wk, S, input_precision="ieee")
        QK = tl.dot(Q, tl.trans(K), input_precision="ieee") * D
        O = tl.dot(Q * tl.exp(gamma)[:, None], S, input_precision="ieee") + tl.dot(QK, U, input_precision="ieee")
        tl.store(o_ptr + rows[:, None] * (H * DV) + h * DV + rv[None, :], O, mask=mr[:, None] & mv[None, :])
        g_last = tl.sum(tl.where(rc == C - 1, gamma, 0.0), 0)        # padded rows add 0: the last real token's
        K_end = K * tl.exp(g_last - gamma)[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(K_end), U, input_precision="ieee")
    tl.store(s_ptr + s_off, S, mask=s_mask)


NUM_STAGES = 1   # the chunk loop's loads are not pipelined: at Dk = 128 three stages need 265 KiB of shared memory


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def scan_chunks_triton(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, w: torch.Tensor, state: torch.Tensor,
                       chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ferrylm.models.kernels.gated_delta.scan_chunks` as one launch of ``H * ceil(Dv / BV)`` programs (same
    arguments and results); no host synchronisation.

    Raises:
        KernelUnavailable: Triton cannot compile the kernel for these shapes here (the caller takes the torch scan).
    """
    t, h, dk = k.shape
    n, dv = w.shape[1], w.shape[-1] - dk
    q, k, g, w = (x.float().contiguous() for x in (q, k, g, w))
    s0 = state.float().contiguous()
    out = torch.empty(t, h, dv, dtype=torch.float32, device=w.device)
    final = torch.empty(h, dk, dv, dtype=torch.float32, device=w.device)
    bv = min(32, _block(dv))
    bk = _block(dk)
    try:
        _scan_kernel[(h, triton.cdiv(dv, bv))](q, k, g, w, s0, out, final, t, h, n, DK=dk, DV=dv, BK=bk, BV=bv,
                                               C=chunk, num_warps=8 if bk >= 128 else 4,
                                               num_stages=NUM_STAGES)
    except (triton.CompilationError, triton.runtime.errors.OutOfResources) as e:
        raise KernelUnavailable(f"{type(e).__name__}: {e}") from e
    return out, final
