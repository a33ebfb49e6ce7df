"""Fused MoE on the device: a layer's routed experts in two grouped Triton kernels, no host sync, no Python loop
over experts.

Math (Jiang et al. 2024, "Mixtral of Experts", eq. 3): ``y_t = sum_j w_tj * W_down[e] (silu(W_gate[e] x_t) *
(W_up[e] x_t))`` with ``e = ids[t, j]``.

1. :func:`moe_align` (torch ops on the device): the ``T * k`` assignments sorted by expert and each expert's group
   padded to a multiple of ``BLOCK_M`` (padding rows hold the sentinel ``T * k``), and the expert of every block of
   ``BLOCK_M`` rows. Sizes are bounded on the host (``T * k + min(T * k, E) * (BLOCK_M - 1)`` rows), so nothing is
   read back and the whole computation can be captured in a CUDA graph. (The block-aligned grouping is the one of
   vLLM's Triton ``fused_moe``; this implementation is ours.)
2. ``_gate_up_kernel``: per block of rows and column tile, ``x[token] @ W_gate[e]^T`` and ``@ W_up[e]^T`` in one
   pass over ``x`` (fp32 accumulation), SiLU-and-multiply in the epilogue -> ``h [T * k, I]``.
3. ``_down_kernel``: ``h @ W_down[e]^T``, times the routing weight in the epilogue, stored at ``t * k + r`` where
   ``r`` is the rank of ``e`` among token ``t``'s experts (ascending id); the ``k`` rows of each token are then
   summed in float32 in that order: the summation order of :meth:`~ferrylm.experts.work.LayerWork.combine`, so
   every backend adds a token's contributions the same way.

Rounding follows the torch reference (``swiglu_expert`` + ``weigh``): each GEMM's result is rounded to the
activation dtype, SiLU is computed in float32 and rounded, the product rounded, the weighted output rounded.

Weights are read through strides (``[E, I, H]`` / ``[E, H, I]`` views: resident stacks or slot-cache rows, see
``ExpertLayout.layer_views``) and optionally through ``slot_of`` (``[E]`` int32: the cache slot holding expert ``e``),
so the offload cache's slots run through the same kernels.

Quantized experts (:mod:`ferrylm.experts.quantized`: int4 / int8 / fp4 / fp8 with group scales) stay quantized in
device memory: the kernels read their codes and scales and dequantize each ``[BLOCK_K, BLOCK_N]`` weight tile in
registers (:func:`~ferrylm.experts.kernels.dequant.weight_tile`), the format a compile-time constant of the launch.
Where a format without mins has groups that hold whole K tiles (fp8 with 128-wide block scales, int4 / int8 at
group 128) the tile's unscaled values go into the dot and the group scale multiplies its result
(:func:`~ferrylm.experts.kernels.dequant.scale_after_dot`), and on sm89+ e4m3 converts in hardware: that is what
lets the fp8 kernel read faster than PCIe delivers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ferrylm.experts.kernels.dequant import hardware_fp8, scale_after_dot, tile_dot, weight_args
from ferrylm.experts.executor import ExpertMath
from ferrylm.experts.quantized import QuantTensor
from ferrylm.triton_util import dot_precision


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes of one launch: rows per expert block ``block_m``, output columns ``block_n``, reduction
    ``block_k``; ``num_warps`` / ``num_stages`` as Triton's."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def pick_tiles(num_assignments: int, num_experts: int) -> tuple[MoeTiles, MoeTiles]:
    """``(gate/up tiles, down tiles)`` for a step of ``num_assignments = T * k`` rows over ``num_experts`` experts:
    16-row blocks while experts see about one token each (decode: memory-bound, narrow column tiles so enough
    programs stream the weights), 64-row blocks for prefill (compute-bound)."""
    if num_assignments <= 2 * num_experts:
        return MoeTiles(16, 32, 128, 4, 4), MoeTiles(16, 64, 128, 4, 4)
    return MoeTiles(64, 128, 64, 4, 3), MoeTiles(64, 128, 64, 4, 3)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group a step's assignments by expert in blocks of ``block_m`` rows, on the device, without a host sync.

    Args:
        topk_ids: ``[T, k]`` int64 expert ids in ``[0, E)``.
        num_experts: ``E``.
        block_m: rows per block.

    Returns:
        ``(sorted_ids [P] int32, block_expert [P / block_m] int32, num_padded [1] int64, counts [E] int64)``:
        ``sorted_ids`` the flat
        assignment index ``t * k + j`` of each row (ascending expert, then ascending assignment), ``T * k`` on
        padding rows; ``block_expert[b]`` the expert of rows ``b * block_m ..`` (meaningless past ``num_padded``);
        ``num_padded`` the rows in use; ``counts`` the assignments of each expert.
        ``P = round_up(T k + min(T k, E) (block_m - 1), block_m)``.
    """
    n = topk_ids.numel()
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    e_sorted = flat[order]
    rank_in_expert = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    dest = (pad_end - padded)[e_sorted] + rank_in_expert
    rows = n + min(n, num_experts) * (block_m - 1)
    rows = -(-rows // block_m) * block_m
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=dev)
    sorted_ids.index_copy_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, rows, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, pad_end[-1:], counts


# NOTE: steps of at most this many assignments (T * k) are grouped by one single-program kernel (decode: a few
# dozen kernels of torch ops per layer would cost more than the layer's GEMMs); larger ones by torch ops. Powers of
# two: the kernel's lane counts. Two compiled variants (no JIT compile at request time beyond them): steps of up to
# ALIGN_DECODE assignments (decode of a few sequences) run on that many lanes, the kernel's [CHUNK, lanes] tiles stay
# in registers; larger ones on ALIGN_SMALL_MAX lanes.
ALIGN_SMALL_MAX = 1024
ALIGN_DECODE = 64


@triton.jit
def _align_small_kernel(ids_ptr, sorted_ptr, bexp_ptr, npad_ptr, dest_ptr, used_ptr,
                        N, K, E, P, NUM_BLOCKS,
                        BLOCK_M: tl.constexpr, N_PAD: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                        CHUNK: tl.constexpr, FILL: tl.constexpr, HAS_USED: tl.constexpr):
    """:func:`moe_align` + :func:`expert_rank_rows` + the distinct-expert count of a small step in ONE program:
    counts by histogram, padded group offsets by prefix sum, each assignment's rank within its expert by comparing it
    with the earlier ones (``[CHUNK, N_PAD]`` at a time), each block's expert by comparing its start with the group
    ends, each assignment's rank among its token's ``k`` experts."""
    n = tl.arange(0, N_PAD)
    n_ok = n < N
    ids_all = tl.load(ids_ptr + n, mask=n_ok, other=E).to(tl.int32)  # padding lanes count in bin E (dropped)
    counts = tl.histogram(ids_all, E_PAD)                              # [E_PAD]
    e = tl.arange(0, E_PAD)
    counts = tl.where(e < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    tl.store(npad_ptr, tl.sum(padded, 0).to(tl.int64))
    if HAS_USED:
        tl.store(used_ptr, tl.load(used_ptr) + tl.sum((counts > 0).to(tl.int64), 0))
    for p0 in range(0, P, FILL):                                       # every row starts as padding (sentinel N)
        p = p0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + p, tl.full([FILL], 0, tl.int32) + N, mask=p < P)
    for b0 in range(0, NUM_BLOCKS, CHUNK):                             # the expert of each block of rows
        b = b0 + tl.arange(0, CHUNK)
        owner = tl.sum((pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(bexp_ptr + b, tl.minimum(owner, E - 1), mask=b < NUM_BLOCKS)
    tl.debug_barrier()                                                 # the fill lands before the scatter below
    for i0 in range(0, N, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        i_ok = i < N
        ids_i = tl.load(ids_ptr + i, mask=i_ok, other=E).to(tl.int32)
        earlier = (ids_all[None, :] == ids_i[:, None]) & (n[None, :] < i[:, None])
        rank = tl.sum(earlier.to(tl.int32), 1)
        start = tl.sum(tl.where(e[None, :] == ids_i[:, None], pad_start[None, :], 0), 1)
        tl.store(sorted_ptr + start + rank, i.to(tl.int32), mask=i_ok)
        tok = i // K
        j = tl.arange(0, K_PAD)
        mates = tl.load(ids_ptr + tok[:, None] * K + j[None, :], mask=i_ok[:, None] & (j[None, :] < K),
                        other=E).to(tl.int32)
        below = tl.sum((mates < ids_i[:, None]).to(tl.int32), 1)
        tl.store(dest_ptr + i, (tok * K + below).to(tl.int64), mask=i_ok)


def align_small(topk_ids: torch.Tensor, num_experts: int, block_m: int, used_experts: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_align` and :func:`expert_rank_rows` in one kernel, for ``T * k <= ALIGN_SMALL_MAX``.

    Returns:
        ``(sorted_ids [P] int32, block_expert [P / block_m] int32, num_padded [1] int64, dest_rows [T * k] int64)``
        as :func:`moe_align`'s first three and :func:`expert_rank_rows`; adds the step's distinct experts to
        ``used_experts`` when given.
    """
    t, k = topk_ids.shape
    n = t * k
    dev = topk_ids.device
    rows = -(-(n + min(n, num_experts) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int64, device=dev)
    dest = torch.empty(n, dtype=torch.int64, device=dev)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    _align_small_kernel[(1,)](ids, sorted_ids, block_expert, num_padded, dest,
                              used_experts if used_experts is not None else num_padded,
                              n, k, num_experts, rows, rows // block_m,
                              BLOCK_M=block_m, N_PAD=ALIGN_DECODE if n <= ALIGN_DECODE else ALIGN_SMALL_MAX,
                              E_PAD=triton.next_power_of_2(num_experts + 1), K_PAD=triton.next_power_of_2(k),
                              CHUNK=32, FILL=256, HAS_USED=used_experts is not None, num_warps=4)
    return sorted_ids, block_expert, num_padded, dest


@triton.jit
def _block_expert(bexp_ptr, slot_ptr, off_ptr, pid_m, HAS_SLOTS: tl.constexpr, HAS_OFF: tl.constexpr):
    """``(e, d)`` of row block ``pid_m``: the row index ``e`` of its expert in the weight views (through ``slot_of``
    when given) and, with ``row_offset``, ``e = 1`` and ``d`` the expert's byte offset (the caller turns ``d`` into
    each field's stride, so ``e * stride`` lands on the expert's row wherever it lives); else ``d = 0``."""
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if HAS_SLOTS:
        e = tl.load(slot_ptr + e).to(tl.int64)
    d = e * 0
    if HAS_OFF:
        d = tl.load(off_ptr + e).to(tl.int64)
        e = d * 0 + 1
    return e, d


@triton.jit
def _tile(sorted_ptr, pid_m, pid_n, num_assign, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """The rows and columns of tile ``(pid_m, pid_n)``: the assignment ids ``a_id [BLOCK_M]`` of its sorted rows and
    ``m_ok`` (a real assignment, not padding), the output columns ``n [BLOCK_N]`` and ``n_ok`` (``n < N``), and the
    reduction offsets ``k [BLOCK_K]`` of the first K tile."""
    a_id = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return a_id, a_id < num_assign, n, n < N, tl.arange(0, BLOCK_K)


@triton.jit
def _gate_up_kernel(x_ptr, h_ptr, sorted_ptr, bexp_ptr, npad_ptr, slot_ptr, off_ptr, gb_ptr, ub_ptr, alpha, limit,
                    up_shift, num_assign, N, K, top_k, stride_xt, stride_ht,
                    wg_ptr, sg_ptr, mg_ptr, rg_ptr, stride_ge, stride_gn, stride_gk, sgse, sgsn, sgsg, sgre, sgrn,
                    wu_ptr, su_ptr, mu_ptr, ru_ptr, stride_ue, stride_un, stride_uk, suse, susn, susg, sure, surn,
                    HAS_SLOTS: tl.constexpr, HAS_OFF: tl.constexpr, ITEM_W: tl.constexpr, ITEM_S: tl.constexpr,
                    ITEM_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, QKIND: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
                    HAS_ROW: tl.constexpr, SCALE_AFTER: tl.constexpr, HW_FP8: tl.constexpr, MATH: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    e, d = _block_expert(bexp_ptr, slot_ptr, off_ptr, pid_m, HAS_SLOTS, HAS_OFF)
    if HAS_OFF:  # expert e's row lies d bytes from row 0 of the views: every field moves by d (its own units)
        stride_ge = d // ITEM_W
        stride_ue = d // ITEM_W
        sgse = d // ITEM_S
        suse = d // ITEM_S
        sgre = d // ITEM_R
        sure = d // ITEM_R
    a_id, m_ok, n, n_ok, k = _tile(sorted_ptr, pid_m, pid_n, num_assign, N, BLOCK_M, BLOCK_N, BLOCK_K)
    tok = (a_id // top_k).to(tl.int64)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + k[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k + k0 < K
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g = tile_dot(acc_g, a, wg_ptr, sg_ptr, mg_ptr, rg_ptr, e, n, k0, k + k0, n_ok, k_ok, stride_ge,
                         stride_gn, stride_gk, sgse, sgsn, sgsg, sgre, sgrn, QKIND, GROUP, HAS_MINS, HAS_ROW,
                         BLOCK_K, HW_FP8, SCALE_AFTER, PRECISION)
        acc_u = tile_dot(acc_u, a, wu_ptr, su_ptr, mu_ptr, ru_ptr, e, n, k0, k + k0, n_ok, k_ok, stride_ue,
                         stride_un, stride_uk, suse, susn, susg, sure, surn, QKIND, GROUP, HAS_MINS, HAS_ROW,
                         BLOCK_K, HW_FP8, SCALE_AFTER, PRECISION)
        x_ptrs += BLOCK_K
    out_ty = h_ptr.dtype.element_ty
    if MATH:  # biases by the expert's id, then the clamped SwiGLU (experts/executor.ExpertMath)
        eid = tl.load(bexp_ptr + pid_m).to(tl.int64)
        bg = tl.load(gb_ptr + eid * N + n, mask=n_ok, other=0.0).to(tl.float32)
        bu = tl.load(ub_ptr + eid * N + n, mask=n_ok, other=0.0).to(tl.float32)
        g = (acc_g + bg[None, :]).to(out_ty).to(tl.float32)
        u = (acc_u + bu[None, :]).to(out_ty).to(tl.float32)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        glu = g / (1.0 + tl.exp(-g * alpha))
        h = ((u + up_shift) * glu).to(out_ty)
    else:
        g = acc_g.to(out_ty).to(tl.float32)
        u = acc_u.to(out_ty).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        h = (s * u).to(out_ty)
    tl.store(h_ptr + a_id.to(tl.int64)[:, None] * stride_ht + n[None, :], h, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, out_ptr, w_ptr, dest_ptr, sorted_ptr, bexp_ptr, npad_ptr, slot_ptr, off_ptr, db_ptr,
                 num_assign, N, K, stride_ht, stride_ot,
                 wd_ptr, sd_ptr, md_ptr, rd_ptr, stride_de, stride_dn, stride_dk, sdse, sdsn, sdsg, sdre, sdrn,
                 HAS_SLOTS: tl.constexpr, HAS_OFF: tl.constexpr, ITEM_W: tl.constexpr, ITEM_S: tl.constexpr,
                 ITEM_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, QKIND: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
                 HAS_ROW: tl.constexpr, SCALE_AFTER: tl.constexpr, HW_FP8: tl.constexpr, MATH: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    e, d = _block_expert(bexp_ptr, slot_ptr, off_ptr, pid_m, HAS_SLOTS, HAS_OFF)
    if HAS_OFF:  # as in _gate_up_kernel
        stride_de = d // ITEM_W
        sdse = d // ITEM_S
        sdre = d // ITEM_R
    a_id, m_ok, n, n_ok, k = _tile(sorted_ptr, pid_m, pid_n, num_assign, N, BLOCK_M, BLOCK_N, BLOCK_K)
    a64 = a_id.to(tl.int64)
    h_ptrs = h_ptr + a64[:, None] * stride_ht + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k + k0 < K
        a = tl.load(h_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tile_dot(acc, a, wd_ptr, sd_ptr, md_ptr, rd_ptr, e, n, k0, k + k0, n_ok, k_ok, stride_de, stride_dn,
                       stride_dk, sdse, sdsn, sdsg, sdre, sdrn, QKIND, GROUP, HAS_MINS, HAS_ROW, BLOCK_K, HW_FP8,
                       SCALE_AFTER, PRECISION)
        h_ptrs += BLOCK_K
    out_ty = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + a64, mask=m_ok, other=0.0).to(tl.float32)
    if MATH:  # the down bias of the expert (by its id)
        eid = tl.load(bexp_ptr + pid_m).to(tl.int64)
        acc += tl.load(db_ptr + eid * N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = (acc.to(out_ty).to(tl.float32) * w[:, None]).to(out_ty)
    dest = tl.load(dest_ptr + a64, mask=m_ok, other=0).to(tl.int64)
    tl.store(out_ptr + dest[:, None] * stride_ot + n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def _items(args: tuple) -> dict:
    """Item sizes (bytes) of a projection's data, scale and row-scale fields (:func:`weight_args`' first four
    positional arguments: data, scales, mins, row scale), constants of a launch that reads weights through
    ``row_offset``."""
    return dict(ITEM_W=args[0].element_size(), ITEM_S=args[1].element_size(), ITEM_R=args[3].element_size())


def expert_rank_rows(topk_ids: torch.Tensor) -> torch.Tensor:
    """``[T * k]`` int64: for assignment ``t * k + j``, the row ``t * k + r`` with ``r`` the rank of ``ids[t, j]``
    among token ``t``'s experts in ascending id (ties, which routing never produces, by position)."""
    t, k = topk_ids.shape
    rank = torch.argsort(torch.argsort(topk_ids, dim=1, stable=True), dim=1, stable=True)
    return (torch.arange(t, device=topk_ids.device)[:, None] * k + rank).reshape(-1)


def fused_moe(hidden: torch.Tensor, gate: torch.Tensor | QuantTensor, up: torch.Tensor | QuantTensor,
              down: torch.Tensor | QuantTensor,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, slot_of: torch.Tensor | None = None,
              tiles: tuple[MoeTiles, MoeTiles] | None = None, used_experts: torch.Tensor | None = None,
              row_offset: torch.Tensor | None = None, math: ExpertMath | None = None) -> torch.Tensor:
    """``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` for one layer, entirely on the device (module docstring).

    Args:
        hidden: ``[T, H]`` activations (bf16 / fp16 / fp32), rows contiguous.
        gate, up: ``[X, I, H]`` and down ``[X, H, I]`` expert weights (any strides; unit stride along the last dim
            is fastest). ``X = E`` for resident stacks, or the slot count with ``slot_of``. Quantized experts are
            :class:`~ferrylm.experts.quantized.QuantTensor` s (gate and up of one format; views of slot rows
            work alike): the kernels dequantize each weight tile in registers (:mod:`.dequant`) and round it to
            the activation dtype before the float32-accumulating ``tl.dot``.
        topk_ids: ``[T, k]`` int64 expert ids in ``[0, E)``. topk_weights: ``[T, k]`` routing weights.
        slot_of: ``[E]`` int32, the row of ``gate``/``up``/``down`` holding expert ``e`` (None: row ``e``). Every
            expert the step routes to must have a valid row (the caller made it resident).
        tiles: override :func:`pick_tiles` (benchmarks).
        used_experts: a 0-dim int64 device tensor to which the number of distinct experts the step routes to is
            added in place (a counter that needs no host sync, and keeps counting in CUDA graph replays).
        row_offset: ``[E]`` int64 (device): where expert ``e``'s weights are, in BYTES from row 0 of ``gate`` /
            ``up`` / ``down`` (every field of a quantized row moves by the same bytes; each must be a multiple of
            the fields' item sizes). The table of the offloading backends: an expert in a slot-cache row, or in
            its host bank row read over PCIe by the kernel itself (mapped pinned memory, same address space), so
            one launch serves hits and misses with no host decision. Mutually exclusive with ``slot_of``.
        math: gpt-oss's biases (``[E, I]`` / ``[E, H]`` on the device, indexed by expert id) and clamped SwiGLU
            (:class:`~ferrylm.experts.executor.ExpertMath`); None = plain SwiGLU.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype.
    """
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    t, hdim = hidden.shape
    k = topk_ids.shape[1]
    inter = gate.shape[1]
    if slot_of is not None and row_offset is not None:
        raise ValueError("fused_moe: give slot_of or row_offset, not both")
    num_experts = (slot_of.shape[0] if slot_of is not None else
                   row_offset.shape[0] if row_offset is not None else gate.shape[0])
    if t == 0:
        return torch.zeros_like(hidden)
    n = t * k
    gu_tiles, d_tiles = tiles or pick_tiles(n, num_experts)
    if n <= ALIGN_SMALL_MAX:
        sorted_ids, block_expert, num_padded, dest = align_small(topk_ids, num_experts, gu_tiles.block_m,
                                                                 used_experts)
    else:
        sorted_ids, block_expert, num_padded, counts = moe_align(topk_ids, num_experts, gu_tiles.block_m)
        dest = expert_rank_rows(topk_ids)
        if used_experts is not None:
            used_experts += (counts > 0).sum()
    if d_tiles.block_m != gu_tiles.block_m:
        raise ValueError("both GEMMs must use the same block_m (one alignment)")
    inter_act = torch.empty(n, inter, dtype=hidden.dtype, device=hidden.device)
    slots = slot_of if slot_of is not None else sorted_ids  # unused without HAS_SLOTS
    blocks = sorted_ids.shape[0] // gu_tiles.block_m
    (g_args, g_kind), (u_args, _), (d_args, d_kind) = weight_args(gate), weight_args(up), weight_args(down)
    offs = row_offset if row_offset is not None else sorted_ids  # unused without HAS_OFF
    g_items, d_items = _items(g_args), _items(d_args)
    hw_fp8 = hardware_fp8(hidden.device)
    if g_kind["QKIND"] or d_kind["QKIND"]:
        # dequantizing tiles in registers: two pipeline stages (three can run out of shared memory at 64-row tiles)
        gu_tiles, d_tiles = (replace(t, num_stages=min(2, t.num_stages)) for t in (gu_tiles, d_tiles))
    gb, ub, db = (math.gate_bias, math.up_bias, math.down_bias) if math is not None else (hidden,) * 3
    alpha, limit, shift = (math.alpha, math.limit, math.up_shift) if math is not None else (1.0, 0.0, 1.0)
    _gate_up_kernel[(blocks, triton.cdiv(inter, gu_tiles.block_n))](
        hidden, inter_act, sorted_ids, block_expert, num_padded, slots, offs, gb, ub, alpha, limit, shift,
        n, inter, hdim, k, hidden.stride(0), inter_act.stride(0), *g_args, *u_args,
        HAS_SLOTS=slot_of is not None, HAS_OFF=row_offset is not None, **g_items,
        BLOCK_M=gu_tiles.block_m, BLOCK_N=gu_tiles.block_n,
        BLOCK_K=gu_tiles.block_k, PRECISION=dot_precision(hidden.dtype), num_warps=gu_tiles.num_warps,
        num_stages=gu_tiles.num_stages, SCALE_AFTER=scale_after_dot(g_kind, gu_tiles.block_k), HW_FP8=hw_fp8,
        MATH=math is not None, **g_kind)
    rows = torch.empty(n, hdim, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32:
        weights = weights.float()
    _down_kernel[(blocks, triton.cdiv(hdim, d_tiles.block_n))](
        inter_act, rows, weights, dest, sorted_ids, block_expert, num_padded, slots, offs, db,
        n, hdim, inter, inter_act.stride(0), rows.stride(0), *d_args,
        HAS_SLOTS=slot_of is not None, HAS_OFF=row_offset is not None, **d_items,
        BLOCK_M=d_tiles.block_m, BLOCK_N=d_tiles.block_n,
        BLOCK_K=d_tiles.block_k, PRECISION=dot_precision(hidden.dtype), num_warps=d_tiles.num_warps,
        num_stages=d_tiles.num_stages, SCALE_AFTER=scale_after_dot(d_kind, d_tiles.block_k), HW_FP8=hw_fp8,
        MATH=math is not None, **d_kind)
    # one kernel: a 16-bit sum accumulates in float32 and rounds once, as sum(dtype=float32).to(dtype) does
    return rows.view(t, k, hdim).sum(1)
