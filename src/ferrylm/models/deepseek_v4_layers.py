"""DeepSeek-V4's attention block and hyper-connections (the model: :mod:`ferrylm.models.deepseek_v4`; the attention
math: :mod:`ferrylm.models.compressed_attention`).

State-dict names are the published checkpoint's (``attn.wq_a`` ... ``attn.indexer.compressor.ape``, the layer's
``hc_attn_fn``); the model class maps transformers' ``save_pretrained`` names onto them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.models.attention import AttentionBackend
from ferrylm.models.compressed_attention import CompressedBranch, IndexerQuery
from ferrylm.models.layers import RMSNorm


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim (statistic in float32), in ``x``'s dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


@dataclass(frozen=True)
class Rope:
    """Interleaved RoPE over the trailing ``P`` dims of a head (pairs ``(2i, 2i + 1)``): ``inv_freq [P/2]``."""

    inv_freq: torch.Tensor

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [n]`` -> ``(cos, sin)`` ``[n, P/2]`` in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [n, ..., D]`` with its last ``2 * cos.shape[-1]`` dims rotated by ``cos`` / ``sin [n, P/2]`` (float32
        math, ``x``'s dtype out)."""
        p = 2 * cos.shape[-1]
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        c, s = cos.float().view(shape), sin.float().view(shape)
        rope = x[..., -p:].float().unflatten(-1, (-1, 2))
        even, odd = rope[..., 0], rope[..., 1]
        rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
        return torch.cat((x[..., :-p], rotated.to(x.dtype)), dim=-1)


class Compressor(nn.Module):
    """A compressor of one layer (or of its indexer): ``wkv`` / ``wgate`` ``[S * D, H]``, ``ape [m, S * D]``
    (float32), ``norm [D]``; ``S = 2`` with overlap (CSA and every indexer), 1 without (HCA).
    :class:`~ferrylm.models.compressed_attention.Compressor` for the backends."""

    def __init__(self, hidden_size: int, dim: int, rate: int, overlap: bool, eps: float, rope: Rope):
        super().__init__()
        width = (2 if overlap else 1) * dim
        self.rate, self.overlap, self.dim, self.rope = rate, overlap, dim, rope
        self.wkv = nn.Linear(hidden_size, width, bias=False)
        self.wgate = nn.Linear(hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)

    def inputs(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv, score)`` ``[T, S * D]`` of ``hidden [T, H]`` at ``positions [T]`` (score float32)."""
        return self.wkv(hidden), self.wgate(hidden).float() + self.ape[positions % self.rate]

    def finish(self, pooled: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Pooled float32 entries ``[n, D]`` numbered ``entries [n]`` -> normed and rotated at positions ``e * m``, in
        the model dtype."""
        pos = entries * self.rate
        cos, sin = self.rope.tables(pos, torch.float32)
        normed = self.norm.weight.float() * F.rms_norm(pooled, (pooled.shape[-1],), eps=self.norm.eps)
        return Rope.rotate(normed, cos, sin).to(self.wkv.weight.dtype)


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: ``wq_b [Hi * Di, q_lora_rank]``, ``weights_proj [Hi, H]``, its own
    overlapping :class:`Compressor` at ``Di``."""

    def __init__(self, hidden_size: int, q_lora_rank: int, heads: int, dim: int, topk: int, rate: int, eps: float,
                 rope: Rope):
        super().__init__()
        self.heads, self.dim, self.topk, self.rope = heads, dim, topk, rope
        self.wq_b = nn.Linear(q_lora_rank, heads * dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, heads, bias=False)
        self.compressor = Compressor(hidden_size, dim, rate, True, eps, rope)

    def query(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor) -> IndexerQuery:
        q = self.wq_b(q_residual).view(hidden.shape[0], self.heads, self.dim)
        cos, sin = self.rope.tables(positions, q.dtype)
        kv, score = self.compressor.inputs(hidden, positions)
        weights = self.weights_proj(hidden).float() * self.heads ** -0.5
        return IndexerQuery(self.compressor, kv, score, Rope.rotate(q, cos, sin), weights, self.topk)


@dataclass(frozen=True)
class AttentionShape:
    """One V4 attention layer's shape (``V4Shape`` fills it from the config)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    eps: float
    index_heads: int
    index_dim: int
    index_topk: int


class V4Attention(nn.Module):
    """Shared-KV MQA over the window and the compressed entries (``attn.attend_compressed``), a low-rank query with
    a per-head unweighted norm, interleaved partial RoPE (un-rotated on the output), per-head sinks, and the grouped
    output projection ``wo_a`` (``G`` blocks ``[R_o, H * D / G]``) then ``wo_b``.

    Args:
        layer_idx: passed to the backend. shape: :class:`AttentionShape`. rope: this layer's (``main`` for sliding
            layers, ``compress`` for compressing ones). rate: the compression rate, 0 for none; sparse: CSA.
    """

    def __init__(self, layer_idx: int, shape: AttentionShape, rope: Rope, rate: int, sparse: bool):
        super().__init__()
        s = shape
        self.layer_idx, self.shape, self.rope = layer_idx, s, rope
        self.wq_a = nn.Linear(s.hidden_size, s.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(s.q_lora_rank, s.eps)
        self.wq_b = nn.Linear(s.q_lora_rank, s.num_heads * s.head_dim, bias=False)
        self.wkv = nn.Linear(s.hidden_size, s.head_dim, bias=False)
        self.norm = RMSNorm(s.head_dim, s.eps)
        self.wo_a = nn.Linear(s.num_heads * s.head_dim // s.o_groups, s.o_groups * s.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(s.o_groups * s.o_lora_rank, s.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(s.num_heads, dtype=torch.float32))
        self.compressor = Compressor(s.hidden_size, s.head_dim, rate, sparse, s.eps, rope) if rate else None
        self.indexer = (Indexer(s.hidden_size, s.q_lora_rank, s.index_heads, s.index_dim, s.index_topk, rate, s.eps,
                                rope) if sparse else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``hidden [T, H_model]`` at ``positions [T]`` -> ``[T, H_model]``."""
        s, t = self.shape, hidden.shape[0]
        cos, sin = self.rope.tables(positions, hidden.dtype)
        q_residual = self.q_norm(self.wq_a(hidden))
        q = unweighted_rms_norm(self.wq_b(q_residual).view(t, s.num_heads, s.head_dim), s.eps)
        q = Rope.rotate(q, cos, sin)
        kv = Rope.rotate(self.norm(self.wkv(hidden)), cos, sin)
        branch = CompressedBranch(window=s.window, sinks=self.attn_sink, scale=s.head_dim ** -0.5)
        if self.compressor is not None:
            branch.compressor = self.compressor
            branch.kv, branch.score = self.compressor.inputs(hidden, positions)
        if self.indexer is not None:
            branch.indexer = self.indexer.query(hidden, q_residual, positions)
        out = Rope.rotate(attn.attend_compressed(self.layer_idx, q, kv, branch), cos, -sin)   # [T, H, D]
        g = s.o_groups
        grouped = out.reshape(t, g, -1).transpose(0, 1)                                       # [G, T, H*D/G]
        w = self.wo_a.weight.view(g, s.o_lora_rank, -1)
        return self.wo_b(torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(t, -1))


@dataclass(frozen=True)
class HyperShape:
    """Hyper-connections: ``n`` streams, Sinkhorn ``iters``, ``eps`` (``hc_eps``), ``norm_eps`` (the input norm's)."""

    n: int
    iters: int
    eps: float
    norm_eps: float


def _flat_mix(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``x [T, n, H]`` -> ``fn @ unweighted_norm(flatten(x))`` ``[T, rows]`` float32."""
    return F.linear(unweighted_rms_norm(x.flatten(1).float(), norm_eps), fn.float())


def hyper_weights(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  hs: HyperShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Manifold-constrained hyper-connection weights of the streams ``x [T, n, H]`` (V4 paper §2.2): ``pre``
    collapses the streams into the block input, ``post`` spreads the block output, ``comb`` (made doubly stochastic
    by ``iters`` Sinkhorn-Knopp steps) mixes the residual streams.

    Returns:
        ``(post [T, n], comb [T, n, n], collapsed [T, H])`` (``post``/``comb`` float32, ``collapsed`` in x's dtype).
    """
    n = hs.n
    mixed = _flat_mix(x, fn, hs.norm_eps)
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    sc = scale.float()
    pre = torch.sigmoid(pre_w * sc[0] + pre_b) + hs.eps
    post = 2 * torch.sigmoid(post_w * sc[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * sc[2] + comb_b.view(n, n), dim=-1) + hs.eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hs.eps)
    for _ in range(hs.iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hs.eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hs.eps)
    collapsed = (pre[..., None] * x).sum(dim=1).to(x.dtype)
    return post, comb, collapsed


def hyper_merge(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The new streams ``post * out + comb^T @ x``: ``x [T, n, H]``, ``out [T, H]`` -> ``[T, n, H]``."""
    dt = x.dtype
    return post.to(dt)[..., None] * out[:, None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), x)


def hyper_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               hs: HyperShape) -> torch.Tensor:
    """The final collapse of the streams ``x [T, n, H]`` -> ``[T, H]`` (``hc_head_*``)."""
    pre = torch.sigmoid(_flat_mix(x, fn, hs.norm_eps) * scale.float() + base.float()) + hs.eps
    return (pre[..., None] * x).sum(dim=1).to(x.dtype)
