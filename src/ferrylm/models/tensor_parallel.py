"""Tensor parallel inside one host: how a model is split over ``N`` ranks (Megatron-LM's layout, Shoeybi et al.
2019, "Megatron-LM", §3).

One rank holds (``r`` its rank, ``N`` the group size):

* attention, column-parallel by head: ``q_proj`` rows of query heads ``[r Hq/N, (r+1) Hq/N)``; ``k_proj`` /
  ``v_proj`` rows of KV heads ``[r Hkv/N, (r+1) Hkv/N)`` when N divides Hkv, else (Hkv divides N) the one KV head
  ``r // (N / Hkv)`` its query heads read, replicated on ``N / Hkv`` ranks; ``o_proj`` row-parallel (the columns of
  its query heads). Per-head q/k norms (``[D]``) are replicated. The whole-projection q/k norm (OLMoE, MiniMax-M2)
  needs a statistic over every head (a second collective per block): refused for N > 1.
* MLPs (dense, Qwen2-MoE / GLM-4.5 shared experts): ``gate_proj`` / ``up_proj`` rows ``[r I/N, (r+1) I/N)``,
  ``down_proj`` the same columns.
* routed experts: every expert's intermediate-dim shard (gate/up rows, down columns, width ``I/N``), so the expert
  stacks, the host banks and every PCIe copy per rank are ``1/N`` of the model's; the executor runs them unchanged
  (its layout is read from the stacks' shapes).
* replicated: embedding, lm_head, every RMSNorm, the router (and its bias), the shared expert's sigmoid gate.

A row-parallel projection's bias is kept on rank 0 and zeroed elsewhere, so the sum over ranks adds it once. The
decoder layer sums its partial outputs over the group: one all-reduce after attention, one after the MLP / MoE block
(routed output + shared expert summed before it: a single reduce). Everything after the reduce is identical on every
rank, so the routers choose the same experts everywhere.

The shards are cut from each checkpoint tensor as it is read (:func:`shard_tensor`), and the model is built from
:func:`shard_config` (per-rank heads and widths), so a rank never holds the full expert stacks. This module knows no
process group: the reduce is a callable handed to :func:`attach_reduce` (``engine/parallel/group.py`` makes it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError


@dataclass(frozen=True)
class TPShard:
    """Which part of the model a rank holds: ``rank`` of ``size`` ranks (``0 <= rank < size``)."""

    rank: int
    size: int

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside [0, {self.size})")

    @property
    def is_split(self) -> bool:
        return self.size > 1


_WIDTH_FIELDS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads one rank holds: ``Hkv / N``, or 1 when the heads are replicated (``N`` a multiple of Hkv)."""
    return num_kv_heads // size if num_kv_heads % size == 0 else 1


def shard_config(config: ModelConfig, shard: TPShard) -> ModelConfig:
    """``config`` with one rank's heads and widths (``num_heads / N``, KV heads per :func:`kv_heads_per_rank`,
    every intermediate width ``/ N``; ``head_dim`` and everything else unchanged), so the model class builds its
    modules at shard shape and the KV pool holds this rank's heads only. ``config`` itself for ``N = 1``.

    Raises:
        ModelLoadError: a width or head count that ``N`` does not divide (``EngineConfig.check_model`` refuses
            those first, naming the flag).
    """
    n = shard.size
    if n == 1:
        return config
    kv = config.num_kv_heads
    if config.num_heads % n or (kv % n and n % kv):
        raise ModelLoadError(f"tensor parallel size {n} does not divide the heads ({config.num_heads} query, {kv} KV)")
    raw = dict(config.raw)
    for name in _WIDTH_FIELDS:
        width = raw.get(name)
        if isinstance(width, int) and width:
            if width % n:
                raise ModelLoadError(f"tensor parallel size {n} does not divide {name} ({width})")
            raw[name] = width // n
    heads, kv_heads = config.num_heads // n, kv_heads_per_rank(kv, n)
    raw.update(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=config.head_dim)
    return replace(config, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=config.intermediate_size // n,
                   moe_intermediate_size=config.moe_intermediate_size // n, raw=raw)


# checkpoint names (before the family's renames); the block is ``mlp``, ``block_sparse_moe`` or a shared expert
_Q = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")
_KV = re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$")
_O = re.compile(r"\.self_attn\.o_proj\.(weight|bias)$")
_COL = re.compile(r"\.(gate_proj|up_proj|w1|w3)\.(weight|bias)$")       # column-parallel: output rows
_ROW = re.compile(r"\.(down_proj|w2)\.(weight|bias)$")                  # row-parallel: input columns
_FUSED_GATE_UP = re.compile(r"\.experts\.gate_up_proj$")                 # [E, 2I, H]
_FUSED_DOWN = re.compile(r"\.experts\.down_proj$")                       # [E, H, I]


def _part(t: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` equal parts of ``t`` along ``dim``, as its own contiguous tensor."""
    size = t.shape[dim]
    if size % parts:
        raise ModelLoadError(f"a dim of {size} cannot be split in {parts} equal parts")
    step = size // parts
    return t.narrow(dim, index * step, step).contiguous()


Split = tuple[int, int, int]   # (dim, parts, index): this rank holds part ``index`` of ``parts`` along ``dim``


def split_of(name: str, config: ModelConfig, shard: TPShard) -> Split | str | None:
    """How tensor ``name`` (a checkpoint or state-dict name; ``config`` the *unsharded* config) is split: a
    :data:`Split`, ``"rank0"`` for a row-parallel bias (kept on rank 0, zeros elsewhere), or None (replicated).
    The fused ``experts.gate_up_proj`` (two halves split alike) is :func:`shard_tensor`'s own case."""
    n, r = shard.size, shard.rank
    if n == 1:
        return None
    if _Q.search(name) or _COL.search(name):
        return (0, n, r)
    if _KV.search(name):
        kv = config.num_kv_heads
        return (0, n, r) if kv % n == 0 else (0, kv, r // (n // kv))   # the one KV head its query heads read
    if _O.search(name) or _ROW.search(name):
        return "rank0" if name.endswith(".bias") else (-1, n, r)
    if _FUSED_DOWN.search(name):
        return (2, n, r)
    return None


def shard_tensor(name: str, t: torch.Tensor, config: ModelConfig, shard: TPShard) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name`` (full shape ``t``; ``config`` the *unsharded* config), by
    :func:`split_of`: column-parallel weights keep rows, row-parallel ones columns; a row-parallel bias is ``t`` on
    rank 0 and zeros elsewhere; replicated tensors come back unchanged. See the module docstring for the layout."""
    n, r = shard.size, shard.rank
    if n == 1:
        return t
    if _FUSED_GATE_UP.search(name):
        i = t.shape[1] // 2
        return torch.cat([_part(t[:, :i], 1, r, n), _part(t[:, i:], 1, r, n)], dim=1)
    how = split_of(name, config, shard)
    if how is None:
        return t
    if how == "rank0":
        return t if r == 0 else torch.zeros_like(t)
    dim, parts, index = how
    return _part(t, dim % t.ndim, index, parts)


def full_shape(name: str, shape: tuple[int, ...], config: ModelConfig, shard: TPShard) -> tuple[int, ...]:
    """The unsplit shape of tensor ``name`` whose shard has ``shape`` (inverse of :func:`split_of`)."""
    how = split_of(name, config, shard)
    if not isinstance(how, tuple):
        return tuple(shape)
    dim, parts, _ = how
    out = list(shape)
    out[dim % len(out)] *= parts
    return tuple(out)


def split_part(t: torch.Tensor, dim: int, shard: TPShard) -> torch.Tensor:
    """Rank ``shard.rank``'s part of ``t`` cut in ``shard.size`` equal parts along ``dim`` (contiguous)."""
    return _part(t, dim % t.ndim, shard.rank, shard.size)


def check_shardable(model_cls: type, config: ModelConfig, shard: TPShard) -> None:
    """Raise ModelLoadError, before anything is read, when ``model_cls`` computes something this layout cannot split
    over ``shard.size > 1`` ranks: a whole-projection q/k norm (OLMoE, MiniMax-M2: its statistic spans every head,
    a second collective per attention block)."""
    if not shard.is_split:
        return
    from ferrylm.engine.cache.kv_pool import KVLayout
    from ferrylm.engine.cache.state_pool import StateLayout

    layout = KVLayout.of(config)
    if layout.v_heads == 0 or StateLayout.of(config) is not None:
        raise ModelLoadError(f"--tensor-parallel-size {shard.size}: {config.architecture} has latent or "
                             f"linear-attention layers, which tensor parallel does not split yet")
    if model_cls.expert_swiglu(config) is not None:
        raise ModelLoadError(f"--tensor-parallel-size {shard.size}: {config.architecture}'s expert biases and "
                             f"attention sinks are not split by tensor parallel yet")
    if model_cls.attention_kwargs(config).get("qk_norm") == "proj":
        raise ModelLoadError(f"--tensor-parallel-size {shard.size}: {config.architecture} normalises q/k over the "
                             f"whole projection (all heads), which tensor parallel does not split yet")


Reduce = Callable[[torch.Tensor], torch.Tensor]


def attach_reduce(model: nn.Module, reduce: Reduce | None) -> int:
    """Make every decoder layer of ``model`` sum its attention and MLP outputs over the group with ``reduce``
    (``[T, H] -> [T, H]``, the sum over ranks; None detaches). Returns the number of layers attached."""
    from ferrylm.models.llama import DecoderLayer

    n = 0
    for m in model.modules():
        if isinstance(m, DecoderLayer):
            m.tp_reduce = reduce
            n += 1
    return n
