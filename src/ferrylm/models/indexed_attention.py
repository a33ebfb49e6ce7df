"""Block-sparse attention chosen by a token indexer over compressed key blocks (Qwen4-Exp's "QSA"): the math
every attention backend shares.

A layer with an indexer caches, beside each token's K/V, one raw *index key* ``[Di]`` (the pool's
``KVLayout.index_dim``). For a query at position ``p`` the visible tokens ``0 .. p`` are cut into complete blocks of
``r`` consecutive tokens (``r = indexer_compress_ratio``; block ``b`` holds tokens ``b r .. b r + r - 1``) and an
incomplete tail. Each complete block is compressed to one key: the float32 mean of its raw index keys, cast back,
normed (zero-centred RMSNorm), RoPE at the block's first position. The query's index heads ``q_idx [Hi, Di]`` score a
block by ``sum_h relu(q_idx_h . k_b) / sqrt(Di)``; the ``budget / r`` best complete blocks and the tail are the
tokens the query attends to (all of them while the query sees no more blocks than that). Scores, the top-k and the
mask depend only on the sequence's tokens, so chunked prefill and decode select what a whole-sequence pass does.

Backends implement ``attend_indexed(layer_idx, q, k, v, scale, index: IndexQuery) -> [T, Hq, D]``: store the new
K/V and index keys, then per sequence ask ``index.selector.keep_mask`` which cached tokens each query reads and run
:func:`masked_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class BlockSelector(Protocol):
    """The indexer of one layer, as a backend sees it."""

    def keep_mask(self, q_idx: torch.Tensor, keys: torch.Tensor, q_offset: int) -> torch.Tensor:
        """``q_idx [Tq, Hi, Di]`` (queries at positions ``q_offset ..``), ``keys [L, Di]`` the sequence's raw index
        keys ``0 .. L - 1`` (``L = q_offset + Tq``) -> ``[Tq, L]`` bool: the tokens each query attends to."""
        ...


@dataclass
class IndexQuery:
    """One step's indexer inputs of one layer.

    Attributes:
        q: ``[T, Hi, Di]`` index queries (normed, RoPE applied).
        k: ``[T, Di]`` the step's raw index keys (stored by the backend).
        selector: the layer's :class:`BlockSelector`.
    """

    q: torch.Tensor
    k: torch.Tensor
    selector: BlockSelector


def select_blocks(scores: torch.Tensor, positions: torch.Tensor, ratio: int, top_blocks: int) -> torch.Tensor:
    """Which complete blocks each query keeps.

    Args:
        scores: ``[Tq, B]`` float32 block scores (``B`` complete blocks of the whole sequence).
        positions: ``[Tq]`` int64 query positions (host tensor or device; read once).
        ratio: tokens per block ``r``; top_blocks: blocks kept per query (``budget / r``).

    Returns:
        ``[Tq, B]`` bool. A query at ``p`` sees ``n = (p + 1) // r`` blocks and keeps the ``min(top_blocks, n)``
        best of them: ``torch.topk`` over exactly those ``n`` scores, so ties fall as in the reference.
    """
    tq, nb = scores.shape
    seen = (positions + 1) // ratio
    keep = torch.arange(nb, device=scores.device)[None, :] < seen[:, None]
    for n in sorted({int(x) for x in seen.tolist() if int(x) > top_blocks}):
        rows = (seen == n).nonzero().flatten()
        picked = torch.topk(scores[rows, :n], top_blocks, dim=-1).indices
        chosen = torch.zeros(rows.shape[0], nb, dtype=torch.bool, device=scores.device)
        keep[rows] = chosen.scatter_(1, picked, True)
    return keep


def token_mask(block_keep: torch.Tensor, positions: torch.Tensor, ratio: int, length: int) -> torch.Tensor:
    """``block_keep [Tq, B]`` -> ``[Tq, L]`` bool over tokens: the kept blocks' tokens plus each query's
    incomplete tail ``(p + 1) // r * r .. p``."""
    tq, nb = block_keep.shape
    j = torch.arange(length, device=block_keep.device)[None, :]
    tail_start = ((positions + 1) // ratio * ratio)[:, None]
    in_blocks = torch.zeros(tq, length, dtype=torch.bool, device=block_keep.device)
    in_blocks[:, :nb * ratio] = block_keep.repeat_interleave(ratio, dim=1)
    return (in_blocks & (j < tail_start)) | ((j >= tail_start) & (j <= positions[:, None]))


def block_scores(q_idx: torch.Tensor, block_keys: torch.Tensor) -> torch.Tensor:
    """``q_idx [Tq, Hi, Di]``, ``block_keys [B, Di]`` -> ``[Tq, B]`` float32 ``sum_h relu(q_h . k_b) / sqrt(Di)``."""
    s = torch.einsum("thd,bd->tbh", q_idx.float(), block_keys.float())
    return F.relu(s).sum(-1) / math.sqrt(q_idx.shape[-1])


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of one sequence's queries over its tokens with an explicit mask.

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[L, Hkv, D]`` (GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``).
        keep: ``[Tq, L]`` bool, True = attend (every row keeps at least one key).

    Returns:
        ``[Tq, Hq, D]``.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=keep[None], scale=scale)
    return out.transpose(0, 1)


def indexed_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor, keys: torch.Tensor,
                     selector: BlockSelector, scale: float, q_offset: int) -> torch.Tensor:
    """One sequence's chunk: queries ``q [Tq, Hq, D]`` at ``q_offset ..`` over ``k, v [L, Hkv, D]`` and raw index
    keys ``keys [L, Di]`` (``L = q_offset + Tq``) -> ``[Tq, Hq, D]``."""
    return masked_attention(q, k, v, selector.keep_mask(q_idx, keys, q_offset), scale)
