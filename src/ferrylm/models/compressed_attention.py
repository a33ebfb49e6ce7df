"""DeepSeek-V4's compressed sparse attention: the math every backend shares (DeepSeek-AI 2026, "DeepSeek-V4", §2.3;
transformers' ``modeling_deepseek_v4``).

Each attention layer has one key/value head (keys are values, ``D`` dims) and sees, per query at position ``p``:

* the *window*: the rows of positions ``p - window < j <= p`` (``sliding_window`` tokens, itself included);
* the *compressed entries* of a compressing layer: entry ``e`` pools the tokens of window ``e`` (positions
  ``e m .. e m + m - 1``, ``m`` the layer's rate) by a per-dim softmax over ``gate + position_bias`` of the
  projections ``kv`` (HCA, m = 128); a CSA layer (m = 4) pools two series: the ``b`` half of window ``e`` and the
  ``a`` half of window ``e - 1`` (width ``2m``, stride ``m``). Entry ``e`` is visible once its window is complete
  (``e < (p + 1) // m``); a CSA query sees only the ``index_topk`` entries its lightning indexer scores highest
  (the indexer pools its own keys the same way at ``index_head_dim``);
* one attention-sink logit per head.

Compression runs online, so a sequence can be fed in chunks of any size: the open window's partial pools are a
:class:`Carry` per series (``lse`` and the softmax-weighted mean ``val``, float32; merging a carry is adding one
virtual token of logit ``lse`` and value ``val``), exact up to float rounding.

How a backend stores a sequence's rows is its own business (:class:`SequenceState`); :func:`attend_sequence` is the
per-sequence algorithm over that storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ferrylm.models.attention import sink_attention

NEG_INF = float("-inf")


@dataclass
class Carry:
    """The open window's pools of one sequence and compressor: ``lse [2, D]``, ``val [2, D]`` float32; row 0 pools
    the entry of the open window so far, row 1 the next entry (its ``a`` series, overlap only)."""

    lse: torch.Tensor
    val: torch.Tensor

    @staticmethod
    def empty(dim: int, device: torch.device | str) -> "Carry":
        return Carry(torch.full((2, dim), NEG_INF, device=device), torch.zeros(2, dim, device=device))


class Compressor(Protocol):
    """A layer's compressor (or indexer compressor), as the backends see it."""

    rate: int      # m
    overlap: bool  # two series (CSA, the indexer) or one (HCA)
    dim: int       # D of an entry

    def finish(self, pooled: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """``pooled [n, D]`` float32 pools of the entries numbered ``entries [n]`` (int64) -> normed, rotated (at
        positions ``entries * rate``) ``[n, D]`` in the model dtype."""
        ...


def compress_chunk(kv: torch.Tensor, score: torch.Tensor, start: int, comp: Compressor,
                   carry: Carry) -> tuple[torch.Tensor, Carry]:
    """Pool one sequence's new tokens.

    Args:
        kv: ``[n, S * D]`` the compressor's ``kv`` projections of positions ``start .. start + n - 1`` (``S = 2``
            with overlap: ``a`` then ``b`` series); score: the same shape, ``gate + position_bias`` in float32.
        carry: the pools before ``start`` (:meth:`Carry.empty` at 0).

    Returns:
        ``(pooled [c, D] float32, carry)``: the entries whose window closes in the chunk (entries
        ``start // m .. (start + n) // m - 1``, before :meth:`Compressor.finish`) and the pools after it.
    """
    m, d, n = comp.rate, comp.dim, kv.shape[0]
    w0, end = start // m, start + n
    count = (end - 1) // m + 2 - w0
    width = 1 + (2 * m if comp.overlap else m)
    logit = kv.new_full((count, width, d), NEG_INF, dtype=torch.float32)
    value = kv.new_zeros((count, width, d), dtype=torch.float32)
    logit[0, 0], value[0, 0] = carry.lse[0], carry.val[0]
    if comp.overlap:
        logit[1, 0], value[1, 0] = carry.lse[1], carry.val[1]
    pos = torch.arange(start, end, device=kv.device)
    e, r = pos // m - w0, pos % m
    kv, score = kv.float(), score.float()
    if comp.overlap:
        logit[e, 1 + r], value[e, 1 + r] = score[:, d:], kv[:, d:]
        logit[e + 1, 1 + m + r], value[e + 1, 1 + m + r] = score[:, :d], kv[:, :d]
    else:
        logit[e, 1 + r], value[e, 1 + r] = score, kv
    lse = torch.logsumexp(logit, dim=1)                                   # [count, D]
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    val = (torch.exp(logit - safe[:, None]) * value).sum(1)
    closed = end // m - w0
    nxt = Carry(lse[closed:closed + 2], val[closed:closed + 2])
    if nxt.lse.shape[0] < 2:                                              # the chunk ended on a window boundary
        nxt = Carry(torch.cat((nxt.lse, lse.new_full((1, d), NEG_INF))), torch.cat((nxt.val, val.new_zeros(1, d))))
    return val[:closed], nxt


@dataclass
class IndexerQuery:
    """The lightning indexer's side of a CSA layer for the step's tokens.

    Attributes:
        compressor: the indexer's own compressor (:class:`Compressor`, overlap, ``index_head_dim``).
        kv, score: ``[T, 2 * Di]`` its projections (as :func:`compress_chunk`).
        q: ``[T, Hi, Di]`` rotated indexer queries; weights: ``[T, Hi]`` float32 head weights (scaled).
        topk: entries kept per query.
    """

    compressor: Compressor
    kv: torch.Tensor
    score: torch.Tensor
    q: torch.Tensor
    weights: torch.Tensor
    topk: int


@dataclass
class CompressedBranch:
    """Everything but the window rows that one layer's attention needs (built per call by the layer).

    Attributes:
        window: ``sliding_window``; sinks: ``[H]`` float32; scale: softmax scale.
        compressor: the layer's :class:`Compressor` (None: a sliding-only layer); kv, score: its inputs ``[T, S*D]``.
        indexer: a CSA layer's :class:`IndexerQuery` (None: every visible entry is attended).
    """

    window: int
    sinks: torch.Tensor
    scale: float
    compressor: Compressor | None = None
    kv: torch.Tensor | None = None
    score: torch.Tensor | None = None
    indexer: IndexerQuery | None = None


class SequenceState(Protocol):
    """One sequence's rows of one layer, as a backend stores them. Names: ``"compressor"``, ``"indexer"``."""

    def write_window(self, start: int, rows: torch.Tensor) -> None:
        """Store ``rows [n, D]`` at positions ``start .. start + n - 1``."""
        ...

    def window_rows(self, lo: int, hi: int) -> torch.Tensor:
        """The rows of positions ``lo .. hi - 1`` ``[hi - lo, D]``."""
        ...

    def carry(self, name: str, start: int, dim: int) -> Carry:
        """The pools before position ``start`` (entries of ``dim``): the carry :func:`compress_chunk` returned for the
        chunk that ended there (empty at 0)."""
        ...

    def write_entries(self, name: str, first: int, entries: torch.Tensor, end: int, carry: Carry) -> None:
        """Store finished ``entries`` (``first ..``) and the pools after position ``end``."""
        ...

    def entries(self, name: str, count: int) -> torch.Tensor:
        """Entries ``0 .. count - 1`` ``[count, D]``."""
        ...


def _compress(state: SequenceState, name: str, comp: Compressor, kv: torch.Tensor, score: torch.Tensor,
              start: int) -> torch.Tensor:
    """Pool the chunk into ``state``; return every entry visible at the chunk's end ``[(start + n) // m, D]``."""
    end = start + kv.shape[0]
    pooled, carry = compress_chunk(kv, score, start, comp, state.carry(name, start, comp.dim))
    first = start // comp.rate
    numbers = torch.arange(first, first + pooled.shape[0], device=pooled.device)
    state.write_entries(name, first, comp.finish(pooled, numbers), end, carry)
    return state.entries(name, end // comp.rate)


def indexer_select(ix: IndexerQuery, keys: torch.Tensor, rows: slice, positions: torch.Tensor,
                   rate: int) -> torch.Tensor:
    """``[n, c]`` bool: the entries each query keeps (top-``k`` of ``sum_h w_h relu(q_h . k) / sqrt(Di)`` among the
    visible ones; of equal scores the earlier entries, so the choice does not depend on how a prompt was chunked).
    ``keys [c, Di]``; ``positions [n]`` of the query rows ``rows``."""
    q = ix.q[rows].float()                                                 # [n, Hi, Di]
    scores = torch.relu(torch.einsum("nhd,cd->nhc", q, keys.float())) * q.shape[-1] ** -0.5
    scores = (scores * ix.weights[rows].float()[..., None]).sum(1)         # [n, c]
    visible = torch.arange(keys.shape[0], device=keys.device)[None, :] < ((positions + 1) // rate)[:, None]
    scores = scores.masked_fill(~visible, NEG_INF)
    k = min(ix.topk, keys.shape[0])
    if k == 0:
        return visible
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]   # equal scores: lower entry first
    return torch.zeros_like(visible).scatter_(1, top, True) & visible


def attend_sequence(state: SequenceState, q: torch.Tensor, kv: torch.Tensor, branch: CompressedBranch, rows: slice,
                    start: int) -> torch.Tensor:
    """One sequence's new tokens (batch rows ``rows``, positions ``start ..``): store their rows, pool, select and
    attend. ``q [T, H, D]``, ``kv [T, D]`` the whole step's -> ``[n, H, D]``."""
    n = rows.stop - rows.start
    state.write_window(start, kv[rows])
    lo = max(0, start - branch.window + 1)
    keys = state.window_rows(lo, start + n)                                # [L, D]
    qpos = torch.arange(start, start + n, device=q.device)
    kpos = torch.arange(lo, start + n, device=q.device)
    mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - branch.window)
    comp = branch.compressor
    if comp is not None:
        entries = _compress(state, "compressor", comp, branch.kv[rows], branch.score[rows], start)
        if branch.indexer is not None:
            ix = branch.indexer
            ikeys = _compress(state, "indexer", ix.compressor, ix.kv[rows], ix.score[rows], start)
            seen = indexer_select(ix, ikeys, rows, qpos, comp.rate)
        else:
            seen = torch.arange(entries.shape[0], device=q.device)[None, :] < ((qpos + 1) // comp.rate)[:, None]
        keys = torch.cat((keys, entries.to(keys.dtype)))
        mask = torch.cat((mask, seen), dim=1)
    qh = q[rows].transpose(0, 1)                                           # [H, n, D]
    kh = keys[None].expand(qh.shape[0], -1, -1)
    out = sink_attention(qh, kh, kh, mask[None], branch.scale, branch.sinks[:, None])
    return out.transpose(0, 1)


class DictSequenceState:
    """:class:`SequenceState` in plain tensors (one sequence, no pages): the reference backends' storage."""

    def __init__(self):
        self.rows: torch.Tensor | None = None
        self._entries: dict[str, torch.Tensor] = {}
        self._carry: dict[str, tuple[int, Carry]] = {}

    def write_window(self, start: int, rows: torch.Tensor) -> None:
        kept = rows if self.rows is None else self.rows[:start]
        self.rows = rows if self.rows is None else torch.cat((kept, rows))

    def window_rows(self, lo: int, hi: int) -> torch.Tensor:
        return self.rows[lo:hi]

    def carry(self, name: str, start: int, dim: int) -> Carry:
        end, carry = self._carry.get(name, (0, None))
        if carry is None or start == 0:
            return Carry.empty(dim, self.rows.device)
        if end != start:
            raise ValueError(f"{name}: the carry is after position {end}, asked at {start}")
        return carry

    def write_entries(self, name: str, first: int, entries: torch.Tensor, end: int, carry: Carry) -> None:
        old = self._entries.get(name)
        self._entries[name] = entries if old is None else torch.cat((old[:first], entries))
        self._carry[name] = (end, carry)

    def entries(self, name: str, count: int) -> torch.Tensor:
        return self._entries[name][:count]
