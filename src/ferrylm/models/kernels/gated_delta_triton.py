"""The chunk form of the gated delta rule as one Triton kernel (CUDA; Triton's CPU interpreter in tests).

Same math as :func:`ferrylm.models.kernels.gated_delta.gated_delta_chunked` (the formulas and their sources are in
that module's docstring). One program per (head, block of ``BV`` value columns): the state slice ``S[:, cols]``
``[Dk, BV]`` stays on chip while the program walks the sequence chunk by chunk; per chunk it builds the ``C x C``
matrices (``K K^T``, the decay ratios, ``A``), inverts the unit lower-triangular ``I + A`` by forward substitution
over its ``C`` rows (register tiles only), and applies ``(I + A)^-1`` to ``[beta V | beta G K]`` with ``tl.dot``.
Everything accumulates in float32 (``input_precision="ieee"``: no TF32 rounding). The triangular inverse depends only
on keys, decays and betas, so the programs of one head's value blocks compute it redundantly instead of exchanging
it (``Dk / BV`` times a ``C^2 (C + Dk)`` cost, small beside the chunk's ``C Dk Dv`` state products).

Shapes (one sequence, heads already expanded): ``q, k [T, H, Dk]``, ``v [T, H, Dv]``, ``g, beta [T, H]`` float32;
``Dk`` and ``Dv`` are padded to powers of two >= 16 inside the kernel (masked loads and stores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built for these shapes on this device (Triton's compile or resource limits); not an
    allocation failure, which propagates as itself."""


@triton.jit
def _chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s0_ptr, o_ptr, s_ptr, T, H,
                  DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                  HAS_S0: tl.constexpr):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk = rk < DK
    mv = rv < DV
    s_off = h * DK * DV + rk[:, None] * DV + rv[None, :]
    s_mask = mk[:, None] & mv[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + s_off, mask=s_mask, other=0.0)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    lower = rc[:, None] >= rc[None, :]
    strict = rc[:, None] > rc[None, :]
    eye = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    for c0 in range(0, T, C):
        rows = c0 + rc
        mr = rows < T
        qk_off = rows[:, None] * (H * DK) + h * DK + rk[None, :]
        qk_mask = mr[:, None] & mk[None, :]
        Q = tl.load(q_ptr + qk_off, mask=qk_mask, other=0.0)
        K = tl.load(k_ptr + qk_off, mask=qk_mask, other=0.0)
        V = tl.load(v_ptr + rows[:, None] * (H * DV) + h * DV + rv[None, :], mask=mr[:, None] & mv[None, :],
                    other=0.0)
        G = tl.load(g_ptr + rows * H + h, mask=mr, other=0.0)       # padded rows: no decay ...
        B = tl.load(b_ptr + rows * H + h, mask=mr, other=0.0)       # ... and no write
        gamma = tl.cumsum(G, 0)                                     # log G_t from the chunk start
        diff = gamma[:, None] - gamma[None, :]
        D = tl.where(lower, tl.exp(tl.where(lower, diff, 0.0)), 0.0)
        KK = tl.dot(K, tl.trans(K), input_precision="ieee")
        A = tl.where(strict, KK * D * B[:, None], 0.0)
        # (I + A)^-1 by forward substitution: row i = e_i - sum_{s<i} A[i, s] * row s
        Tm = eye
        for i in range(1, C):
            a_i = tl.sum(tl.where(rc[:, None] == i, A, 0.0), 0)      # row i of A, [C]
            t_i = tl.sum(a_i[:, None] * Tm, 0)
            Tm = tl.where(rc[:, None] == i, Tm - t_i[None, :], Tm)
        e_g = tl.exp(gamma)
        Wv = tl.dot(Tm, V * B[:, None], input_precision="ieee")
        Wk = tl.dot(Tm, K * (B * e_g)[:, None], input_precision="ieee")
        U = Wv - tl.dot(Wk, S, input_precision="ieee")
        QK = tl.dot(Q, tl.trans(K), input_precision="ieee") * D
        O = tl.dot(Q * e_g[:, None], S, input_precision="ieee") + tl.dot(QK, U, input_precision="ieee")
        tl.store(o_ptr + rows[:, None] * (H * DV) + h * DV + rv[None, :], O, mask=mr[:, None] & mv[None, :])
        g_last = tl.sum(tl.where(rc == C - 1, gamma, 0.0), 0)       # padded rows add 0: the last real token's
        K_end = K * tl.exp(g_last - gamma)[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(K_end), U, input_precision="ieee")
    tl.store(s_ptr + s_off, S, mask=s_mask)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def chunked_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk form for one sequence (arguments and results as
    :func:`ferrylm.models.kernels.gated_delta.gated_delta_chunked`): ``(o [T, H, Dv], final state [H, Dk, Dv])``
    float32. Launches one kernel of ``H * ceil(Dv / BV)`` programs; no host synchronisation.

    Raises:
        KernelUnavailable: Triton cannot compile the kernel for these shapes here (the caller takes the torch form).
    """
    t, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (x.float().contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(t, h, dv, dtype=torch.float32, device=v.device)
    final = torch.empty(h, dk, dv, dtype=torch.float32, device=v.device)
    s0 = state.float().contiguous() if state is not None else final
    bv = min(32, _block(dv))
    grid = (h, triton.cdiv(dv, bv))
    bk = _block(dk)
    try:
        _chunk_kernel[grid](q, k, v, g, beta, s0, out, final, t, h, DK=dk, DV=dv, BK=bk, BV=bv, C=CHUNK,
                            HAS_S0=state is not None, num_warps=8 if bk >= 128 else 4)
    except (triton.CompilationError, triton.runtime.errors.OutOfResources) as e:
        raise KernelUnavailable(f"{type(e).__name__}: {e}") from e
    return out, final
