"""The torch attention backends over the paged KV pool: gather each sequence's K/V and call SDPA. The CPU path,
the test oracle, and the fixed-shape decode of the decode CUDA graphs (``engine/decode_graph.py``).
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ferrylm.engine.attention.metadata import AttentionMetadata
from ferrylm.engine.cache.kv_pool import KVPool
from ferrylm.faults import NO_FAULTS, FaultInjector
from ferrylm.models.attention import causal_attention, sink_attention

if TYPE_CHECKING:
    from ferrylm.models.quant_linear import DenseKernel

CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class SeqSlice:
    """One sequence's part of a step: ``q_len`` new tokens after ``ctx_len`` cached ones.

    ``q_start`` is the offset of its first new token in the flattened batch; ``slots`` (``[ctx_len + q_len]``
    int64, on the pool's device) are the cache slots of all its tokens, new ones last.
    """

    q_start: int
    q_len: int
    ctx_len: int
    slots: torch.Tensor


class PagedAttention:
    """AttentionBackend over a :class:`KVPool` for one step's batch.

    Built by the engine per step. ``attend`` writes the step's new K/V into their slots, then computes causal
    attention per sequence over the gathered cached + new K/V (a sequence with nothing cached reads its new K/V as
    given, when the pool stores them exactly). Decode sequences (``q_len == 1``) are batched in
    one padded SDPA call, or, with ``native`` (a CPU's kernel build and threads), attend over the pool in place
    (``NativeExpertKernel.decode_attention``: no gather) where the pool is not fp8 and the layer has no window or
    sinks; prefill chunks run one SDPA call each. ``faults``: point ``attention_scratch``, checked before each
    gather (after the K/V write, as a real failure there would leave it).
    """

    def __init__(self, pool: KVPool, seqs: list[SeqSlice], device: torch.device | str,
                 faults: FaultInjector = NO_FAULTS, native: "DenseKernel | None" = None):
        self.pool = pool
        self.seqs = seqs
        self.faults = faults
        self.native = native
        self.new_slots = torch.cat([s.slots[s.ctx_len:] for s in seqs]) if seqs else torch.empty(0, dtype=torch.long)
        self.new_slots = self.new_slots.to(device)
        self.decode = [s for s in seqs if s.q_len == 1 and s.ctx_len > 0]
        self.prefill = [s for s in seqs if not (s.q_len == 1 and s.ctx_len > 0)]
        if self.decode:
            host_lens = [s.ctx_len + 1 for s in self.decode]
            max_len = max(host_lens)  # from the host list: no device->host sync
            lens = torch.tensor(host_lens).to(device, non_blocking=True)
            self.decode_lens = lens                                               # [B] int64
            pad = torch.zeros(len(self.decode), max_len, dtype=torch.long, device=device)
            for i, s in enumerate(self.decode):
                pad[i, : s.ctx_len + 1] = s.slots
            self.decode_slots = pad                                               # [B, L]
            # no mask when every sequence has the same length (batch 1 always): SDPA may then pick flash attention
            same = len({s.ctx_len for s in self.decode}) == 1
            self.decode_mask = None if same else torch.arange(max_len, device=device)[None, :] < lens[:, None]
            self.decode_q_idx = torch.tensor([s.q_start for s in self.decode], device=device)
            self.decode_held = torch.arange(max_len, device=device)[None, :] < lens[:, None]  # [B, L]
        # a step of decodes only, in batch order: attention output is the decode output, no scatter
        self.decode_only = not self.prefill and [s.q_start for s in self.decode] == list(range(len(self.decode)))

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, *, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """See :class:`ferrylm.models.attention.AttentionBackend`. Shapes ``q [T,Hq,D]``, ``k/v [T,Hkv,D]``.

        On CUDA the cuDNN SDPA kernel is excluded: it builds a new plan for every new KV length (milliseconds per
        decode attention call; docs/BENCHMARKS.md); flash / memory-efficient / math have no such cost.
        """
        if q.is_cuda:
            with sdpa_kernel(CUDA_SDPA_BACKENDS):
                return self._attend(layer_idx, q, k, v, scale, window, sinks)
        return self._attend(layer_idx, q, k, v, scale, window, sinks)

    def _attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        pool = self.pool
        pool.store(layer_idx, self.new_slots, k, v)
        elem = q.element_size()
        faults = self.faults
        if self.decode_only:
            if faults.enabled:
                faults.check("attention_scratch", nbytes=2 * self.decode_slots.numel() * k.shape[1] * k.shape[2]
                             * elem)
            return self._decode(layer_idx, q, scale, window, sinks)
        out = torch.empty_like(q)
        exact = not pool.scaled and k.dtype == v.dtype == q.dtype == pool.storage_dtype
        for s in self.prefill:
            if faults.enabled:
                faults.check("attention_scratch", nbytes=2 * s.slots.numel() * k.shape[1] * k.shape[2]
                             * elem + 4 * q.shape[1] * s.q_len * s.slots.numel())
            if s.ctx_len == 0 and exact:  # nothing cached before: the pool would give back these very K/V
                ks, vs = k[s.q_start: s.q_start + s.q_len], v[s.q_start: s.q_start + s.q_len]
            else:
                ks, vs = pool.keys(layer_idx, s.slots, q.dtype), pool.values(layer_idx, s.slots, q.dtype)
            qs = q[s.q_start: s.q_start + s.q_len]
            out[s.q_start: s.q_start + s.q_len] = causal_attention(qs, ks, vs, scale,
                                                                   q_offset=s.ctx_len, window=window, sinks=sinks)
        if self.decode:
            if faults.enabled:
                faults.check("attention_scratch", nbytes=2 * self.decode_slots.numel() * k.shape[1] * k.shape[2]
                             * elem)
            out[self.decode_q_idx] = self._decode(layer_idx, q, scale, window, sinks)
        return out

    def _decode(self, layer_idx: int, q: torch.Tensor, scale: float, window: int | None,
                sinks: torch.Tensor | None) -> torch.Tensor:
        qd = q if self.decode_only else q[self.decode_q_idx]       # [B, Hq, D]
        pool = self.pool
        if self.native is not None and window is None and sinks is None and not pool.scaled:
            o = self.native.native.decode_attention(qd.float(), pool.k[layer_idx], pool.v[layer_idx],
                                                    self.decode_slots, self.decode_lens, scale, self.native.threads)
            return o.to(q.dtype)
        kd = self.pool.keys(layer_idx, self.decode_slots, q.dtype)      # [B, L, Hkv, D]
        vd = self.pool.values(layer_idx, self.decode_slots, q.dtype)
        if window is not None or sinks is not None:
            return windowed_decode(qd, kd, vd, self.decode_held, scale, window, sinks)
        b, hq, d = qd.shape
        hkv = kd.shape[2]
        mask = None if self.decode_mask is None else self.decode_mask[:, None, None, :]  # [B, 1, 1, L]
        # the G query heads of a KV head as its G query rows: no K/V expansion (on a CPU, SDPA's enable_gqa path
        # took ~15x as long at decode)
        o = torch.nn.functional.scaled_dot_product_attention(
            qd.reshape(b, hkv, hq // hkv, d), kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=mask, scale=scale)
        return o.reshape(b, hq, d)                                  # [B, Hq, D]

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, proj, scale: float) -> torch.Tensor:
        """Multi-head latent attention over a latent pool (``KVLayout`` with ``v_heads == 0``; the math in
        ``models/latent_attention.py``): stores ``[c_kv ; k_pe]`` ``[T, R + P]`` at the new tokens' slots, then per
        sequence: decodes batched, absorbed; a prefill chunk over its gathered prefix + chunk, absorbed or expanded
        (``absorb_wins``). Shapes ``q_nope [T, H, N]``, ``q_pe [T, H, P]``, ``c_kv [T, R]``, ``k_pe [T, P]`` ->
        ``[T, H, V]``."""
        from ferrylm.models.latent_attention import latent_chunk_attention, latent_decode, latent_row

        pool = self.pool
        pool.store(layer_idx, self.new_slots, latent_row(c_kv, k_pe))
        row_bytes = pool.k[layer_idx].shape[2] * q_nope.element_size()
        faults, dt = self.faults, q_nope.dtype
        with sdpa_kernel(CUDA_SDPA_BACKENDS) if q_nope.is_cuda else contextlib.nullcontext():
            if self.decode_only:
                if faults.enabled:
                    faults.check("attention_scratch", nbytes=self.decode_slots.numel() * row_bytes)
                return latent_decode(q_nope, q_pe, pool.keys(layer_idx, self.decode_slots, dt)[:, :, 0], proj, scale,
                                     self.decode_mask)
            out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], proj.w_uv.shape[1])
            for s in self.prefill:
                if faults.enabled:
                    faults.check("attention_scratch", nbytes=s.slots.numel() * row_bytes)
                sl = slice(s.q_start, s.q_start + s.q_len)
                out[sl] = latent_chunk_attention(q_nope[sl], q_pe[sl], pool.keys(layer_idx, s.slots, dt)[:, 0], proj,
                                                 scale, q_offset=s.ctx_len)
            if self.decode:
                idx = self.decode_q_idx
                out[idx] = latent_decode(q_nope[idx], q_pe[idx], pool.keys(layer_idx, self.decode_slots, dt)[:, :, 0],
                                         proj, scale, self.decode_mask)
            return out


    def attend_indexed(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       index) -> torch.Tensor:
        """Indexer-selected attention (``models/indexed_attention.IndexQuery``): stores the new K/V and raw index
        keys, then per sequence (decodes included) gathers its K/V and index keys and attends to the tokens its
        queries keep. Shapes as :meth:`attend`."""
        from ferrylm.models.indexed_attention import indexed_sequence

        pool, faults = self.pool, self.faults
        pool.store(layer_idx, self.new_slots, k, v)
        pool.store_index(layer_idx, self.new_slots, index.k)
        out = torch.empty_like(q)
        with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            for s in self.seqs:
                if faults.enabled:
                    faults.check("attention_scratch", nbytes=2 * s.slots.numel() * k.shape[1] * k.shape[2]
                                 * q.element_size() + 4 * q.shape[1] * s.q_len * s.slots.numel())
                sl = slice(s.q_start, s.q_start + s.q_len)
                out[sl] = indexed_sequence(q[sl], pool.keys(layer_idx, s.slots, q.dtype),
                                           pool.values(layer_idx, s.slots, q.dtype), index.q[sl],
                                           pool.index_keys(layer_idx, s.slots, q.dtype), index.selector, scale,
                                           q_offset=s.ctx_len)
        return out

    def attend_compressed(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor, branch) -> torch.Tensor:
        """DeepSeek-V4's attention over the pool (``models/compressed_attention.py``; storage
        ``engine/attention/compressed_pages.py``), sequence by sequence: ``q [T, H, D]``, ``kv [T, D]`` ->
        ``[T, H, D]``."""
        from ferrylm.engine.attention.compressed_pages import PagedSequenceState
        from ferrylm.models.compressed_attention import attend_sequence

        rates = {}
        if branch.compressor is not None:
            rates["compressor"] = branch.compressor.rate
        if branch.indexer is not None:
            rates["indexer"] = branch.indexer.compressor.rate
        out = torch.empty_like(q)
        for s in self.seqs:
            if self.faults.enabled:
                self.faults.check("attention_scratch", nbytes=s.slots.numel() * kv.shape[-1] * kv.element_size())
            rows = slice(s.q_start, s.q_start + s.q_len)
            state = PagedSequenceState(self.pool, layer_idx, s.slots, rates)
            out[rows] = attend_sequence(state, q, kv, branch, rows, s.ctx_len)
        return out


class StaticDecodeAttention:
    """AttentionBackend of a decode step with fixed shapes (the decode CUDA graphs, ``engine/decode_graph.py``):
    ``B`` sequences of one new token each, attending over the first ``L`` slots of a ``[B, L]`` slot table.

    Args:
        pool: the KV pool (``k``/``v`` ``[num_slots, Hkv, D]`` per layer).
        slot_table: ``[B, L]`` int64 cache slots of each sequence's positions ``0 .. L-1`` (past its length: any
            valid slot, masked).
        new_slots: ``[B]`` int64 slot of each new token.
        mask: ``[B, L]`` bool, True where the slot holds one of the sequence's tokens (new one included).
    """

    def __init__(self, pool: KVPool, slot_table: torch.Tensor, new_slots: torch.Tensor, mask: torch.Tensor):
        self.pool = pool
        self.slot_table = slot_table
        self.new_slots = new_slots
        self.mask = mask[:, None, None, :]  # [B, 1, 1, L]: broadcast over KV heads and query rows
        self.slot_mask = mask               # [B, L] (latent attention)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, *, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``q [B, Hq, D]``, ``k/v [B, Hkv, D]`` -> ``[B, Hq, D]`` (see ``models/attention.py``). Query head ``h``
        reads KV head ``h // G``, ``G = Hq // Hkv``. On CUDA without the cuDNN kernel, as
        :meth:`PagedAttention.attend`."""
        pool = self.pool
        pool.store(layer_idx, self.new_slots, k, v)
        kd = pool.keys(layer_idx, self.slot_table, q.dtype)      # [B, L, Hkv, D]
        vd = pool.values(layer_idx, self.slot_table, q.dtype)
        if window is not None or sinks is not None:
            return windowed_decode(q, kd, vd, self.slot_mask, scale, window, sinks)
        b, hq, d = q.shape
        hkv = k.shape[1]
        kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)           # [B, Hkv, L, D]
        qg = q.view(b, hkv, hq // hkv, d)                        # the G query heads of a KV head as its query rows
        with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            o = torch.nn.functional.scaled_dot_product_attention(qg, kd, vd, attn_mask=self.mask, scale=scale)
        return o.reshape(b, hq, d)

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, proj, scale: float) -> torch.Tensor:
        """Absorbed multi-head latent attention of the ``B`` new tokens over the latent pool
        (``models/latent_attention.py``): ``q_nope [B, H, N]``, ``q_pe [B, H, P]``, ``c_kv [B, R]``, ``k_pe [B, P]``
        -> ``[B, H, V]``; torch ops only, no host sync (capturable)."""
        from ferrylm.models.latent_attention import latent_decode, latent_row

        self.pool.store(layer_idx, self.new_slots, latent_row(c_kv, k_pe))
        rows = self.pool.keys(layer_idx, self.slot_table, q_nope.dtype)[:, :, 0]   # [B, L, R + P]
        with sdpa_kernel(CUDA_SDPA_BACKENDS) if q_nope.is_cuda else contextlib.nullcontext():
            return latent_decode(q_nope, q_pe, rows, proj, scale, self.slot_mask)


def windowed_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, held: torch.Tensor, scale: float,
                    window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One new token per sequence over its held positions, with a sliding window and / or attention sinks (see
    :meth:`~ferrylm.models.attention.AttentionBackend.attend`); torch ops only, no host sync (capturable).

    Args:
        q: ``[B, Hq, D]``; k, v: ``[B, L, Hkv, D]`` each sequence's positions ``0 .. L - 1``.
        held: ``[B, L]`` bool, True at the sequence's positions (the new token's, ``length - 1``, included).

    Returns:
        ``[B, Hq, D]``.
    """
    b, hq, d = q.shape
    hkv = k.shape[2]
    mask = held
    if window is not None:  # the new token sits at length - 1: it sees positions > length - 1 - window
        last = held.sum(1, keepdim=True) - 1
        mask = held & (torch.arange(held.shape[1], device=held.device)[None, :] > last - window)
    qg = q.view(b, hkv, hq // hkv, d)                    # the G query heads of a KV head as its query rows
    kd, vd, m = k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :]
    if sinks is None:
        o = torch.nn.functional.scaled_dot_product_attention(qg, kd, vd, attn_mask=m, scale=scale)
    else:
        o = sink_attention(qg, kd, vd, m, scale, sinks.view(hkv, hq // hkv))
    return o.reshape(b, hq, d)


def torch_attention(pool: KVPool, meta: AttentionMetadata, device: torch.device,
                    faults: FaultInjector = NO_FAULTS, native: "DenseKernel | None" = None) -> PagedAttention:
    """The torch reference backend for ``meta`` (needs ``meta.host_seqs``): per sequence, its slots from its page
    table, then :class:`PagedAttention` (``native``: its decode kernel on a CPU)."""
    ps = pool.page_size
    seqs, q_start = [], 0
    for q_len, ctx_len, pages in meta.host_seqs:
        end = ctx_len + q_len
        pt = torch.tensor(pages, dtype=torch.long)
        slots = (pt[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:end]
        seqs.append(SeqSlice(q_start=q_start, q_len=q_len, ctx_len=ctx_len, slots=slots.to(device)))
        q_start += q_len
    return PagedAttention(pool, seqs, device, faults=faults, native=native)
