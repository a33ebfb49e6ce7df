"""Triton kernel for the latent KV pool of multi-head latent attention (``models/latent_attention.py``): the store of
each new token's row ``[c_kv ; k_pe]`` into its slot, skipping padding rows (slot ``-1``) of a captured batch, which
a torch ``index_copy_`` cannot do without a host decision. The attention itself runs in torch ops
(``TritonPagedAttention.attend_latent``).

Imported only where Triton and CUDA are (or under ``TRITON_INTERPRET=1`` in tests), as ``triton_paged``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
