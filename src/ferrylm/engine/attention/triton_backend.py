"""The ``triton`` attention backend: the paged attention kernels (``triton_paged.py``, ``triton_latent.py`` for MLA,
``triton_compress.py`` / ``triton_compressed.py`` for DeepSeek-V4) reading the pool in place through the block table.
CUDA only (and Triton's CPU interpreter in tests)."""

from __future__ import annotations

import torch

from ferrylm.engine.attention.metadata import AttentionMetadata
from ferrylm.engine.attention.torch_backend import PagedAttention, torch_attention
from ferrylm.engine.cache.kv_pool import KVPool
from ferrylm.faults import NO_FAULTS, FaultInjector


class TritonPagedAttention:
    """:class:`~ferrylm.models.attention.AttentionBackend` over a :class:`KVPool` with the Triton kernels.

    Args:
        pool: the KV pool (layer ``i``: ``pool.k[i]``, ``pool.v[i]`` ``[num_slots, Hkv, D]``).
        meta: the step's metadata (its tensors may be a CUDA graph's static buffers).
        faults: point ``attention_scratch`` is checked before each call (eager steps only).
    """

    def __init__(self, pool: KVPool, meta: AttentionMetadata, faults: FaultInjector = NO_FAULTS):
        from ferrylm.engine.attention import triton_paged

        self.pool = pool
        self.meta = meta
        self.faults = faults
        self._k = triton_paged
        self._torch: PagedAttention | None = None     # attend_latent with a prefill; attend_indexed

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, *, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k/v [T, Hkv, D]`` -> ``[T, Hq, D]`` (see ``models/attention.py``)."""
        pool, m = self.pool, self.meta
        kc, vc = pool.k[layer_idx], pool.v[layer_idx]
        ks, vs = (pool.k_scale[layer_idx], pool.v_scale[layer_idx]) if pool.scaled else (None, None)
        if self.faults.enabled:
            self.faults.check("attention_scratch", nbytes=4 * q.numel() * max(1, m.num_splits))
        self._k.store_kv(k, v, kc, vc, m.slot_mapping, ks, vs)
        return self._k.paged_attention(q, kc, vc, m.block_table, m.seq_lens, m.query_start_loc, scale=scale,
                                       page_size=pool.page_size, max_query_len=m.max_query_len,
                                       num_splits=m.num_splits, window=window, sinks=sinks, k_scale=ks, v_scale=vs)

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, proj, scale: float) -> torch.Tensor:
        """Multi-head latent attention (``models/latent_attention.py``). Decode-only steps (eager or captured):
        the rows stored by a Triton kernel that skips padding rows, then the absorbed decode kernel reading each
        sequence's rows in place through the block table (``triton_latent.py``). Steps with a prefill chunk: the
        torch backend's per-sequence dispatch (:meth:`~ferrylm.engine.attention.torch_backend.PagedAttention.attend_latent`:
        absorbed or expanded), which needs ``meta.host_seqs``."""
        m = self.meta
        if m.max_query_len > 1:
            if self._torch is None:
                self._torch = torch_attention(self.pool, m, m.slot_mapping.device, self.faults)
            return self._torch.attend_latent(layer_idx, q_nope, q_pe, c_kv, k_pe, proj, scale)
        from ferrylm.engine.attention.triton_latent import latent_decode_attention, store_rows
        from ferrylm.models.latent_attention import latent_row

        kc = self.pool.k[layer_idx]
        rs = self.pool.k_scale[layer_idx] if self.pool.scaled else None
        if self.faults.enabled:
            self.faults.check("attention_scratch",
                              nbytes=4 * q_nope.shape[0] * q_nope.shape[1] * (proj.rank + 2) * m.num_splits)
        store_rows(latent_row(c_kv, k_pe)[:, 0].contiguous(), kc, m.slot_mapping, rs)
        o = latent_decode_attention(proj.absorb_query(q_nope), q_pe, kc, m.block_table, m.seq_lens, scale,
                                    self.pool.page_size, num_splits=m.num_splits, row_scale=rs)
        return proj.value_out(o)


    def attend_compressed(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor, branch) -> torch.Tensor:
        """DeepSeek-V4's compressed sparse attention (``models/compressed_attention.py``) for the whole step in the
        kernels of ``triton_compress.py`` / ``triton_compressed.py`` over the pool's pages (eager or captured): ``q
        [T, H, D]``, ``kv [T, D]`` -> ``[T, H, D]``."""
        from ferrylm.engine.attention.triton_compressed import compressed_attention

        if self.faults.enabled:
            self.faults.check("attention_scratch", nbytes=4 * q.numel() + 8 * kv.shape[0] * q.shape[1])
        return compressed_attention(self.pool, self.meta, layer_idx, q, kv, branch)

    def attend_indexed(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       index) -> torch.Tensor:
        """Indexer-selected attention (``models/indexed_attention.py``): the torch backend's per-sequence path
        (needs ``meta.host_seqs``, so eager steps only)."""
        if self._torch is None:
            self._torch = torch_attention(self.pool, self.meta, self.meta.slot_mapping.device, self.faults)
        return self._torch.attend_indexed(layer_idx, q, k, v, scale, index)


def triton_attention(pool: KVPool, meta: AttentionMetadata, device: torch.device,
                     faults: FaultInjector = NO_FAULTS) -> TritonPagedAttention:
    """The ``triton`` backend for a step (``device``: the pool's, read from ``meta``'s tensors)."""
    return TritonPagedAttention(pool, meta, faults)
