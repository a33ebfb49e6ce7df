"""Attention over the paged KV pool, behind one small interface.

A step's :class:`AttentionMetadata` (built once per step by the model runner, ``engine/model_runner.py``) says where
every sequence's tokens live: ``slot_mapping`` (the cache slot of each new token), ``block_table`` (each sequence's
pages), ``seq_lens`` (tokens after the step) and ``query_start_loc`` (where each sequence's new tokens start in the
flattened batch). A backend object, made per step from the pool and the metadata, is the
:class:`~ferrylm.models.attention.AttentionBackend` the model's layers call: it stores the layer's new K/V and
returns the attention of the step's queries.

Backends (``--attention-backend``):

* ``triton`` (``engine/attention/triton_paged.py``): one kernel for any mix of prefill chunks over a cached prefix
  and decode steps, reading K/V in place through the block table, GQA without expanding heads, memory linear in
  tokens; split-KV for decode. CUDA only (and Triton's CPU interpreter in tests).
* ``torch`` (:class:`~ferrylm.engine.kv_cache.PagedAttention`): gathers each sequence's K/V and calls SDPA; the
  CPU path and the test oracle.
* ``auto``: ``triton`` on a CUDA device when Triton imports, else ``torch``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ferrylm.config import ATTENTION_BACKENDS
from ferrylm.engine.kv_cache import KVPool, PagedAttention, SeqSlice
from ferrylm.faults import NO_FAULTS, FaultInjector

log = logging.getLogger("ferrylm.engine")

@dataclass
class AttentionMetadata:
    """Where a step's sequences live in the KV pool (device tensors) plus the host figures that size kernels.

    Attributes:
        slot_mapping: ``[T]`` int64 cache slot of each new token (``-1``: a padding row, nothing stored).
        block_table: ``[B, P]`` int32 pages of each sequence (row-major; columns past a sequence's pages unused).
        seq_lens: ``[B]`` int32 tokens of each sequence after this step (0: a padding sequence).
        query_start_loc: ``[B + 1]`` int32 offsets of each sequence's new tokens in the flattened batch.
        max_query_len: the most new tokens of one sequence (host int).
        num_splits: KV ranges per sequence for split-KV decode (1 = none).
        host_seqs: per sequence ``(q_len, ctx_len, page table)`` on the host, for the torch backend; None in
            captured graphs (the torch backend is not captured).
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    num_splits: int = 1
    host_seqs: list[tuple[int, int, list[int]]] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """KV splits for a decode step of ``num_seqs`` sequences: the power of two that gives about two programs per
    multiprocessor (``num_seqs * num_kv_heads * splits ~ 2 * num_sms``), in ``[1, max_splits]``. Depends on host
    sizes only (the same for every replay of a captured batch size)."""
    want = max(1, (2 * num_sms) // max(1, num_seqs * num_kv_heads))
    splits = 1
    while splits * 2 <= min(want, max_splits):
        splits *= 2
    return splits


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` on CUDA when Triton imports, else ``torch``; ``triton`` off CUDA is an error.

    Raises:
        ValueError: unknown name, or ``triton`` asked for where it cannot run (message names
            ``--attention-backend``).
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch":
        return "torch"
    ok = device.type == "cuda" and _triton_available()
    if name == "triton" and not ok:
        raise ValueError(f"--attention-backend triton needs a CUDA device and Triton (device {device}); use "
                         f"--attention-backend torch")
    return "triton" if ok else "torch"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


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
        self._torch: PagedAttention | None = None     # latent attention of steps with a prefill (attend_latent)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k/v [T, Hkv, D]`` -> ``[T, Hq, D]`` (see ``models/attention.py``)."""
        kc, vc, m = self.pool.k[layer_idx], self.pool.v[layer_idx], self.meta
        if self.faults.enabled:
            self.faults.check("attention_scratch", nbytes=4 * q.numel() * max(1, m.num_splits))
        self._k.store_kv(k, v, kc, vc, m.slot_mapping)
        return self._k.paged_attention(q, kc, vc, m.block_table, m.seq_lens, m.query_start_loc, scale=scale,
                                       page_size=self.pool.page_size, max_query_len=m.max_query_len,
                                       num_splits=m.num_splits)

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, proj, scale: float) -> torch.Tensor:
        """Multi-head latent attention (``models/latent_attention.py``). Decode-only steps (eager or captured):
        the rows stored by a Triton kernel that skips padding rows, then the absorbed decode kernel reading each
        sequence's rows in place through the block table (``triton_latent.py``). Steps with a prefill chunk: the
        torch backend's per-sequence dispatch (:meth:`~ferrylm.engine.kv_cache.PagedAttention.attend_latent`:
        absorbed or expanded), which needs ``meta.host_seqs``."""
        m = self.meta
        if m.max_query_len > 1:
            if self._torch is None:
                self._torch = torch_attention(self.pool, m, m.slot_mapping.device, self.faults)
            return self._torch.attend_latent(layer_idx, q_nope, q_pe, c_kv, k_pe, proj, scale)
        from ferrylm.engine.attention.triton_latent import latent_decode_attention, store_rows
        from ferrylm.models.latent_attention import latent_row

        kc = self.pool.k[layer_idx]
        if self.faults.enabled:
            self.faults.check("attention_scratch",
                              nbytes=4 * q_nope.shape[0] * q_nope.shape[1] * (proj.rank + 2) * m.num_splits)
        store_rows(latent_row(c_kv, k_pe)[:, 0].contiguous(), kc, m.slot_mapping)
        o = latent_decode_attention(proj.absorb_query(q_nope), q_pe, kc, m.block_table, m.seq_lens, scale,
                                    self.pool.page_size, num_splits=m.num_splits)
        return proj.value_out(o)


def torch_attention(pool: KVPool, meta: AttentionMetadata, device: torch.device,
                    faults: FaultInjector = NO_FAULTS) -> PagedAttention:
    """The torch reference backend for ``meta`` (needs ``meta.host_seqs``): per sequence, its slots from its page
    table, then :class:`~ferrylm.engine.kv_cache.PagedAttention`."""
    ps = pool.page_size
    seqs, q_start = [], 0
    for q_len, ctx_len, pages in meta.host_seqs:
        end = ctx_len + q_len
        pt = torch.tensor(pages, dtype=torch.long)
        slots = (pt[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:end]
        seqs.append(SeqSlice(q_start=q_start, q_len=q_len, ctx_len=ctx_len, slots=slots.to(device)))
        q_start += q_len
    return PagedAttention(pool, seqs, device, faults=faults)


def make_backend(name: str, pool: KVPool, meta: AttentionMetadata, device: torch.device,
                 faults: FaultInjector = NO_FAULTS):
    """The attention backend object of a step: ``name`` is a resolved backend (``triton`` or ``torch``)."""
    if name == "triton":
        return TritonPagedAttention(pool, meta, faults)
    return torch_attention(pool, meta, device, faults)
