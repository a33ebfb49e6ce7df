"""Per-layer embeddings (PLE) of Qwen4-Exp: hashed n-gram embeddings added to the residual streams of the layers
named by ``ple_layer_ids`` (one-indexed, linear-attention layers only).

Token ``t`` at a PLE layer (its ``j``-th, ``j`` from 0):

* n-grams: ``s_0 = t``, ``s_d`` the token ``d`` back, or EOS when one of the tokens ``1 .. d - 1`` back is EOS or
  the sequence starts later (an EOS token itself still sees the tokens before it);
  for each order ``n = 2 .. N`` (``N = ngram_size``) the id ``x_n = s_0 m_0 ^ ... ^ s_{n-1} m_{n-1}`` (int64
  products wrapping, XOR) and, for each of its ``heads_per_ngram`` heads ``h``, the row
  ``offset_h + x_n mod p_h``: ``p_h`` the ``(j G + h + 1)``-th prime from ``ngram_vocab_size_base`` on (``G`` heads
  per layer), ``offset_h`` the sum of the layer's earlier ``p``; the multipliers ``m_i`` are odd values drawn by
  SplitMix64 from ``seed + 10007 j`` (:func:`multipliers`). The ``G = (N - 1) heads_per_ngram`` rows of
  ``ple_embed_dim / G`` dims each, concatenated, are the token's embedding ``e [E]``.
* injection: ``k = norm(W_k e)`` ``[n, H]``, ``v = W_v e`` ``[H]``, ``q = norm(x)`` ``[n, H]`` (zero-centred norms per
  stream); per stream ``g = (k . q) / sqrt(H)``, ``g = sign(g) sqrt(max(|g|, 1e-6))``, ``u = sigmoid(g) v``; the layer
  adds ``u + silu(conv(norm(u)))`` to the streams, ``conv`` a depthwise causal convolution of ``ple_conv_kernel_size``
  taps ``N`` tokens apart.

The tables (``G`` rows per token per layer; ~45 billion parameters in the published model) live where the boot
put them (``--ple-backend``): a :class:`PleTable` gathers a step's rows. Per sequence the state pool keeps the
convolution's last inputs per PLE layer and the last ``N - 1`` token ids (``engine/cache/state_pool.PleStateLayout``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.models.kernels import gated_delta as gd
from ferrylm.models.gated_deltanet import GroupedRMSNorm

_MASK64 = (1 << 64) - 1
_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_STRIDE = 10007


def _splitmix64(z: int) -> int:
    z = (z + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def multipliers(vocab_size: int, order: int, layer: int, seed: int) -> list[int]:
    """The ``order`` odd hash multipliers of PLE layer ``layer`` (module docstring), each below ``2^63 / vocab``."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_STRIDE * layer
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(order)]


@functools.lru_cache(maxsize=8)
def primes_from(start: int, count: int) -> tuple[int, ...]:
    """The first ``count`` primes ``>= start``."""
    out, n = [], max(2, start)
    while len(out) < count:
        if n == 2 or (n % 2 and all(n % d for d in range(3, math.isqrt(n) + 1, 2))):
            out.append(n)
        n += 1
    return tuple(out)


@dataclass(frozen=True)
class PleShape:
    """The PLE of a config: ``layers`` (0-based decoder layers), ``embed_dim`` ``E``, ``order`` ``N``, heads per
    n-gram order, the conv taps, the hash inputs and how many shards a table has on disk."""

    layers: tuple[int, ...]
    embed_dim: int
    order: int
    heads_per_order: int
    conv_kernel: int
    vocab_base: int
    divisor: int
    seed: int
    eos: int
    vocab_size: int
    parts: int

    @property
    def heads(self) -> int:
        return (self.order - 1) * self.heads_per_order

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.heads

    @property
    def conv_rows(self) -> int:
        """Inputs the dilated convolution keeps: ``(taps - 1) * N``."""
        return (self.conv_kernel - 1) * self.order

    def head_sizes(self, j: int) -> tuple[int, ...]:
        """The ``G`` row counts (primes) of PLE layer ``j``'s heads."""
        return primes_from(self.vocab_base, (j + 1) * self.heads)[j * self.heads:]

    def table_rows(self, j: int) -> int:
        """Rows of PLE layer ``j``'s table (its heads' rows, padded to a multiple of ``divisor``)."""
        return -(-sum(self.head_sizes(j)) // self.divisor) * self.divisor

    def table_bytes(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(self.table_rows(j) for j in range(len(self.layers))) * self.head_dim * elem

    @staticmethod
    def of(config: ModelConfig, linear_layers: tuple[int, ...]) -> "PleShape | None":
        """None without ``ple_layer_ids``. Raises ModelLoadError naming the field: ids outside ``1 ..
        num_hidden_layers`` or on attention layers, ``ple_embed_dim`` not a multiple of the heads, no EOS id."""
        raw = config.raw
        ids = sorted({int(i) for i in raw.get("ple_layer_ids") or []})
        if not ids:
            return None
        bad = [i for i in ids if not 1 <= i <= config.num_layers or i - 1 not in linear_layers]
        if bad:
            raise ModelLoadError(f"ple_layer_ids: {bad} are not linear-attention layers (one-indexed)")
        eos = raw.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if not isinstance(eos, int):
            raise ModelLoadError("eos_token_id must be set when ple_layer_ids are")
        s = PleShape(layers=tuple(i - 1 for i in ids), embed_dim=int(raw.get("ple_embed_dim") or config.hidden_size),
                     order=int(raw.get("ngram_size", 3)), heads_per_order=int(raw.get("heads_per_ngram", 8)),
                     conv_kernel=int(raw.get("ple_conv_kernel_size", 4)),
                     vocab_base=int(raw.get("ngram_vocab_size_base", 20_000_000)),
                     divisor=int(raw.get("make_ngram_vocab_size_divisible_by", 128)), seed=int(raw.get("seed", 1234)),
                     eos=eos, vocab_size=config.vocab_size, parts=int(raw.get("split_ngram_parts", 512)))
        if s.order < 2 or s.heads_per_order < 1 or s.embed_dim % s.heads or s.conv_kernel < 1:
            raise ModelLoadError(f"ple_embed_dim {s.embed_dim} must be a positive multiple of the "
                                 f"(ngram_size - 1) * heads_per_ngram = {s.heads} n-gram heads")
        return s


class PleTable(Protocol):
    """One PLE layer's embedding table, wherever it lives (``checkpoints/ple_tables.py``)."""

    def gather(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``rows [N]`` int64 -> ``[N, head_dim]`` on ``device``."""
        ...


def ngram_tokens(ids: torch.Tensor, context: torch.Tensor, query_start_loc: torch.Tensor, eos: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The shifted tokens ``s_0 .. s_{N-1}`` of a flattened batch (module docstring).

    Args:
        ids: ``[T]`` the step's tokens; context: ``[B, N - 1]`` each sequence's previous tokens, oldest first (EOS
            for a sequence starting now); query_start_loc: ``[B + 1]``.

    Returns:
        ``(s [T, N] int64, new context [B, N - 1])``.
    """
    t, (b, c) = ids.shape[0], context.shape
    qsl = query_start_loc.long()
    seq = torch.bucketize(torch.arange(t, device=ids.device), qsl[1:], right=True)
    ext = ids.new_empty(t + b * c)
    pos = torch.arange(t, device=ids.device) + c * (seq + 1)
    ext[pos] = ids.long()
    ctx_pos = (qsl[:-1] + c * torch.arange(b, device=ids.device))[:, None] + torch.arange(c, device=ids.device)
    ext[ctx_pos.flatten()] = context.flatten()
    cols = [ids.long(), ext[pos - 1]]
    for d in range(2, c + 1):   # an EOS between the token and the one d back hides it
        cols.append(torch.where(cols[-1] == eos, eos, ext[pos - d]))
    end = qsl[1:] + c * torch.arange(1, b + 1, device=ids.device)
    return torch.stack(cols, dim=1), ext[end[:, None] - c + torch.arange(c, device=ids.device)]


class PleLayer(nn.Module):
    """One layer's PLE injection (module docstring); HF ``model.layers.N.ple``. Its table is set by the loader
    (:meth:`use_table`)."""

    def __init__(self, shape: PleShape, j: int, hidden_size: int, streams: int, eps: float,
                 device: torch.device | str | None = None):
        super().__init__()
        width = streams * hidden_size
        self.shape, self.index, self.streams, self.hidden_size = shape, j, streams, hidden_size
        self.key_proj = nn.Linear(shape.embed_dim, width, bias=False)
        self.value_proj = nn.Linear(shape.embed_dim, hidden_size, bias=False)
        self.norm_key = GroupedRMSNorm(width, hidden_size, eps)
        self.norm_query = GroupedRMSNorm(width, hidden_size, eps)
        self.norm_conv = GroupedRMSNorm(width, hidden_size, eps)
        self.conv1d = nn.Conv1d(width, width, shape.conv_kernel, groups=width, dilation=shape.order, bias=False)
        sizes = shape.head_sizes(j)
        # the hash constants, computed from the config (explicit device: a model built on "meta" gets real ones)
        self.register_buffer("mult", torch.tensor(multipliers(shape.vocab_size, shape.order, j, shape.seed),
                                                  device=device), persistent=False)
        self.register_buffer("sizes", torch.tensor(sizes, device=device), persistent=False)
        self.register_buffer("offsets", torch.tensor([sum(sizes[:h]) for h in range(len(sizes))], device=device),
                             persistent=False)
        self.table: PleTable | None = None

    def use_table(self, table: PleTable) -> None:
        self.table = table

    def rows(self, shifted: torch.Tensor) -> torch.Tensor:
        """``shifted [T, N]`` -> ``[T, G]`` int64 table rows."""
        g, parts, x = self.shape.heads_per_order, [], shifted[:, 0] * self.mult[0]
        for n in range(2, self.shape.order + 1):
            x = torch.bitwise_xor(x, shifted[:, n - 1] * self.mult[n - 1])
            lo = (n - 2) * g
            parts.append(torch.remainder(x[:, None], self.sizes[lo:lo + g]) + self.offsets[lo:lo + g])
        return torch.cat(parts, dim=1)

    def embed(self, shifted: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The step's embeddings ``[T, E]`` gathered from the table (``shifted`` as :meth:`rows`)."""
        rows = self.rows(shifted)
        return self.table.gather(rows.flatten(), device).view(rows.shape[0], self.shape.embed_dim)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, rs) -> torch.Tensor:
        """``x [T, n H]``, ``emb [T, E]`` -> the injection ``[T, n H]``; advances the layer's conv state (``rs``: the
        step's ``RecurrentStep``)."""
        n, h = self.streams, self.hidden_size
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (n, h))
        query = self.norm_query(x).unflatten(-1, (n, h))
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(h)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        u = (torch.sigmoid(gate) * self.value_proj(emb).unsqueeze(-2)).flatten(-2)
        state = rs.pool.ple_conv[self.shape.layers[self.index]]
        prev = torch.where(rs.fresh[:, None, None], 0.0, state[rs.slots]).to(u.dtype)
        conv, new_prev = gd.causal_conv_varlen(self.norm_conv(u), self.conv1d.weight[:, 0, :], prev,
                                               rs.query_start_loc, dilation=self.shape.order)
        state.index_copy_(0, rs.slots, new_prev.to(state.dtype))
        return u + conv


def step_ngrams(input_ids: torch.Tensor, rs, shape: PleShape) -> torch.Tensor:
    """The step's shifted tokens ``[T, N]``, read from and written back to the sequences' token context in the state
    pool (once per step, before any PLE layer)."""
    pool = rs.pool
    context = torch.where(rs.fresh[:, None], shape.eos, pool.ple_context[rs.slots])
    shifted, new_context = ngram_tokens(input_ids, context, rs.query_start_loc, shape.eos)
    pool.ple_context.index_copy_(0, rs.slots, new_context)
    rs.written = True
    return shifted
