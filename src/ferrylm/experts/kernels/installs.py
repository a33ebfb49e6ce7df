"""The device slot table's installs as two kernels per MoE layer, decided and done on the GPU inside the step
(:mod:`ferrylm.experts.device_pools` has the protocol).

1. ``_plan_kernel`` (one program): mark the experts the layer's routed ids need; stamp the resident ones (hits)
   with the step's stamp; order the pool's positions by stamp (an empty slot first; a position with no slot never)
   and give the ``r``-th missed expert (ascending id) the ``r``-th oldest position, unless that one was stamped in
   this step; evict its expert (table entry back to its host bank row) and point the table at the new slot.
   ``sel[r]`` names the expert installed at rank ``r < count``.
2. ``_copy_rows_kernel``: copy each installed expert's row from its bank row (page-locked host memory mapped into
   the device's address space: the loads cross PCIe) to its slot; a persistent grid walks the installs' 32 KiB
   chunks (the plan's ``count``, read on the device, bounds the walk: no host sync sizes the grid).

Offsets are BYTES from one reference tensor, as in the table the fused MoE kernel reads. Shapes are fixed and nothing
is read back, so both launches are capturable in a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

CHUNK_BYTES = 32768  # one program's share of a row, read in one load: many PCIe reads in flight per row
STAMP_CAP = 1 << 40  # stamps at or above this sort last and are never victims (NEVER is clamped to it)


@triton.jit
def _plan_kernel(ids_ptr, n_ids, need_ptr, key_ptr, pos_ptr, stamp_ptr, owner_ptr, table_ptr, home_ptr, off_ptr,
                 now_ptr, sel_ptr, count_ptr, num_experts, max_installs, BUMP: tl.constexpr, E_PAD: tl.constexpr,
                 N_PAD: tl.constexpr, CAP: tl.constexpr):
    now = tl.load(now_ptr)
    if BUMP:  # the step's first MoE layer opens a new stamp
        now += 1
        tl.store(now_ptr, now)
    e = tl.arange(0, E_PAD)
    in_e = e < num_experts
    tl.store(need_ptr + e, tl.zeros([E_PAD], dtype=tl.int32))
    tl.debug_barrier()
    n = tl.arange(0, N_PAD)
    ids = tl.load(ids_ptr + n, mask=n < n_ids, other=0)
    tl.store(need_ptr + ids, tl.full([N_PAD], 1, dtype=tl.int32), mask=n < n_ids)
    tl.debug_barrier()
    need = (tl.load(need_ptr + e, mask=in_e, other=0) != 0) & in_e
    pos = tl.load(pos_ptr + e, mask=in_e, other=-1)
    hit = need & (pos >= 0)
    miss = need & (pos < 0)
    tl.store(stamp_ptr + pos, now + pos * 0, mask=hit)
    tl.debug_barrier()
    st = tl.load(stamp_ptr + e, mask=in_e, other=CAP)
    st = tl.minimum(st, CAP) + 1  # >= 0: empty (-1) first
    tl.store(key_ptr + e, tl.sort(st * E_PAD + e))
    tl.debug_barrier()
    rank = tl.cumsum(miss.to(tl.int32), 0) - 1
    ok = miss & (rank < max_installs)
    key = tl.load(key_ptr + rank, mask=ok, other=(CAP + 1) * E_PAD)
    vp = key % E_PAD
    ok = ok & (key // E_PAD - 1 < now)
    old = tl.load(owner_ptr + vp, mask=ok, other=-1)
    gone = ok & (old >= 0)
    tl.store(pos_ptr + old, -1 + old * 0, mask=gone)
    tl.store(table_ptr + old, tl.load(home_ptr + old, mask=gone, other=0), mask=gone)
    tl.store(owner_ptr + vp, e.to(tl.int64), mask=ok)
    tl.store(stamp_ptr + vp, now + vp * 0, mask=ok)
    tl.store(pos_ptr + e, vp, mask=ok)
    tl.store(table_ptr + e, tl.load(off_ptr + vp, mask=ok, other=0), mask=ok)
    tl.store(sel_ptr + rank, e.to(tl.int64), mask=ok)
    tl.store(count_ptr, tl.sum(ok.to(tl.int64), 0))  # victims are ordered by stamp: the installs are ranks [0, count)


@triton.jit
def _copy_rows_kernel(base_ptr, sel_ptr, count_ptr, src_ptr, dst_ptr, n_items, chunks, ITEM: tl.constexpr,
                      BLOCK: tl.constexpr):
    total = tl.load(count_ptr) * chunks
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        e = tl.load(sel_ptr + w // chunks)
        s = tl.load(src_ptr + e).to(tl.int64) // ITEM
        d = tl.load(dst_ptr + e).to(tl.int64) // ITEM
        idx = (w % chunks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = idx < n_items
        tl.store(base_ptr + d + idx, tl.load(base_ptr + s + idx, mask=m), mask=m)


def demand_programs(device: torch.device) -> int:
    """The copy's grid when nothing runs beside it: four programs per SM (two on a CPU, Triton's interpreter)."""
    if device.type != "cuda":
        return 2
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def item_dtype(row_bytes: int, base: int, offsets: np.ndarray) -> torch.dtype:
    """The widest integer dtype (8, 4, 2 or 1 bytes) dividing ``row_bytes``, the address ``base`` and every byte
    offset from it: the copy's item."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0 and base % size == 0 and not np.any(offsets % size):
            return dtype
    return torch.uint8


def plan_installs(ids: torch.Tensor, rows: dict[str, torch.Tensor], now: torch.Tensor, scratch: torch.Tensor,
                  sel: torch.Tensor, count: torch.Tensor, *, bump: bool) -> None:
    """One layer's installs decided on the device (module docstring, step 1).

    Args:
        ids: ``[T, k]`` routed expert ids.
        rows: the layer's ``[E + 1]`` int64 rows ``pos`` (pool position of each expert, -1: not resident),
            ``stamp`` / ``owner`` / ``off`` (per pool position: last use, expert held or -1, slot byte offset),
            ``table`` and ``home`` (per expert: byte offset read by the fused kernel, bank row offset).
        now: ``[1]`` int64 step stamp (incremented first when ``bump``).
        scratch: ``[2, E_PAD]`` int64 work space.
        sel: ``[M]`` int64 out: the expert installed at each rank ``< count``; ``M`` installs at most.
        count: ``[1]`` int64 out: the installs made (ranks ``[0, count)``).
    """
    num_e = rows["pos"].shape[0] - 1
    e_pad = scratch.shape[1]
    n = ids.numel()
    _plan_kernel[(1,)](ids.reshape(-1), n, scratch[0].view(torch.int32), scratch[1], rows["pos"], rows["stamp"],
                       rows["owner"], rows["table"], rows["home"], rows["off"], now, sel, count, num_e, sel.shape[0],
                       BUMP=bump, E_PAD=e_pad, N_PAD=triton.next_power_of_2(max(n, 2)), CAP=STAMP_CAP,
                       num_warps=4)


def copy_rows(base: torch.Tensor, sel: torch.Tensor, count: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
              row_bytes: int, programs: int) -> None:
    """For each rank ``j < count[0]``, with ``e = sel[j]``: copy ``row_bytes`` bytes from ``base + src[e]`` to
    ``base + dst[e]`` (byte offsets, int64). ``base`` is a one-row tensor viewed as the copy's item dtype
    (:func:`item_dtype`); offsets and ``row_bytes`` are multiples of its item size. ``programs``: the persistent
    grid (each program walks every ``programs``-th 32 KiB chunk). No host sync; capturable."""
    item = base.element_size()
    n_items = row_bytes // item
    block = CHUNK_BYTES // item
    _copy_rows_kernel[(programs,)](base, sel, count, src, dst, n_items, triton.cdiv(n_items, block), ITEM=item,
                                   BLOCK=block, num_warps=8)
