"""Qwen4-Exp (``Qwen4ExpForCausalLM``, Qwen3.8-Flash-Next): Qwen3.5-MoE's hybrid of Gated DeltaNet and gated
attention layers, with three changes.

* Hyper-connections: the residual stream is ``n = hc_count`` streams ``x [T, n H]`` (the embedding repeated ``n``
  times). Before each mixer and each MLP a :class:`HyperConnection` norms every stream (zero-centred RMSNorm per
  ``H`` group), computes mixing weights ``m = sigmoid(W_up silu(W_down x_n / n))`` ``[n H]`` and injection weights
  ``c = 2 sigmoid(W_inj x_n / n)`` ``[n]``; the block reads ``mean_i(m_i * x_n,i)`` ``[T, H]`` and its output ``y``
  is added to every stream scaled by its weight: ``x_i += c_i y``. There is no per-layer input norm. After the last
  layer a mixer without injection gives ``[T, H]`` to the LM head (no final norm).
* Attention layers (``layer_types`` ``"indexed_attention"``, or ``"full_attention"`` as the published config
  writes them) attend sparsely: a token indexer keeps, per query, the best ``indexer_budget / indexer_compress_ratio``
  compressed key blocks and the incomplete tail (``models/indexed_attention.py``). Its projection
  ``index_qk_proj [(Hi + 1) Di, H]`` gives ``Hi`` query heads (zero-centred norm, RoPE) and one raw key per token,
  cached beside K/V in the pool (``KVLayout.index_dim``).
* The DeltaNet's gated norm may gate by sigmoid (``output_gate_type``). Every layer's MLP is the sparse MoE block
  with a sigmoid-gated shared expert.

Per-layer embeddings (``ple_layer_ids``): ``models/ple.py``; their tables are placed by ``--ple-backend``
(``checkpoints/ple_tables.py``). Checkpoint names
follow transformers (``model.layers.N.{attn,mlp}_hyper_connection.*``, ``self_attn.indexer.*``,
``model.hyper_connection_mixer.*``); a multimodal checkpoint's text tower loads as for Qwen3.5. Decode steps run
the eager forward (no decode graphs yet).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.attention import AttentionBackend
from ferrylm.models.capabilities import ModelCapabilities
from ferrylm.models.indexed_attention import IndexQuery, block_scores, select_blocks, token_mask
from ferrylm.models.layers import RotaryEmbedding, apply_rotary_full, config_rotary_dim
from ferrylm.models.moe import hand_routers
from ferrylm.models.ple import PleLayer, PleShape, PleTable, step_ngrams
from ferrylm.models.gated_deltanet import (GATE_ACTIVATIONS, GroupedRMSNorm, LinearShape, Qwen35GatedDeltaNet,
                                           ZeroCentredRMSNorm, positive_int)
from ferrylm.models.qwen3_next import (FULL, LINEAR, GatedAttention, Qwen3_5MoeForCausalLM, _with_default_rotary,
                                       layer_types)

INDEXED = "indexed_attention"


def layer_kinds(config: ModelConfig) -> tuple[str, ...]:
    """Each layer's mixer, ``"linear_attention"`` or ``"full_attention"`` (an indexed attention layer here):
    ``layer_types`` with ``"indexed_attention"`` read as full, else every ``full_attention_interval``-th layer.

    Raises:
        ModelLoadError: as :func:`~ferrylm.models.qwen3_next.layer_types`.
    """
    types = config.raw.get("layer_types")
    if isinstance(types, list):
        config = dataclasses.replace(config, raw={**config.raw,
                                                  "layer_types": [FULL if t == INDEXED else t for t in types]})
    return layer_types(config)


@dataclasses.dataclass(frozen=True)
class IndexerShape:
    """The token indexer: ``heads`` query heads of ``head_dim``, ``budget`` tokens in blocks of ``ratio``."""

    heads: int
    head_dim: int
    budget: int
    ratio: int

    @property
    def top_blocks(self) -> int:
        return self.budget // self.ratio

    @staticmethod
    def of(config: ModelConfig) -> "IndexerShape":
        """Raises ModelLoadError naming the field: a missing or non-positive indexer field, ``indexer_kv_heads`` other
        than 1, a budget not a multiple of the ratio, a RoPE wider than the index head."""
        raw = config.raw
        s = IndexerShape(heads=positive_int(raw, "indexer_n_heads"), head_dim=positive_int(raw, "indexer_head_dim"),
                         budget=positive_int(raw, "indexer_budget"), ratio=positive_int(raw, "indexer_compress_ratio"))
        if positive_int(raw, "indexer_kv_heads") != 1:
            raise ModelLoadError(f"indexer_kv_heads must be 1, got {raw.get('indexer_kv_heads')!r}")
        if s.budget % s.ratio:
            raise ModelLoadError(f"indexer_budget {s.budget} is not a multiple of indexer_compress_ratio {s.ratio}")
        rotary = config_rotary_dim(_with_default_rotary(config), allow_partial=True)
        if rotary > s.head_dim:
            raise ModelLoadError(f"indexer_head_dim {s.head_dim} is narrower than the {rotary} rotated dims")
        return s


class HyperConnection(nn.Module):
    """Reads a block's input from the ``n`` streams and weighs its output back (module docstring).

    Args:
        hidden_size: ``H``; streams: ``n``; rank: the mixer's low rank; inject: with the injection weights (False:
            the final mixer).
    """

    def __init__(self, hidden_size: int, streams: int, rank: int, eps: float, inject: bool = True):
        super().__init__()
        self.streams, self.hidden_size = streams, hidden_size
        width = streams * hidden_size
        self.hc_norm = GroupedRMSNorm(width, hidden_size, eps)
        self.input_mix_weight_down = nn.Linear(width, rank, bias=False)
        self.input_mix_weight_up = nn.Linear(rank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, streams, bias=False) if inject else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [T, n H]`` -> ``(block input [T, H], injection weights [T, n] or None)``."""
        n = self.streams
        normed = self.hc_norm(x)
        mix = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / n)))
        mixed = (mix.unflatten(-1, (n, -1)) * normed.unflatten(-1, (n, -1))).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / n)


def inject(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``x [T, n H] + (y [T, H] scaled by weights [T, n] per stream)``."""
    return x + (y.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


class QsaIndexer(nn.Module):
    """The token indexer of one attention layer: builds the step's :class:`IndexQuery` and, as its
    :class:`~ferrylm.models.indexed_attention.BlockSelector`, the keep mask from a sequence's raw index keys."""

    def __init__(self, hidden_size: int, shape: IndexerShape, rotary: RotaryEmbedding, eps: float):
        super().__init__()
        self.shape, self.rotary = shape, rotary
        self.index_qk_proj = nn.Linear(hidden_size, (shape.heads + 1) * shape.head_dim, bias=False)
        self.q_layernorm = ZeroCentredRMSNorm(shape.head_dim, eps)
        self.k_layernorm = ZeroCentredRMSNorm(shape.head_dim, eps)

    def query(self, positions: torch.Tensor, hidden: torch.Tensor) -> IndexQuery:
        """``hidden [T, H]`` at ``positions [T]`` -> the step's index queries (normed, rotated) and raw keys."""
        s, t = self.shape, hidden.shape[0]
        q, k = self.index_qk_proj(hidden).split([s.heads * s.head_dim, s.head_dim], dim=-1)
        q = self._rope(positions, self.q_layernorm(q.view(t, s.heads, s.head_dim)))
        return IndexQuery(q=q, k=k, selector=self)

    def _rope(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """RoPE of the model's rotary dims over the first dims of ``x [N, Hi, Di]`` at ``positions [N]``."""
        r, d = self.rotary.rotary_dim, x.shape[-1]
        cos = self.rotary.cos_table[positions].to(x.dtype)
        sin = self.rotary.sin_table[positions].to(x.dtype)
        one, zero = cos.new_ones(cos.shape[0], d - r), cos.new_zeros(cos.shape[0], d - r)
        return apply_rotary_full(x, torch.cat((cos, cos, one), -1), torch.cat((-sin, sin, zero), -1), r)

    def keep_mask(self, q_idx: torch.Tensor, keys: torch.Tensor, q_offset: int) -> torch.Tensor:
        """See :class:`~ferrylm.models.indexed_attention.BlockSelector`."""
        s, length = self.shape, keys.shape[0]
        positions = torch.arange(q_offset, q_offset + q_idx.shape[0], device=keys.device)
        nb = length // s.ratio
        pooled = keys[:nb * s.ratio].view(nb, s.ratio, keys.shape[1]).float().mean(1).to(keys.dtype)
        starts = torch.arange(nb, device=keys.device) * s.ratio
        blocks = self._rope(starts, self.k_layernorm(pooled)[:, None])[:, 0]
        keep = select_blocks(block_scores(q_idx, blocks), positions, s.ratio, s.top_blocks)
        return token_mask(keep, positions, s.ratio, length)


class IndexedAttention(GatedAttention):
    """Gated attention whose queries read only what their :class:`QsaIndexer` keeps (``attn.attend_indexed``)."""

    def __init__(self, layer_idx: int, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__(layer_idx, config, rotary)
        self.indexer = QsaIndexer(config.hidden_size, IndexerShape.of(config), rotary, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        q, k, v, gate = self.project(positions, hidden)
        out = attn.attend_indexed(self.layer_idx, q, k, v, self.scale, self.indexer.query(positions, hidden))
        return self.output(out, gate)


class Qwen4DecoderLayer(nn.Module):
    """``x [T, n H]``: the mixer and then the MLP, each between its hyper-connection's read and injection."""

    def __init__(self, config: ModelConfig, layer_idx: int, kind: str, rotary: RotaryEmbedding, mlp: nn.Module,
                 ple: PleShape | None, device: torch.device | str | None = None):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        n, rank = positive_int(config.raw, "hc_count", 4), positive_int(config.raw, "hc_lowrank", 320)
        self.kind, self.layer_idx = kind, layer_idx
        has_ple = ple is not None and layer_idx in ple.layers
        self.ple = PleLayer(ple, ple.layers.index(layer_idx), h, n, eps, device) if has_ple else None
        if kind == LINEAR:
            self.linear_attn = Qwen35GatedDeltaNet(layer_idx, h, LinearShape.of(config), eps, gate_activation(config))
        else:
            self.self_attn = IndexedAttention(layer_idx, config, rotary)
        self.mlp = mlp
        self.attn_hyper_connection = HyperConnection(h, n, rank, eps)
        self.mlp_hyper_connection = HyperConnection(h, n, rank, eps)
        self.routing_context = None  # synthetic routing model (models/moe.py)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend,
                ple: tuple[torch.Tensor, object] | None = None) -> torch.Tensor:
        """``x [T, n H]`` -> ``[T, n H]``; ``ple``: this layer's embeddings ``[T, E]`` and the step's recurrent step
        (PLE layers only)."""
        if self.routing_context is not None:
            self.routing_context.bind(positions, self)
        if self.ple is not None:
            x = x + self.ple(x, *ple)
        y, w = self.attn_hyper_connection(x)
        y = self.linear_attn(y, attn) if self.kind == LINEAR else self.self_attn(positions, y, attn)
        x = inject(x, y, w)
        y, w = self.mlp_hyper_connection(x)
        return inject(x, self.mlp(y), w)


class Qwen4Stack(nn.Module):
    """Embedding repeated over the streams, the decoder layers, the final mixer (HF ``model.*``); the MoE blocks'
    executor gets their routers here (``hand_routers``)."""

    def __init__(self, config: ModelConfig, mlps: list[nn.Module], device: torch.device | str | None = None):
        super().__init__()
        self.streams = positive_int(config.raw, "hc_count", 4)
        self.rotary = RotaryEmbedding.from_config(_with_default_rotary(config), device=device, allow_partial=True)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        kinds = layer_kinds(config)
        self.ple_shape = PleShape.of(config, tuple(i for i, k in enumerate(kinds) if k == LINEAR))
        self.layers = nn.ModuleList(Qwen4DecoderLayer(config, i, kinds[i], self.rotary, mlp, self.ple_shape, device)
                                    for i, mlp in enumerate(mlps))
        self.hyper_connection_mixer = HyperConnection(config.hidden_size, self.streams,
                                                      positive_int(config.raw, "hc_lowrank", 320), config.rms_norm_eps,
                                                      inject=False)
        hand_routers(mlps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids).repeat(1, self.streams)
        ple = self._ple_inputs(input_ids, attn, x)
        for layer in self.layers:
            x = layer(positions, x, attn, ple.get(layer.layer_idx))
        return self.hyper_connection_mixer(x)[0]

    def _ple_inputs(self, input_ids: torch.Tensor, attn, x: torch.Tensor) -> dict[int, tuple]:
        """Every PLE layer's embeddings of the step, gathered before the first layer runs (the tokens are known:
        host and disk tables are read ahead of their layers), with the step's recurrent step."""
        if self.ple_shape is None:
            return {}
        rs = getattr(attn, "recurrent", None)
        if rs is None:
            rs = _own_ple_state(attn, self.ple_shape, x)
        shifted = step_ngrams(input_ids, rs, self.ple_shape)
        return {layer.layer_idx: (layer.ple.embed(shifted, x.device).to(x.dtype), rs)
                for layer in self.layers if layer.ple is not None}

    def use_ple_tables(self, tables: dict[int, PleTable]) -> None:
        """Give each PLE layer its table (``tables``: decoder layer -> table). Raises ModelLoadError for a PLE
        layer without one."""
        for layer in self.layers:
            if layer.ple is not None:
                if layer.layer_idx not in tables:
                    raise ModelLoadError(f"checkpoint lacks the PLE table of layer {layer.layer_idx} "
                                         f"(model.layers.{layer.layer_idx}.ple.ple_embedding.ngram_embedding.*)")
                layer.ple.use_table(tables[layer.layer_idx])


def _own_ple_state(attn, shape: PleShape, x: torch.Tensor):
    """A backend without a state pool (``DenseCausalAttention``, ``SequenceCacheAttention``): one sequence whose PLE
    state the backend object keeps (zeros and EOS on the first call), as ``gated_deltanet._own_state`` for DeltaNet."""
    from ferrylm.engine.cache.state_pool import PleStateLayout, RecurrentStep, StateLayout, StatePool

    first = "_ple_state_pool" not in attn.__dict__
    if first:
        ple = PleStateLayout(shape.layers, shape.conv_rows, x.shape[1], shape.order - 1)
        attn.__dict__["_ple_state_pool"] = StatePool(StateLayout((), 1, 2, 1, 1, 1, ple=ple), 1, x.dtype, x.device)
    t, dev = x.shape[0], x.device
    return RecurrentStep(pool=attn.__dict__["_ple_state_pool"], slots=torch.zeros(1, dtype=torch.long, device=dev),
                         fresh=torch.tensor([first], device=dev), query_start_loc=torch.tensor([0, t], device=dev),
                         num_tokens=t, q_lens=[t])


def gate_activation(config: ModelConfig) -> str:
    """The DeltaNet output gate's activation: ``output_gate_type``, else ``hidden_act``. Raises ModelLoadError for
    one without a kernel."""
    act = config.raw.get("output_gate_type") or config.raw.get("hidden_act", "silu")
    if act not in GATE_ACTIVATIONS:
        raise ModelLoadError(f"output_gate_type {act!r} is not supported (only {', '.join(GATE_ACTIVATIONS)})")
    return act


class Qwen4ExpForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen4-Exp causal LM (module docstring); the API of
    :class:`~ferrylm.models.qwen3_next.Qwen3NextForCausalLM`."""

    arch_name = "Qwen4ExpForCausalLM"
    # decode steps run eager (the decode graphs know the single-stream stacks)
    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities(graph_capture=False)

    def __init__(self, config: ModelConfig, *, executor: ExpertExecutor | None = None,
                 device: torch.device | str | None = None):
        nn.Module.__init__(self)
        self.check_config(config)
        if executor is None:
            raise ValueError(f"{self.arch_name} needs an ExpertExecutor")
        self.config = config
        mlps = [self._build_mlp(config, i, executor) for i in range(config.num_layers)]
        self.model = Qwen4Stack(config, mlps, device=device)
        self.set_lm_head(config)

    @classmethod
    def layer_kinds(cls, config: ModelConfig) -> tuple[str, ...]:
        return layer_kinds(config)

    def use_ple_tables(self, tables: dict[int, PleTable]) -> None:
        """See :meth:`Qwen4Stack.use_ple_tables` (the loader's call)."""
        self.model.use_ple_tables(tables)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Raises ModelLoadError naming the field: as Qwen3.5 plus the indexer, ``hc_count`` < 2, an output gate
        without a kernel, per-layer embeddings (not served yet)."""
        super().check_config(config)
        raw = config.raw
        if positive_int(raw, "hc_count", 4) < 2:
            raise ModelLoadError(f"hc_count must be at least 2, got {raw.get('hc_count')!r}")
        positive_int(raw, "hc_lowrank", 320)
        gate_activation(config)
        if FULL in layer_kinds(config):
            IndexerShape.of(config)
        cls.ple_shape(config)

    @classmethod
    def ple_shape(cls, config: ModelConfig) -> PleShape | None:
        """The per-layer embeddings of ``config`` (None: none). Raises ModelLoadError for a bad PLE config."""
        return PleShape.of(config, tuple(i for i, k in enumerate(layer_kinds(config)) if k == LINEAR))

    @classmethod
    def skips_tensor(cls, name: str, config: ModelConfig) -> bool:
        """As Qwen3.5, and the PLE hash buffers (recomputed from the config, :class:`~ferrylm.models.ple.PleLayer`)."""
        return super().skips_tensor(name, config) or name.endswith(
            ("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_vocab_sizes",
             "ple_embedding.ngram_heads_offsets"))

    @classmethod
    def state_layout(cls, config: ModelConfig):
        """The DeltaNet states and, with PLE, each sequence's PLE state."""
        from ferrylm.engine.cache.state_pool import PleStateLayout

        layout, ple = super().state_layout(config), cls.ple_shape(config)
        if ple is None:
            return layout
        n = positive_int(config.raw, "hc_count", 4)
        return dataclasses.replace(layout, ple=PleStateLayout(ple.layers, ple.conv_rows, n * config.hidden_size,
                                                              ple.order - 1))

    @classmethod
    def kv_layout(cls, config: ModelConfig):
        """The attention layers store K/V and one raw index key per token."""
        layout = super().kv_layout(config)
        return dataclasses.replace(layout, index_dim=IndexerShape.of(config).head_dim) if layout.layers else layout
