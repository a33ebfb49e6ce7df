"""Multi-head latent attention (MLA) over a cache of compressed latents: the math every backend shares.

MLA (DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model", §2.1;
kept unchanged in "DeepSeek-V3 Technical Report", §2.1.1) caches per token only the compressed latent
``c = RMSNorm(W_DKV h)`` ``[R]`` (``R = kv_lora_rank``) and one decoupled rope key ``k_pe`` ``[P]`` shared by all
heads. Head ``h``'s key and value are ``k_h = [W_UK_h c ; k_pe]`` and ``v_h = W_UV_h c`` with
``W_UK_h [N, R]``, ``W_UV_h [V, R]`` the rows of ``kv_b_proj`` (``N = qk_nope_head_dim``, ``V = v_head_dim``).

Two ways to compute the same attention (V2 paper §2.1.2, "absorb" ``W_UK`` into the query and ``W_UV`` into the
output):

* **absorbed**: ``q_abs_h = W_UK_h^T q_nope_h`` ``[R]``; score ``q_abs_h . c + q_pe_h . k_pe``; the output
  ``o_h = W_UV_h (sum_j p_j c_j)``. The latent is read once for all heads (an MQA with one ``R + P`` key head and one
  ``R`` value head); per key and head it costs ``2R + P`` multiply-adds. Used for decode.
* **expanded**: ``k_nope, v = kv_b_proj(c)`` for every cached token, then ordinary causal attention with q/k head dim
  ``N + P`` and v head dim ``V``: ``N + P + V`` per key and head, plus ``R (N + V)`` per key and head to expand.
  Cheaper once a chunk has more queries than :func:`absorb_wins` says; used for long prefill chunks.

Both are exact rewrites of the same sums (up to float rounding). The cache row of a token is ``[c ; k_pe]``
``[R + P]`` (the pool's ``KVLayout(k_heads=1, k_dim=R + P, v_heads=0)``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LatentProjection:
    """The up-projection of one MLA layer, viewed per head (no copy of ``kv_b_proj``'s weight).

    Attributes:
        weight: ``kv_b_proj.weight`` ``[H * (N + V), R]`` (rows head-major: head ``h``'s ``N`` key rows, then its
            ``V`` value rows).
        w_uk: ``[H, N, R]`` view: the key part of each head.
        w_uv: ``[H, V, R]`` view: the value part of each head.
    """

    weight: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor

    @staticmethod
    def of(weight: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int) -> "LatentProjection":
        """Views of ``weight [H * (N + V), R]``. Raises ValueError when the shape does not fit."""
        rows, rank = weight.shape
        if rows != num_heads * (nope_dim + v_dim):
            raise ValueError(f"kv_b_proj weight has {rows} rows, expected {num_heads} x ({nope_dim} + {v_dim})")
        per_head = weight.view(num_heads, nope_dim + v_dim, rank)
        return LatentProjection(weight=weight, w_uk=per_head[:, :nope_dim], w_uv=per_head[:, nope_dim:])

    @property
    def num_heads(self) -> int:
        return self.w_uk.shape[0]

    @property
    def rank(self) -> int:
        return self.w_uk.shape[2]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope [T, H, N]`` -> ``q_abs [T, H, R]`` (``q_abs_h = W_UK_h^T q_nope_h``): one batched GEMM over heads."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk.to(q_nope.dtype)).transpose(0, 1)

    def value_out(self, o_latent: torch.Tensor) -> torch.Tensor:
        """``o_latent [T, H, R]`` -> ``[T, H, V]`` (``o_h = W_UV_h o_latent_h``)."""
        return torch.bmm(o_latent.transpose(0, 1), self.w_uv.to(o_latent.dtype).transpose(1, 2)).transpose(0, 1)

    def expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of cached tokens: ``c_kv [L, R]``, ``k_pe [L, P]`` -> ``k [L, H, N + P]``, ``v [L, H, V]``."""
        h, n = self.num_heads, self.w_uk.shape[1]
        kv = F.linear(c_kv, self.weight.to(c_kv.dtype)).view(c_kv.shape[0], h, -1)
        k = torch.cat((kv[..., :n], k_pe[:, None, :].expand(-1, h, -1)), dim=-1)
        return k, kv[..., n:]


def latent_row(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The cached row of each token: ``c_kv [T, R]``, ``k_pe [T, P]`` -> ``[T, 1, R + P]``."""
    return torch.cat((c_kv, k_pe), dim=-1)[:, None, :]


def absorb_wins(q_len: int, rank: int, nope_dim: int, rope_dim: int, v_dim: int) -> bool:
    """True when the absorbed form costs fewer multiply-adds than the expanded one for a chunk of ``q_len``
    queries over ``L`` keys (per key and head: absorbed ``q_len (2R + P)``; expanded ``R (N + V)`` to expand the key
    plus ``q_len (N + P + V)``; the query absorption and output projection, ``q_len R (N + V)`` per head, are counted
    as one more key). DeepSeek-V3's shapes (R 512, N 128, P 64, V 128): absorbed below 171 queries."""
    absorbed = q_len * (2 * rank + rope_dim)
    expanded = rank * (nope_dim + v_dim) + q_len * (nope_dim + rope_dim + v_dim)
    return absorbed < expanded


def absorbed_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, rank: int, scale: float,
                       mask: torch.Tensor | None = None, q_offset: int | None = None) -> torch.Tensor:
    """Attention of absorbed queries over cached latents, as one-KV-head attention (every query head a query row).

    Args:
        q_abs: ``[B, H, Tq, R]`` absorbed queries; q_pe: ``[B, H, Tq, P]`` rotated rope queries.
        latent: ``[B, L, R + P]`` cached rows ``[c ; k_pe]``.
        rank: ``R``.
        scale: softmax scale (MLA's: ``(N + P) ** -0.5`` times the yarn mscale squared).
        mask: ``[B, 1, Tq or 1, L]`` bool, True = attend; or None.
        q_offset: with ``mask`` None and ``Tq > 1``: causal, query ``i`` at position ``q_offset + i`` (``B == 1``).

    Returns:
        ``[B, H, Tq, R]`` the attention-weighted latents (apply :meth:`LatentProjection.value_out`).
    """
    b, h, tq, _ = q_abs.shape
    q = torch.cat((q_abs, q_pe), dim=-1).reshape(b, 1, h * tq, -1)     # heads x queries as the query rows
    k = latent[:, None]                                                  # [B, 1, L, R + P]
    v = latent[:, None, :, :rank]                                        # [B, 1, L, R]
    if mask is None and q_offset is not None and tq > 1:
        qpos = torch.arange(q_offset, q_offset + tq, device=q.device)
        mask = (torch.arange(latent.shape[1], device=q.device)[None, :] <= qpos[:, None])[None, None]
    if mask is not None and mask.shape[-2] == tq and tq > 1:            # per-query mask: repeat over heads
        mask = mask.expand(b, 1, tq, -1).repeat(1, 1, h, 1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, 1, H * Tq, R]
    return o.view(b, h, tq, rank)


# NOTE: bytes of one block's scores (float32 scores and probabilities, the probabilities' bf16 copy, a mask: ~12
# bytes per score): the chunk attention below never holds more than this at once, whatever the prefix length
SCORE_BLOCK_BYTES = 256 * 2**20
KEY_BLOCK = 1024  # keys per block (also the rows of the latent expanded at once by the expanded form)


def blocked_causal_attention(q_main: torch.Tensor, q_pe: torch.Tensor, key_block, length: int, q_offset: int,
                             scale: float, key_block_size: int = KEY_BLOCK,
                             score_bytes: int = SCORE_BLOCK_BYTES) -> torch.Tensor:
    """Causal attention in key blocks with an online softmax (FlashAttention's rescaling: Dao et al. 2022,
    "FlashAttention", Alg. 1; Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"), so the
    memory it takes is bounded by the chunk and the block sizes, never by the prefix length.

    Scores are ``q_main . k_main + q_pe . k_pe`` (the two parts of MLA's query: the nope or absorbed part and the
    rope part), computed and softmaxed in float32 (half-precision operands upcast exactly); the probabilities are
    cast to ``v``'s dtype for the value product, as FlashAttention does.

    Args:
        q_main: ``[H, Tq, D]`` queries at positions ``q_offset .. q_offset + Tq - 1``; q_pe: ``[H, Tq, P]``.
        key_block: ``key_block(j0, j1) -> (k_main [Hk, n, D], k_pe [n, P], v [Hk, n, Dv])`` the keys and values
            of positions ``j0 .. j1 - 1`` (``Hk`` is ``H``, or 1 for one key head shared by every query head).
        length: keys at positions ``0 .. length - 1`` exist (``length >= q_offset + Tq``; later ones are never
            read).
        q_offset: position of the first query; scale: softmax scale.
        key_block_size: keys per block; score_bytes: the byte bound of one block's scores (sets the query block).

    Returns:
        ``[H, Tq, Dv]`` in ``q_main``'s dtype. Memory: ``H * Tq * (Dv + 2)`` float32 of running state, one key
        block, and at most ``score_bytes`` of scores.
    """
    with _exact_upcast_matmul(q_main):
        return _blocked(q_main, q_pe, key_block, length, q_offset, scale, key_block_size, score_bytes)


@contextlib.contextmanager
def _exact_upcast_matmul(x: torch.Tensor):
    """float32 matmuls of upcast bfloat16 / float16 operands on CUDA run as TF32 inside: exact for those operands
    (TF32 keeps 10 mantissa bits, bfloat16 has 7, float16 10) and accumulated in float32, i.e. a half-precision
    GEMM with a float32 result, at tensor-core speed. Restores the previous setting on exit."""
    m = torch.backends.cuda.matmul
    if not x.is_cuda or x.dtype == torch.float32 or not hasattr(m, "fp32_precision"):
        yield
        return
    before = m.fp32_precision
    m.fp32_precision = "tf32"
    try:
        yield
    finally:
        m.fp32_precision = before


def _blocked(q_main, q_pe, key_block, length, q_offset, scale, key_block_size, score_bytes) -> torch.Tensor:
    """:func:`blocked_causal_attention`'s loop."""
    h, tq, _ = q_main.shape
    end = min(length, q_offset + tq)             # causal: no query reads past its own position
    bq = max(1, min(tq, score_bytes // (12 * h * key_block_size)))
    acc = m = denom = None
    qpos = torch.arange(q_offset, q_offset + tq, device=q_main.device)
    for j0 in range(0, end, key_block_size):
        j1 = min(end, j0 + key_block_size)
        k_main, k_pe, v = key_block(j0, j1)
        k_main_t, k_pe_t = k_main.float().transpose(-1, -2), k_pe.float().transpose(0, 1)
        if acc is None:
            acc = q_main.new_zeros(h, tq, v.shape[-1], dtype=torch.float32)
            m = q_main.new_full((h, tq), float("-inf"), dtype=torch.float32)
            denom = q_main.new_zeros(h, tq, dtype=torch.float32)
        first = max(0, j0 - q_offset)             # queries before this row see no key of the block
        for i0 in range(first - first % bq, tq, bq):
            i1 = min(tq, i0 + bq)
            s = (torch.matmul(q_main[:, i0:i1].float(), k_main_t) + torch.matmul(q_pe[:, i0:i1].float(), k_pe_t))
            s.mul_(scale)
            if j1 - 1 > q_offset + i0:             # the block crosses the diagonal for some query
                kpos = torch.arange(j0, j1, device=q_main.device)
                s.masked_fill_(kpos[None, None, :] > qpos[None, i0:i1, None], float("-inf"))
            m_new = torch.maximum(m[:, i0:i1], s.amax(dim=-1))
            alpha = torch.exp(m[:, i0:i1] - m_new)
            p = torch.exp(s - m_new[..., None])
            denom[:, i0:i1] = denom[:, i0:i1] * alpha + p.sum(dim=-1)
            acc[:, i0:i1] = acc[:, i0:i1] * alpha[..., None] + torch.matmul(p.to(v.dtype), v).float()
            m[:, i0:i1] = m_new
    return (acc / denom[..., None]).to(q_main.dtype)


def latent_chunk_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                           proj: LatentProjection, scale: float, q_offset: int) -> torch.Tensor:
    """Causal MLA of one sequence's chunk over its cached rows (prefix + the chunk), absorbed or expanded as
    :func:`absorb_wins` chooses, in key blocks (:func:`blocked_causal_attention`): the expanded form expands one
    key block of the latent at a time, so neither form's memory grows with the prefix (a long prompt's later chunks
    take what its first chunk took, which the boot plan measured). On CUDA in 16 bit the expanded form runs on flash
    attention kernels instead (:func:`flash_expanded_attention`, bounded the same way).

    Args:
        q_nope: ``[Tq, H, N]``; q_pe: ``[Tq, H, P]`` rotated; at positions ``q_offset .. q_offset + Tq - 1``.
        latent: ``[L, R + P]`` the sequence's rows at positions ``0 .. L - 1`` (``L >= q_offset + Tq``).
        proj: the layer's :class:`LatentProjection`; scale: softmax scale.

    Returns:
        ``[Tq, H, V]``.
    """
    tq, _, n = q_nope.shape
    r, p, vd = proj.rank, q_pe.shape[-1], proj.w_uv.shape[1]
    dt = q_nope.dtype
    qp = q_pe.transpose(0, 1)                                             # [H, Tq, P]
    if absorb_wins(tq, r, n, p, vd):
        def absorbed_block(j0: int, j1: int):
            c = latent[j0:j1, :r]
            return c[None], latent[j0:j1, r:], c[None]                   # one key head: the latent itself

        q_abs = proj.absorb_query(q_nope).transpose(0, 1)                 # [H, Tq, R]
        o = blocked_causal_attention(q_abs, qp, absorbed_block, latent.shape[0], q_offset, scale)
        return proj.value_out(o.transpose(0, 1))
    if flash_usable(q_nope):
        return flash_expanded_attention(q_nope, q_pe, latent, proj, scale, q_offset)
    w = proj.weight.to(dt)

    def expanded_block(j0: int, j1: int):
        kv = F.linear(latent[j0:j1, :r], w).view(j1 - j0, proj.num_heads, n + vd).transpose(0, 1)  # [H, n, N + V]
        return kv[..., :n], latent[j0:j1, r:], kv[..., n:]

    o = blocked_causal_attention(q_nope.transpose(0, 1), qp, expanded_block, latent.shape[0], q_offset, scale)
    return o.transpose(0, 1)


FLASH_QUERY_BLOCK = 2048   # query rows per flash call (the merged output of a block is held in float32)
FLASH_KEY_BLOCK = 2048     # latent rows expanded into keys and values at once


def flash_usable(x: torch.Tensor) -> bool:
    """The expanded form runs on FlashAttention-2 (torch's ``_scaled_dot_product_flash_attention``, which returns
    the log-sum-exp the key blocks are merged with): a 16-bit CUDA tensor on an sm80+ device with the op present."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x.device) >= (8, 0)
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention"))


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [1, H, Tq, D]``, ``k`` / ``v [1, H, n, D]`` -> ``(o [1, H, Tq, D], lse [1, H, Tq] float32)``; ``causal``
    aligns the first query with the first key (used on square diagonal blocks only)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def flash_expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                             proj: LatentProjection, scale: float, q_offset: int) -> torch.Tensor:
    """The expanded form of :func:`latent_chunk_attention` on flash attention kernels, in blocks whose memory is
    bounded by the block sizes, never by the prefix.

    For each block of :data:`FLASH_QUERY_BLOCK` query rows at positions ``a .. b - 1`` (after ``q_offset``): the
    keys before ``q_offset + a`` in blocks of :data:`FLASH_KEY_BLOCK` latent rows expanded at a time (no mask), then
    the square diagonal block ``q_offset + a .. q_offset + b - 1`` (causal), merged by their log-sum-exps
    (``lse = logaddexp(lse_1, lse_2)``, ``o = o_1 e^{lse_1 - lse} + o_2 e^{lse_2 - lse}``: the merge of
    FlashAttention's split-KV partials, as vLLM's chunked-context MLA prefill does). ``v`` is zero-padded from ``V``
    to the ``N + P`` head dim the kernel needs for ``q`` and ``k`` (the padded output columns are dropped).

    Args/returns as :func:`latent_chunk_attention` (``q_nope [Tq, H, N]``, ``q_pe [Tq, H, P]``, ``latent [L, R + P]``
    -> ``[Tq, H, V]``, 16-bit CUDA tensors: :func:`flash_usable`).
    """
    tq, h, n = q_nope.shape
    r, vd = proj.rank, proj.w_uv.shape[1]
    d = n + q_pe.shape[-1]
    w = proj.weight.to(q_nope.dtype)
    q = torch.cat((q_nope, q_pe), dim=-1)                                  # [Tq, H, D]
    out = q_nope.new_empty(tq, h, vd)

    def expand(j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = F.linear(latent[j0:j1, :r], w).view(j1 - j0, h, n + vd)
        k = torch.cat((kv[..., :n], latent[j0:j1, None, r:].expand(-1, h, -1)), dim=-1)
        v = F.pad(kv[..., n:], (0, d - vd))
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]           # [1, H, n, D] each

    for a in range(0, tq, FLASH_QUERY_BLOCK):
        b = min(tq, a + FLASH_QUERY_BLOCK)
        qb = q[a:b].transpose(0, 1)[None]                                  # [1, H, b - a, D]
        k, v = expand(q_offset + a, q_offset + b)
        o, lse = _flash(qb, k, v, scale, causal=True)
        acc = o[..., :vd].float()
        del k, v, o
        for j0 in range(0, q_offset + a, FLASH_KEY_BLOCK):
            k, v = expand(j0, min(q_offset + a, j0 + FLASH_KEY_BLOCK))
            o, lse_j = _flash(qb, k, v, scale, causal=False)
            new = torch.logaddexp(lse, lse_j)
            acc.mul_(torch.exp(lse - new)[..., None]).add_(o[..., :vd].float() * torch.exp(lse_j - new)[..., None])
            lse = new
            del k, v, o
        out[a:b] = acc[0].transpose(0, 1).to(out.dtype)
    return out


def latent_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, proj: LatentProjection,
                  scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Absorbed MLA of ``B`` sequences with one new token each.

    Args:
        q_nope: ``[B, H, N]``; q_pe: ``[B, H, P]``.
        latent: ``[B, L, R + P]`` each sequence's gathered rows (past its length: anything finite, masked).
        proj, scale: as :func:`latent_chunk_attention`.
        mask: ``[B, L]`` bool, True where the slot holds one of the sequence's tokens; None = all held.

    Returns:
        ``[B, H, V]``.
    """
    q_abs = proj.absorb_query(q_nope)                                    # [B, H, R]
    m = None if mask is None else mask[:, None, None, :]
    o = absorbed_attention(q_abs[:, :, None], q_pe[:, :, None], latent, proj.rank, scale, mask=m)
    return proj.value_out(o[:, :, 0])
