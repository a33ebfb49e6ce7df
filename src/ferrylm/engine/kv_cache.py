"""Paged KV cache: one pool of fixed-size pages per layer, a free-list allocator, and paged attention.

Layout (PagedAttention, Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention"): the K and V caches of every layer are ``[num_pages * page_size, num_kv_heads, head_dim]``
tensors allocated once at boot. A request owns a *page table* (list of page ids); token ``i`` of the request lives
in slot ``page_table[i // page_size] * page_size + i % page_size``. The allocator (``engine/page_allocator.py``)
hands out whole pages, reference-counted so full pages can be shared by prefix caching.

This module holds the correct torch implementation used on CPU and CUDA; a fused GPU kernel can replace
:meth:`PagedAttention.attend` later without changing the contract.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ferrylm.engine.page_allocator import OutOfPages, PageAllocator  # noqa: F401 (re-exported)
from ferrylm.faults import NO_FAULTS, FaultInjector
from ferrylm.models.attention import causal_attention

CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class KVLayout:
    """What one token stores in the pool, per layer that has attention state.

    Attributes:
        num_layers: decoder layers of the model (the pool's per-layer lists are indexed by layer number).
        layers: the layers that store K/V (a linear-attention layer of a hybrid stores none: its pool entries
            are empty tensors).
        k_heads, k_dim: the K tensor of one token of one layer is ``[k_heads, k_dim]``.
        v_heads, v_dim: the V tensor likewise; ``v_heads == 0`` for a layout with one cached tensor per token
            (multi-head latent attention keeps the compressed latent and the rope key in ``k`` only).

    A model class may define ``kv_layout(config) -> KVLayout``; :meth:`of` asks it, else every layer stores
    ``num_kv_heads x head_dim`` K and V.
    """

    num_layers: int
    layers: tuple[int, ...]
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int

    @staticmethod
    def standard(config) -> "KVLayout":
        """Every layer stores K and V of ``num_kv_heads x head_dim`` (``config``: a ModelConfig)."""
        return KVLayout(num_layers=config.num_layers, layers=tuple(range(config.num_layers)),
                        k_heads=config.num_kv_heads, k_dim=config.head_dim, v_heads=config.num_kv_heads,
                        v_dim=config.head_dim)

    @staticmethod
    def of(config) -> "KVLayout":
        """The layout of ``config``'s architecture (its model class's ``kv_layout`` when it has one)."""
        from ferrylm.models.registry import MODEL_REGISTRY, get_model_class

        if config.architecture in MODEL_REGISTRY:
            cls = get_model_class(config.architecture)
            if hasattr(cls, "kv_layout"):
                return cls.kv_layout(config)
        return KVLayout.standard(config)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token takes across all layers that store K/V."""
        per_layer = self.k_heads * self.k_dim + self.v_heads * self.v_dim
        return len(self.layers) * per_layer * torch.empty((), dtype=dtype).element_size()


class KVPool:
    """The cached tensors of every layer: ``k[layer]`` ``[num_pages * page_size, k_heads, k_dim]`` and ``v[layer]``
    ``[num_pages * page_size, v_heads, v_dim]`` (empty ``[0]`` tensors for layers outside ``layout.layers``).

    Memory: ``num_pages * page_size * layout.bytes_per_token(dtype)`` bytes.
    """

    def __init__(self, *, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        slots = num_pages * page_size
        stored = set(layout.layers)

        def tensor(i: int, heads: int, dim: int) -> torch.Tensor:
            if i not in stored or heads == 0:
                return torch.empty(0, dtype=dtype, device=device)
            return torch.zeros(slots, heads, dim, dtype=dtype, device=device)

        self.k = [tensor(i, layout.k_heads, layout.k_dim) for i in range(layout.num_layers)]
        self.v = [tensor(i, layout.v_heads, layout.v_dim) for i in range(layout.num_layers)]
        self.allocator = PageAllocator(num_pages)

    @property
    def num_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_pages * self.page_size


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, without dispatching a no-op ``.to`` (host time on the per-layer hot path)."""
    return t if t.dtype == dtype else t.to(dtype)

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


def slots_for(page_table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """Cache slots of token positions ``start .. end - 1`` under ``page_table``."""
    return [page_table[i // page_size] * page_size + i % page_size for i in range(start, end)]


class PagedAttention:
    """AttentionBackend over a :class:`KVPool` for one step's batch.

    Built by the engine per step. ``attend`` writes the step's new K/V into their slots, then computes causal
    attention per sequence over the gathered cached + new K/V. Decode sequences (``q_len == 1``) are batched in
    one padded SDPA call; prefill chunks run one SDPA call each. ``faults``: point ``attention_scratch``, checked
    before each gather (after the K/V write, as a real failure there would leave it).
    """

    def __init__(self, pool: KVPool, seqs: list[SeqSlice], device: torch.device | str,
                 faults: FaultInjector = NO_FAULTS):
        self.pool = pool
        self.seqs = seqs
        self.faults = faults
        self.new_slots = torch.cat([s.slots[s.ctx_len:] for s in seqs]) if seqs else torch.empty(0, dtype=torch.long)
        self.new_slots = self.new_slots.to(device)
        self.decode = [s for s in seqs if s.q_len == 1 and s.ctx_len > 0]
        self.prefill = [s for s in seqs if not (s.q_len == 1 and s.ctx_len > 0)]
        if self.decode:
            host_lens = [s.ctx_len + 1 for s in self.decode]
            max_len = max(host_lens)  # from the host list: no device->host sync
            lens = torch.tensor(host_lens).to(device, non_blocking=True)
            pad = torch.zeros(len(self.decode), max_len, dtype=torch.long, device=device)
            for i, s in enumerate(self.decode):
                pad[i, : s.ctx_len + 1] = s.slots
            self.decode_slots = pad                                               # [B, L]
            # no mask when every sequence has the same length (batch 1 always): SDPA may then pick flash attention
            same = len({s.ctx_len for s in self.decode}) == 1
            self.decode_mask = None if same else torch.arange(max_len, device=device)[None, :] < lens[:, None]
            self.decode_q_idx = torch.tensor([s.q_start for s in self.decode], device=device)
        # a step of decodes only, in batch order: attention output is the decode output, no scatter
        self.decode_only = not self.prefill and [s.q_start for s in self.decode] == list(range(len(self.decode)))

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """See :class:`ferrylm.models.attention.AttentionBackend`. Shapes ``q [T,Hq,D]``, ``k/v [T,Hkv,D]``.

        On CUDA the cuDNN SDPA kernel is excluded: it builds a new plan for every new KV length (~7 ms per decode
        attention call measured on the H200 machine, torch 2.11); flash / memory-efficient / math have no such
        cost.
        """
        if q.is_cuda:
            with sdpa_kernel(CUDA_SDPA_BACKENDS):
                return self._attend(layer_idx, q, k, v, scale)
        return self._attend(layer_idx, q, k, v, scale)

    def _attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        kc, vc = self.pool.k[layer_idx], self.pool.v[layer_idx]
        kc.index_copy_(0, self.new_slots, _as(k, kc.dtype))
        vc.index_copy_(0, self.new_slots, _as(v, vc.dtype))
        faults = self.faults
        if self.decode_only:
            if faults.enabled:
                faults.check("attention_scratch", nbytes=2 * self.decode_slots.numel() * k.shape[1] * k.shape[2]
                             * kc.element_size())
            return self._decode(q, kc, vc, scale)
        out = torch.empty_like(q)
        for s in self.prefill:
            if faults.enabled:
                faults.check("attention_scratch", nbytes=2 * s.slots.numel() * k.shape[1] * k.shape[2]
                             * kc.element_size() + 4 * q.shape[1] * s.q_len * s.slots.numel())
            ks, vs = kc[s.slots], vc[s.slots]
            qs = q[s.q_start: s.q_start + s.q_len]
            out[s.q_start: s.q_start + s.q_len] = causal_attention(qs, ks.to(q.dtype), vs.to(q.dtype), scale,
                                                                   q_offset=s.ctx_len)
        if self.decode:
            if faults.enabled:
                faults.check("attention_scratch", nbytes=2 * self.decode_slots.numel() * k.shape[1] * k.shape[2]
                             * kc.element_size())
            out[self.decode_q_idx] = self._decode(q, kc, vc, scale)
        return out

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float) -> torch.Tensor:
        qd = q if self.decode_only else q[self.decode_q_idx]       # [B, Hq, D]
        kd = _as(kc[self.decode_slots], q.dtype)                    # [B, L, Hkv, D]
        vd = _as(vc[self.decode_slots], q.dtype)
        group = qd.shape[1] // kd.shape[2]
        mask = None if self.decode_mask is None else self.decode_mask[:, None, None, :]  # [B, 1, 1, L]
        if group > 1 and mask is not None:  # masked GQA: expand the K/V heads (enable_gqa needs no mask on CUDA)
            kd = kd.repeat_interleave(group, dim=2)
            vd = vd.repeat_interleave(group, dim=2)
        o = torch.nn.functional.scaled_dot_product_attention(
            qd[:, :, None, :], kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=mask, scale=scale,
            enable_gqa=group > 1 and mask is None)
        return o[:, :, 0, :]                                        # [B, Hq, D]

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, proj, scale: float) -> torch.Tensor:
        """Multi-head latent attention over a latent pool (``KVLayout`` with ``v_heads == 0``; the math in
        ``models/latent_attention.py``): stores ``[c_kv ; k_pe]`` ``[T, R + P]`` at the new tokens' slots, then per
        sequence: decodes batched, absorbed; a prefill chunk over its gathered prefix + chunk, absorbed or expanded
        (``absorb_wins``). Shapes ``q_nope [T, H, N]``, ``q_pe [T, H, P]``, ``c_kv [T, R]``, ``k_pe [T, P]`` ->
        ``[T, H, V]``."""
        from ferrylm.models.latent_attention import latent_chunk_attention, latent_decode, latent_row

        kc = self.pool.k[layer_idx]
        kc.index_copy_(0, self.new_slots, _as(latent_row(c_kv, k_pe), kc.dtype))
        faults, dt = self.faults, q_nope.dtype
        with sdpa_kernel(CUDA_SDPA_BACKENDS) if q_nope.is_cuda else contextlib.nullcontext():
            if self.decode_only:
                if faults.enabled:
                    faults.check("attention_scratch", nbytes=self.decode_slots.numel() * kc.shape[2] * kc.element_size())
                return latent_decode(q_nope, q_pe, _as(kc[self.decode_slots, 0], dt), proj, scale, self.decode_mask)
            out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], proj.w_uv.shape[1])
            for s in self.prefill:
                if faults.enabled:
                    faults.check("attention_scratch", nbytes=s.slots.numel() * kc.shape[2] * kc.element_size())
                sl = slice(s.q_start, s.q_start + s.q_len)
                out[sl] = latent_chunk_attention(q_nope[sl], q_pe[sl], _as(kc[s.slots, 0], dt), proj, scale,
                                                 q_offset=s.ctx_len)
            if self.decode:
                idx = self.decode_q_idx
                out[idx] = latent_decode(q_nope[idx], q_pe[idx], _as(kc[self.decode_slots, 0], dt), proj, scale,
                                         self.decode_mask)
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
               scale: float) -> torch.Tensor:
        """``q [B, Hq, D]``, ``k/v [B, Hkv, D]`` -> ``[B, Hq, D]`` (see ``models/attention.py``). Query head ``h``
        reads KV head ``h // G``, ``G = Hq // Hkv``. On CUDA without the cuDNN kernel, as
        :meth:`PagedAttention.attend`."""
        kc, vc = self.pool.k[layer_idx], self.pool.v[layer_idx]
        kc.index_copy_(0, self.new_slots, _as(k, kc.dtype))
        vc.index_copy_(0, self.new_slots, _as(v, vc.dtype))
        b, hq, d = q.shape
        hkv = k.shape[1]
        kd = _as(kc[self.slot_table], q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
        vd = _as(vc[self.slot_table], q.dtype).transpose(1, 2)
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

        kc = self.pool.k[layer_idx]
        kc.index_copy_(0, self.new_slots, _as(latent_row(c_kv, k_pe), kc.dtype))
        with sdpa_kernel(CUDA_SDPA_BACKENDS) if q_nope.is_cuda else contextlib.nullcontext():
            return latent_decode(q_nope, q_pe, _as(kc[self.slot_table, 0], q_nope.dtype), proj, scale,
                                 self.slot_mask)
