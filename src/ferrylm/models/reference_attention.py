"""Reference attention backends for one sequence (tests, parity runs): :class:`DenseCausalAttention` (the whole
prompt in one forward, no cache) and :class:`SequenceCacheAttention` (a growing per-layer cache, no pages). Each
implements :class:`~ferrylm.models.attention.AttentionBackend` with the reference math of every attention kind
(plain, latent, indexer-selected, DeepSeek-V4's compressed)."""

from __future__ import annotations

import torch

from ferrylm.models.attention import causal_attention
from ferrylm.models.compressed_attention import DictSequenceState, attend_sequence
from ferrylm.models.indexed_attention import indexed_sequence
from ferrylm.models.latent_attention import latent_chunk_attention, latent_row


class DenseCausalAttention:
    """One sequence, whole prompt in one forward, no cache. For parity tests against transformers."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, *, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return causal_attention(q, k, v, scale, window=window, sinks=sinks)

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, proj, scale: float) -> torch.Tensor:
        """MLA over the call's own tokens (``models/latent_attention.py``): ``[T, H, V]``."""
        return latent_chunk_attention(q_nope, q_pe, latent_row(c_kv, k_pe)[:, 0], proj, scale, q_offset=0)

    def attend_indexed(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       index) -> torch.Tensor:
        """Indexer-selected attention over the call's own tokens (``models/indexed_attention.py``)."""
        return indexed_sequence(q, k, v, index.q, index.k, index.selector, scale, q_offset=0)

    def attend_compressed(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor, branch) -> torch.Tensor:
        """DeepSeek-V4's attention over the call's own tokens (``models/compressed_attention.py``): ``[T, H, D]``."""
        return attend_sequence(DictSequenceState(), q, kv, branch, slice(0, q.shape[0]), 0)


class SequenceCacheAttention:
    """One sequence with a growing K/V cache (per layer, concatenated), no pages. The reference for chunked
    prefill + decode in tests: feed a prompt in chunks, then one token per call, positions continuing.

    Memory: grows by ``2 * T * Hkv * D`` elements per layer per call (``T`` new tokens); each call re-concatenates
    the cache, so it is O(length^2) over a sequence — a reference, not a serving path.
    """

    def __init__(self):
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}
        self.index_k: dict[int, list[torch.Tensor]] = {}
        self.compressed: dict = {}   # layer -> DictSequenceState (DeepSeek-V4)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, *, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """See :class:`~ferrylm.models.attention.AttentionBackend`; the new ``k``/``v`` ``[T, Hkv, D]`` follow everything cached."""
        ks, vs = self.k.setdefault(layer_idx, []), self.v.setdefault(layer_idx, [])
        offset = sum(t.shape[0] for t in ks)
        ks.append(k)
        vs.append(v)
        return causal_attention(q, torch.cat(ks), torch.cat(vs), scale, q_offset=offset, window=window,
                                sinks=sinks)

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, proj, scale: float) -> torch.Tensor:
        """MLA (``models/latent_attention.py``); the new latent rows ``[c_kv ; k_pe]`` follow everything cached
        (kept in ``k``; ``v`` stays empty for the layer)."""
        rows = self.k.setdefault(layer_idx, [])
        offset = sum(t.shape[0] for t in rows)
        rows.append(latent_row(c_kv, k_pe)[:, 0])
        return latent_chunk_attention(q_nope, q_pe, torch.cat(rows), proj, scale, q_offset=offset)

    def attend_indexed(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       index) -> torch.Tensor:
        """Indexer-selected attention (``models/indexed_attention.py``); the new K/V and raw index keys follow
        everything cached."""
        ks, vs = self.k.setdefault(layer_idx, []), self.v.setdefault(layer_idx, [])
        idx = self.index_k.setdefault(layer_idx, [])
        offset = sum(t.shape[0] for t in ks)
        ks.append(k)
        vs.append(v)
        idx.append(index.k)
        return indexed_sequence(q, torch.cat(ks), torch.cat(vs), index.q, torch.cat(idx), index.selector, scale,
                                q_offset=offset)

    def attend_compressed(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor, branch) -> torch.Tensor:
        """DeepSeek-V4's attention (``models/compressed_attention.py``); the new tokens follow everything cached
        (the layer's rows, entries and pools kept in a ``DictSequenceState``)."""
        state = self.compressed.setdefault(layer_idx, DictSequenceState())
        start = 0 if state.rows is None else state.rows.shape[0]
        return attend_sequence(state, q, kv, branch, slice(0, q.shape[0]), start)
