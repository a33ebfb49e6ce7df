"""Triton kernels for the per-token layers of a decoder step, each one launch where torch takes several: RMSNorm
(two kernels in torch: the normalisation and the weight multiply), per-head q/k RMSNorm + rotary embedding (six),
routing top-k (four). On a GPU a decode step is a few thousand such small launches; fusing them is what moves it
towards the memory roofline.

Each kernel rounds as the torch reference in ``models/layers.py`` / ``models/moe.py`` does (so their results agree
to the last bit wherever the float32 reductions happen to add in the same order, and within one rounding otherwise):

* RMSNorm (Zhang & Sennrich 2019): ``n = round(x * rsqrt(mean(x^2) + eps))`` with the statistic in float32, then
  ``round(w * n)``.
* RoPE, half-split pairing (Su et al. 2021; the Hugging Face layout): ``round(round(x * cos) + round(swap(x) * s))``
  with ``swap(x) = [x2, x1]`` and ``s = [-sin, sin]`` (``apply_rotary_full``).
* routing (Shazeer et al. 2017; softmax in float32): with renormalisation, the top-k logits then a softmax over
  them; without, the softmax over all experts, then its top k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, w_rows, stride_x, stride_out, eps,
                     BLOCK: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    out_ty = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + (row % w_rows) * n_cols + c, mask=ok, other=0.0).to(tl.float32)
    if ZERO_CENTRED:  # float32 throughout, weight 1 + w
        n = x * r
        w = 1.0 + w
    else:
        n = (x * r).to(out_ty).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + c, (w * n).to(out_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centred: bool = False) -> torch.Tensor:
    """``weight * RMSNorm(x)`` over the last dim (module docstring), one kernel; with ``zero_centred``
    ``(1 + weight) * RMSNorm(x)`` all in float32, rounded once at the end (Qwen3-Next's norm).

    Args:
        x: ``[..., D]`` (rows may be strided; the last dim contiguous).
        weight: ``[D]``, or ``[R, D]`` where row ``i`` of the flattened ``x`` uses weight row ``i % R`` (the
            per-head q/k norm with both weights stacked). Same dtype as ``x``.
        eps: added to the mean square.

    Returns:
        ``x``'s shape and dtype, contiguous.
    """
    d = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, d)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    w = weight.reshape(-1, d)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, w, out, d, w.shape[0], rows.stride(0), out.stride(0), eps,
                                           BLOCK=triton.next_power_of_2(d), ZERO_CENTRED=zero_centred,
                                           num_warps=4 if d >= 1024 else 1)
    return out.view(x.shape)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, positions_ptr, heads, w_rows,
                      stride_xt, stride_xh, stride_ot, stride_oh, stride_cos, eps,
                      HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid = tl.program_id(0)
    t = pid // heads
    h = pid % heads
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    d_sw = (d + half) % HEAD_DIM
    base = x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh
    x = tl.load(base + d).to(tl.float32)
    x_sw = tl.load(base + d_sw).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if HAS_NORM:
        r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
        wrow = w_ptr + (h % w_rows) * HEAD_DIM
        x = (tl.load(wrow + d).to(tl.float32) * (x * r).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
        x_sw = (tl.load(wrow + d_sw).to(tl.float32) * (x_sw * r).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + d % half)
    sin = tl.load(sin_ptr + pos * stride_cos + d % half)
    cos = cos.to(out_ty).to(tl.float32)
    sin = tl.where(d < half, -sin, sin).to(out_ty).to(tl.float32)
    y = ((x * cos).to(out_ty).to(tl.float32) + (x_sw * sin).to(out_ty).to(tl.float32)).to(out_ty)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, y)


def norm_rope(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
              weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Per-head RMSNorm (optional) then RoPE of ``x [T, heads, D]`` at ``positions [T]``, one kernel.

    Args:
        x: ``[T, heads, D]`` (e.g. the query and key heads of a fused projection, a strided view); ``D`` a power of two.
        positions: ``[T]`` int64 absolute positions.
        cos_table, sin_table: ``[P, D/2]`` float32 tables (``RotaryEmbedding``: already times the attention factor).
        weight: ``[R, D]`` norm weights, head ``h`` uses row ``h % R``; None = no norm (RoPE only).
        eps: the norm's epsilon.

    Returns:
        ``[T, heads, D]`` contiguous in ``x``'s dtype.
    """
    t, heads, d = x.shape
    out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    if t:
        w = weight if weight is not None else cos_table
        _norm_rope_kernel[(t * heads,)](x, w, cos_table, sin_table, out, positions, heads,
                                        w.shape[0] if weight is not None else 1, x.stride(0), x.stride(1),
                                        out.stride(0), out.stride(1), cos_table.stride(0), eps,
                                        HAS_NORM=weight is not None, HEAD_DIM=d, num_warps=1)
    return out


@triton.jit
def _topk_softmax_kernel(logits_ptr, ids_ptr, w_ptr, n_experts, stride_l,
                         TOP_K: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr):
    row = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    ok = e < n_experts
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    denom = tl.sum(tl.where(ok, tl.exp(x - m), 0.0), 0)
    k = tl.arange(0, TOP_K)
    ids = tl.zeros([TOP_K], dtype=tl.int64)
    vals = tl.zeros([TOP_K], dtype=tl.float32)
    cur = x
    for j in tl.static_range(TOP_K):
        best = tl.max(cur, 0)
        idx = tl.min(tl.where(cur == best, e, E_PAD), 0)  # the lowest index among equal maxima
        ids = tl.where(k == j, idx.to(tl.int64), ids)
        vals = tl.where(k == j, best, vals)
        cur = tl.where(e == idx, float("-inf"), cur)
    if RENORM:
        p = tl.exp(vals - tl.max(vals, 0))
        w = p / tl.sum(p, 0)
    else:
        w = tl.exp(vals - m) / denom
    tl.store(ids_ptr + row.to(tl.int64) * TOP_K + k, ids)
    tl.store(w_ptr + row.to(tl.int64) * TOP_K + k, w)


def topk_softmax(router_logits: torch.Tensor, top_k: int, *, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~ferrylm.models.moe.softmax_topk` in one kernel: ``router_logits [T, E]`` ->
    ``(ids [T, k] int64, weights [T, k] float32)``, ids in descending order of probability; equal logits pick the
    lowest expert id first.

    Raises:
        ValueError: ``top_k`` is not a power of two, or the rows are not contiguous (callers take the torch path).
    """
    t, e = router_logits.shape
    if top_k & (top_k - 1) or router_logits.stride(-1) != 1:
        raise ValueError(f"the fused router kernel needs a power-of-two top_k ({top_k}) and contiguous rows")
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    if t:
        _topk_softmax_kernel[(t,)](router_logits, ids, w, e, router_logits.stride(0), TOP_K=top_k,
                                   E_PAD=triton.next_power_of_2(e), RENORM=renormalize, num_warps=1)
    return ids, w
