"""Triton kernel that pools DeepSeek-V4's compressed entries online for every sequence of a step at once (the math:
``models/compressed_attention.compress_chunk``; the storage: ``engine/attention/compressed_pages.py``).

Entry ``e`` of a sequence (rate ``m``, ``D`` dims) pools, per dim, the tokens of window ``e`` (positions ``e m .. e m +
m - 1``; with overlap their ``b`` series ``kv[:, D:]``, and also the ``a`` series ``kv[:, :D]`` of window ``e - 1``):
``lse = logsumexp(score)``, ``val = sum softmax(score) kv``. A chunk of new tokens at positions ``start .. end - 1``
touches entries ``start // m .. end // m + 1``: those below ``end // m`` close (finished by the model's
``Compressor.finish``, then stored in their block rows); ``end // m`` and ``end // m + 1`` are the open pools after
the chunk (the carry, stored in the row of block ``(end - 1) // m`` as ``[lse_0, lse_1, val_0, val_1]``). Entries
``start // m`` and ``start // m + 1`` start from the carry stored before the chunk (row of block ``(start - 1) // m``).

One program per (touched entry, block of dims). The programs of sequence ``s`` start at ``qsl[s] // m + 3 s`` (a chunk
of ``n`` tokens touches at most ``ceil(n / m) + 2`` entries), so the grid ``T // m + 3 B`` depends on host sizes only
(capturable). Each program writes its pooled ``lse`` / ``val`` and where they go (an entry row, a carry slot, or
nowhere: ``-1``) to per-step buffers, and the stores run after the kernel: a carry row read and rewritten by the same
step is read first. A padding sequence (``seq_len`` 0) writes nothing.

Block ``w`` of a sequence lives in row ``page * (page_size // m) + w % (page_size // m)`` with ``page`` its block-table
entry for position ``w m`` (``compressed_pages.py``).

Imported only where Triton and CUDA are (or under ``TRITON_INTERPRET=1`` in tests), as ``triton_paged``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrylm.engine.attention.metadata import AttentionMetadata
from ferrylm.engine.attention.triton_latent import store_rows
from ferrylm.engine.attention.triton_paged import MAX_SEQS_LOG2, block_row, find_seq
from ferrylm.engine.cache.kv_pool import KVPool

PROGRAMS_PER_SEQ = 3   # touched entries of a sequence beyond n // m (the module docstring)


@triton.jit
def _pool_kernel(kv_ptr, score_ptr, carry_ptr, bt_ptr, lens_ptr, qsl_ptr, lse_ptr, val_ptr, dest_ptr,
                 num_seqs, num_programs, page_size, stride_kv, stride_score, stride_carry, stride_bt,
                 RATE: tl.constexpr, DIM: tl.constexpr, OVERLAP: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_D: tl.constexpr, PER_SEQ: tl.constexpr, LOG2_SEQS: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < DIM
    s = find_seq(pid, qsl_ptr, num_seqs, RATE, PER_SEQ, LOG2_SEQS)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    seq_len = tl.load(lens_ptr + s)
    start = tl.maximum(seq_len - q_len, 0)
    end = seq_len
    e = start // RATE + pid - (q_start // RATE + PER_SEQ * s)   # the entry this program pools
    live = (seq_len > 0) & (q_len > 0) & (e <= end // RATE + 1)
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt

    r = tl.arange(0, ROWS)
    if OVERLAP:   # rows 0 .. m - 1: the a series of window e - 1; rows m .. 2m - 1: the b series of window e
        pos = e * RATE - RATE + r
        col = tl.where(r >= RATE, DIM, 0)
        r_ok = r < 2 * RATE
    else:
        pos = e * RATE + r
        col = r * 0
        r_ok = r < RATE
    t_ok = r_ok & (pos >= start) & (pos < end) & live
    tok = (q_start + pos - start).to(tl.int64)
    m2 = t_ok[:, None] & d_ok[None, :]
    logit = tl.load(score_ptr + tok[:, None] * stride_score + col[:, None] + d[None, :], mask=m2,
                    other=float("-inf")).to(tl.float32)
    value = tl.load(kv_ptr + tok[:, None] * stride_kv + col[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)

    j = e - start // RATE          # 0, 1: starts from the pools stored before the chunk
    has_carry = live & (start > 0) & (j < 2)
    c_row = block_row(bt_row, tl.maximum(start - 1, 0) // RATE, page_size, RATE)
    c_base = carry_ptr + c_row * stride_carry
    c_lse = tl.load(c_base + j * DIM + d, mask=d_ok & has_carry, other=float("-inf"))
    c_val = tl.load(c_base + (2 + j) * DIM + d, mask=d_ok & has_carry, other=0.0)

    top = tl.maximum(tl.max(logit, 0), c_lse)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(logit - top[None, :])
    wc = tl.exp(c_lse - top)
    den = tl.sum(w, 0) + wc
    lse = tl.where(den > 0.0, top + tl.log(tl.where(den > 0.0, den, 1.0)), float("-inf"))
    val = (tl.sum(w * value, 0) + wc * c_val) / tl.where(den > 0.0, den, 1.0)
    tl.store(lse_ptr + pid.to(tl.int64) * DIM + d, lse, mask=d_ok)
    tl.store(val_ptr + pid.to(tl.int64) * DIM + d, val, mask=d_ok)

    if tl.program_id(1) == 0:      # where the pools go: dest [3, G] = entry row, carry slot, entry number
        closed = live & (e < end // RATE)
        last = tl.maximum(end - 1, 0) // RATE       # the block of the last position: within the block table
        e_row = block_row(bt_row, tl.minimum(tl.maximum(e, 0), last), page_size, RATE)
        tl.store(dest_ptr + pid, tl.where(closed, e_row, -1))
        k = e - end // RATE
        after = block_row(bt_row, last, page_size, RATE)
        tl.store(dest_ptr + num_programs + pid, tl.where(live & (k >= 0) & (k < 2), after * 4 + k, -1))
        tl.store(dest_ptr + 2 * num_programs + pid, tl.maximum(e, 0).to(tl.int64))


def pool_entries(pool: KVPool, layer: int, name: str, comp, kv: torch.Tensor, score: torch.Tensor,
                 meta: AttentionMetadata) -> None:
    """Pool the step's new tokens into layer ``layer``'s ``name`` cache (``compressor`` / ``indexer``): the entries
    that close, finished by ``comp`` (:class:`~ferrylm.models.compressed_attention.Compressor`), and the carries
    (module docstring). ``kv [T, S * D]`` (model dtype), ``score [T, S * D]`` float32, rows contiguous. No host
    sync; workspace ``(T // m + 3 B) * (2 D * 4 + 24)`` bytes plus ``finish``'s."""
    m, dim, t, b = comp.rate, comp.dim, kv.shape[0], meta.num_seqs
    if t == 0 or b == 0:
        return
    kv, score = kv.contiguous(), score.contiguous()
    g = t // m + PROGRAMS_PER_SEQ * b
    dev = kv.device
    lse = torch.empty(g, dim, dtype=torch.float32, device=dev)
    val = torch.empty(g, dim, dtype=torch.float32, device=dev)
    dest = torch.empty(3, g, dtype=torch.int64, device=dev)
    carry = pool.blocks[(layer, f"{name}_carry")]
    rows = triton.next_power_of_2((2 if comp.overlap else 1) * m)
    block_d = max(16, min(triton.next_power_of_2(dim), 4096 // rows))
    _pool_kernel[(g, triton.cdiv(dim, block_d))](
        kv, score, carry, meta.block_table, meta.seq_lens, meta.query_start_loc, lse, val, dest, b, g,
        pool.page_size, kv.stride(0), score.stride(0), carry.stride(0), meta.block_table.stride(0),
        RATE=m, DIM=dim, OVERLAP=bool(comp.overlap), ROWS=rows, BLOCK_D=block_d, PER_SEQ=PROGRAMS_PER_SEQ,
        LOG2_SEQS=MAX_SEQS_LOG2)
    store_rows(comp.finish(val, dest[2]).contiguous(), pool.blocks[(layer, name)], dest[0])
    slots = carry.view(-1, dim)                        # carry row r, slot k: lse at 4 r + k, val at 4 r + 2 + k
    store_rows(lse, slots, dest[1])
    store_rows(val, slots, torch.where(dest[1] >= 0, dest[1] + 2, -1))
