"""One decode token of a Gated DeltaNet layer for every sequence of the step, as one Triton kernel (CUDA; Triton's
CPU interpreter in tests): the short causal convolution + SiLU, the q/k L2 norms, the gates, the gated delta rule
and the gated RMSNorm, with both recurrent states read and written in place. The torch path of
:class:`ferrylm.models.gated_deltanet.GatedDeltaNet` (the formulas and their sources are in its module docstring)
is the reference; casts to the model dtype happen where that path makes them.

One program per (sequence, key head): it convolves the key head's ``q``/``k`` channels once and then walks the
``Hv / Hk`` value heads that share them, each with its ``[Dk, Dv]`` float32 state on chip. A program owns every
convolution channel and state it writes, so nothing is read after another program wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class DeltaNetDecodeWeights:
    """A layer's small weights the kernel reads: ``conv [C, K]`` taps (tap ``K - 1`` on the current input),
    ``a_log``, ``dt_bias`` ``[Hv]``, ``norm [Dv]`` the gated norm's weight, its ``eps``, and whether its output
    gate is a sigmoid (else SiLU)."""

    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    eps: float
    sigmoid_gate: bool


@triton.jit
def _conv_silu(qkv_ptr, w_ptr, conv_ptr, row, slot, keep, ch, m, C, sq, KW: tl.constexpr, KP: tl.constexpr):
    """The convolution + SiLU of channels ``ch`` for one sequence (``float32`` of the model-dtype result); shifts
    the sequence's window and appends the current input. The window is read whole before any of it is written
    (threads holding the same channel must not overwrite a row another has yet to read)."""
    x = tl.load(qkv_ptr + row * sq + ch, mask=m, other=0.0)
    base = conv_ptr + slot * (KW - 1) * C
    j = tl.arange(0, KP)[:, None]
    mj = (j < KW - 1) & m[None, :]
    prev = tl.load(base + j * C + ch[None, :], mask=mj & keep, other=0.0).to(x.dtype)
    taps = tl.load(w_ptr + ch[None, :] * KW + j, mask=mj, other=0.0).to(tl.float32)
    acc = tl.sum(prev.to(tl.float32) * taps, 0)
    acc += x.to(tl.float32) * tl.load(w_ptr + ch * KW + (KW - 1), mask=m, other=0.0).to(tl.float32)
    tl.debug_barrier()
    tl.store(base + (j - 1) * C + ch[None, :], prev.to(conv_ptr.dtype.element_ty), mask=mj & (j >= 1))
    tl.store(base + (KW - 2) * C + ch, x.to(conv_ptr.dtype.element_ty), mask=m)
    y = acc / (1.0 + tl.exp(-acc))
    return y.to(x.dtype).to(tl.float32)


@triton.jit
def _decode_kernel(qkv_ptr, z_ptr, b_ptr, a_ptr, w_ptr, alog_ptr, dtb_ptr, nw_ptr, conv_ptr, rec_ptr, slot_ptr,
                   fresh_ptr, out_ptr, C, sq, sz, sb, sa, eps, scale, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                   DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KW: tl.constexpr,
                   KP: tl.constexpr, SIGMOID_GATE: tl.constexpr):
    row = tl.program_id(0)
    kh = tl.program_id(1)
    REP: tl.constexpr = HV // HK
    slot = tl.load(slot_ptr + row).to(tl.int64)
    keep = tl.load(fresh_ptr + row) == 0
    rk = tl.arange(0, BK)
    mk = rk < DK
    rv = tl.arange(0, BV)
    mv = rv < DV
    q = _conv_silu(qkv_ptr, w_ptr, conv_ptr, row, slot, keep, kh * DK + rk, mk, C, sq, KW, KP)
    k = _conv_silu(qkv_ptr, w_ptr, conv_ptr, row, slot, keep, HK * DK + kh * DK + rk, mk, C, sq, KW, KP)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    dt = qkv_ptr.dtype.element_ty
    for r in tl.static_range(REP):
        h = kh * REP + r
        v = _conv_silu(qkv_ptr, w_ptr, conv_ptr, row, slot, keep, 2 * HK * DK + h * DV + rv, mv, C, sq, KW, KP)
        beta = tl.sigmoid(tl.load(b_ptr + row * sb + h).to(tl.float32))
        x = tl.load(a_ptr + row * sa + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus
        s_off = ((slot * HV + h) * DK + rk[:, None]) * DV + rv[None, :]
        s_mask = mk[:, None] & mv[None, :]
        s = tl.load(rec_ptr + s_off, mask=s_mask & keep, other=0.0) * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.debug_barrier()  # every thread has read its part of the state before any is overwritten
        tl.store(rec_ptr + s_off, s, mask=s_mask)
        o = tl.sum(s * q[:, None], 0).to(dt).to(tl.float32)
        o = (o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps)).to(dt).to(tl.float32)
        nw = tl.load(nw_ptr + rv, mask=mv, other=0.0).to(dt).to(tl.float32)
        normed = (nw * o).to(dt).to(tl.float32)  # products in float32, rounded where the model dtype rounds
        z = tl.load(z_ptr + row * sz + h * DV + rv, mask=mv, other=0.0).to(tl.float32)
        gate = tl.sigmoid(z) if SIGMOID_GATE else z * tl.sigmoid(z)
        tl.store(out_ptr + (row * HV + h) * DV + rv, (normed * gate).to(dt), mask=mv)


def fused_decode(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, weights: DeltaNetDecodeWeights,
                 conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                 key_heads: int) -> torch.Tensor:
    """One decode token per sequence (module docstring). No host sync: capturable.

    Args:
        qkv: ``[B, C]`` the projection ``[q | k | v]`` (``C = 2 Hk Dk + Hv Dv``), model dtype.
        z: ``[B, Hv, Dv]`` output gate; b, a: ``[B, Hv]`` write-strength and decay projections. Rows may be
            strided (views of one fused projection); the rest contiguous.
        weights: the layer's :class:`DeltaNetDecodeWeights`.
        conv_state: ``[S, K - 1, C]`` every slot's last inputs (model dtype), updated in place.
        rec_state: ``[S, Hv, Dk, Dv]`` float32 delta-rule states, updated in place.
        slots: ``[B]`` int64 state slot of each sequence; fresh: ``[B]`` bool (its states read as zeros).
        key_heads: ``Hk``.

    Returns:
        ``[B, Hv * Dv]`` in ``qkv``'s dtype: the gated norm's output, ready for ``out_proj``.
    """
    bsz, c = qkv.shape
    hv, dk, dv = rec_state.shape[1:]
    out = torch.empty(bsz, hv * dv, dtype=qkv.dtype, device=qkv.device)
    w = weights
    bk, bv = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    qkv, b, a = (t if t.stride(-1) == 1 else t.contiguous() for t in (qkv, b, a))
    if z.stride(-1) != 1 or z.stride(-2) != dv:
        z = z.contiguous()
    _decode_kernel[(bsz, key_heads)](
        qkv, z, b, a, w.conv, w.a_log, w.dt_bias, w.norm, conv_state, rec_state, slots, fresh.view(torch.uint8),
        out, c, qkv.stride(0), z.stride(0), b.stride(0), a.stride(0), w.eps, dk ** -0.5, HK=key_heads, HV=hv,
        DK=dk, DV=dv, BK=bk, BV=bv, KW=conv_state.shape[1] + 1,
        KP=triton.next_power_of_2(conv_state.shape[1]), SIGMOID_GATE=w.sigmoid_gate,
        num_warps=8 if bk * bv >= 128 * 128 else 4)
    return out
