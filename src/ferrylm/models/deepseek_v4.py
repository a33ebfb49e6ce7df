"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, DeepSeek-V4-Flash / -Pro; DeepSeek-AI 2026, "DeepSeek-V4", and
transformers' ``modeling_deepseek_v4``):

* attention (:class:`~ferrylm.models.deepseek_v4_layers.V4Attention`): one shared key/value head per layer over a
  sliding window plus, by ``layer_types``, the entries of a heavily compressed (HCA, rate 128) or a compressed
  sparse (CSA, rate 4, an indexer's top-k) attention (:mod:`ferrylm.models.compressed_attention`); per-head sinks;
  a grouped low-rank output projection;
* manifold-constrained hyper-connections: ``hc_mult`` residual streams mixed around each block with Sinkhorn-made
  doubly stochastic weights, collapsed by ``hc_head`` before the final norm;
* every layer a MoE of ``n_routed_experts`` with one shared expert, both with the clamped SwiGLU
  (``swiglu_limit``); ``sqrt(softplus)`` router scores, renormalised and scaled by ``routed_scaling_factor``; the
  first ``hash_moe`` layers choose experts by a frozen ``tid2eid[token]`` table, later ones by top-k of
  ``score + bias`` (:class:`~ferrylm.models.sigmoid_moe.SigmoidMoeBlock`), so every expert backend runs them.

Checkpoint names: the published ones (``layers.N.attn.wq_a``, ``layers.N.ffn.experts.E.w1``, ``embed``, ``head``,
``hc_head_fn`` ...) and transformers' ``save_pretrained`` form of them (a ``model.`` prefix, ``embed_tokens``,
``hc_head.hc_fn``); the multi-token-prediction layers (``mtp.*``) are not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ClampedSwiGLU, ExpertExecutor
from ferrylm.models.attention import AttentionBackend
from ferrylm.models.capabilities import ModelCapabilities
from ferrylm.models.deepseek_v4_layers import (AttentionShape, HyperShape, Rope, V4Attention, hyper_head,
                                               hyper_merge, hyper_weights)
from ferrylm.models.layers import RMSNorm, rope_frequencies
from ferrylm.models.moe import hand_routers, router_has_bias
from ferrylm.models.sigmoid_moe import SigmoidMoeBlock, SigmoidRouting, sigmoid_weights

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
_LEGACY_RATIO = {0: SLIDING, 4: CSA, 128: HCA}


def _positive(raw: dict, key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"DeepseekV4ForCausalLM: config field {key!r} must be a positive integer, got {value!r}")
    return value


def _layer_types(raw: dict, n: int) -> list[str]:
    """``layer_types``, else the legacy ``compress_ratios`` (0 / 4 / 128), else transformers' default."""
    kinds = raw.get("layer_types")
    if kinds is None and raw.get("compress_ratios") is not None:
        kinds = [_LEGACY_RATIO.get(r, "?") for r in raw["compress_ratios"]]
    if kinds is None:
        kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    kinds = list(kinds[:n])
    if len(kinds) != n or any(k not in LAYER_TYPES for k in kinds):
        raise ModelLoadError(f"DeepseekV4ForCausalLM: layer_types must name one of {', '.join(LAYER_TYPES)} per "
                             f"layer ({n}), got {kinds!r}")
    return kinds


def _mlp_types(raw: dict, n: int) -> list[str]:
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        hashed = raw.get("num_hash_layers", 3)
        kinds = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    kinds = list(kinds[:n])
    if len(kinds) != n or any(k not in ("hash_moe", "moe") for k in kinds):
        raise ModelLoadError(f"DeepseekV4ForCausalLM: mlp_layer_types must name hash_moe or moe per layer ({n}), "
                             f"got {kinds!r}")
    return kinds


def _rope_params(raw: dict, label: str) -> dict:
    """The ``main`` / ``compress`` RoPE parameters (nested ``rope_parameters``, or the flat legacy form)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(params.get(label), dict):
        return dict(params[label])
    if label == "main":
        return {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
    flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
    return {**flat, "rope_theta": raw.get("compress_rope_theta", 160000.0)}


def _rope(raw: dict, label: str, dim: int, max_positions: int, device: torch.device | str | None = None) -> Rope:
    """A rope's frequencies over ``dim`` dims, on ``device`` (the model's: the forward copies nothing from the host);
    the compressed branch's yarn has no attention factor (as the reference)."""
    params = _rope_params(raw, label)
    theta = float(params.pop("rope_theta", 10000.0))
    params.pop("partial_rotary_factor", None)
    inv_freq, _ = rope_frequencies(dim, theta, params, max_positions=max_positions)
    return Rope(inv_freq if device is None else inv_freq.to(device))


@dataclass(frozen=True)
class V4Shape:
    """What the model reads from its config (:meth:`of`)."""

    attention: AttentionShape
    hyper: HyperShape
    rope_dim: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    rates: dict
    swiglu: ClampedSwiGLU
    routing: SigmoidRouting

    @staticmethod
    def of(config: ModelConfig) -> "V4Shape":
        """Raises ModelLoadError for a missing / bad field."""
        raw, n = config.raw, config.num_layers
        d = config.head_dim
        factor = raw.get("partial_rotary_factor")
        rope_dim = int(d * factor) if factor else int(raw.get("qk_rope_head_dim", 64))
        if rope_dim % 2 or not 0 < rope_dim <= d:
            raise ModelLoadError(f"DeepseekV4ForCausalLM: the rotated dims ({rope_dim}, partial_rotary_factor / "
                                  f"qk_rope_head_dim) must be even and at most head_dim ({d})")
        rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
        rates[CSA] = int(raw.get("compress_rate_csa", rates[CSA]))
        rates[HCA] = int(raw.get("compress_rate_hca", rates[HCA]))
        heads, groups = config.num_heads, _positive(raw, "o_groups", 8)
        if heads % groups:
            raise ModelLoadError(f"DeepseekV4ForCausalLM: o_groups {groups} must divide num_attention_heads {heads}")
        eps = config.rms_norm_eps
        att = AttentionShape(hidden_size=config.hidden_size, num_heads=heads, head_dim=d,
                             q_lora_rank=_positive(raw, "q_lora_rank"), o_groups=groups,
                             o_lora_rank=_positive(raw, "o_lora_rank", 1024), window=_positive(raw, "sliding_window"),
                             eps=eps, index_heads=_positive(raw, "index_n_heads", 64),
                             index_dim=_positive(raw, "index_head_dim", 128), index_topk=_positive(raw, "index_topk"))
        hyper = HyperShape(n=_positive(raw, "hc_mult", 4), iters=_positive(raw, "hc_sinkhorn_iters", 20),
                           eps=float(raw.get("hc_eps", 1e-6)), norm_eps=eps)
        limit = float(raw.get("swiglu_limit", 10.0))
        routing = SigmoidRouting(top_k=config.num_experts_per_tok, renormalize=True, eps=1e-20,
                                 scale=float(raw.get("routed_scaling_factor", 1.5)),
                                 scoring=raw.get("scoring_func", "sqrtsoftplus"))
        return V4Shape(attention=att, hyper=hyper, rope_dim=rope_dim, layer_types=tuple(_layer_types(raw, n)),
                       mlp_types=tuple(_mlp_types(raw, n)), rates=rates, swiglu=ClampedSwiGLU(1.0, limit, 0.0),
                       routing=routing)


class ClampedMLP(nn.Module):
    """The shared expert: ``w2 (silu(min(w1 x, L)) * clamp(w3 x, -L, L))``."""

    def __init__(self, hidden_size: int, width: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden_size, width, bias=False)
        self.w3 = nn.Linear(hidden_size, width, bias=False)
        self.w2 = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.w1(x).clamp(max=self.limit)
        return self.w2(F.silu(g) * self.w3(x).clamp(-self.limit, self.limit))


class HashRouter(nn.Module):
    """A hash layer's router: ``weight [E, H]`` scores, the frozen choice ``tid2eid [vocab, k]``."""

    def __init__(self, hidden_size: int, num_experts: int, vocab_size: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.long))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight.float())


class HashMoeBlock(SigmoidMoeBlock):
    """A ``hash_moe`` layer: the experts of each token are ``tid2eid[token]``, weighted by the router's scores at
    them (renormalised, scaled). The step's token ids are bound before the layer runs (:meth:`bind_tokens`)."""

    def __init__(self, layer_idx: int, hidden_size: int, num_experts: int, executor: ExpertExecutor,
                 rule: SigmoidRouting, vocab_size: int, shared_experts: nn.Module):
        super().__init__(layer_idx, hidden_size, num_experts, executor, rule, shared_experts=shared_experts)
        self.gate = HashRouter(hidden_size, num_experts, vocab_size, rule.top_k)
        self.token_ids: torch.Tensor | None = None

    def bind_tokens(self, token_ids: torch.Tensor) -> None:
        self.token_ids = token_ids

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.gate.tid2eid[self.token_ids]
        return ids, sigmoid_weights(self.gate(hidden), ids, self.rule)

    def predict_experts(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gate.tid2eid[self.token_ids]


class V4DecoderLayer(nn.Module):
    """Attention and MoE blocks, each between two hyper-connection mixes of the ``[T, n, H]`` streams."""

    def __init__(self, config: ModelConfig, layer_idx: int, shape: V4Shape, ropes: dict[str, Rope], mlp: nn.Module):
        super().__init__()
        kind, h, n = shape.layer_types[layer_idx], config.hidden_size, shape.hyper.n
        self.hyper = shape.hyper
        self.attn_norm = RMSNorm(h, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(h, config.rms_norm_eps)
        rate = 0 if kind == SLIDING else shape.rates[kind]
        self.attn = V4Attention(layer_idx, shape.attention, ropes["main" if kind == SLIDING else "compress"], rate,
                                kind == CSA)
        self.mlp = mlp
        rows = (2 + n) * n
        for block in ("attn", "ffn"):
            setattr(self, f"hc_{block}_fn", nn.Parameter(torch.empty(rows, n * h, dtype=torch.float32)))
            setattr(self, f"hc_{block}_base", nn.Parameter(torch.empty(rows, dtype=torch.float32)))
            setattr(self, f"hc_{block}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``x [T, n, H]`` -> ``[T, n, H]``."""
        post, comb, collapsed = hyper_weights(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.hyper)
        x = hyper_merge(x, self.attn(positions, self.attn_norm(collapsed), attn), post, comb)
        post, comb, collapsed = hyper_weights(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.hyper)
        return hyper_merge(x, self.mlp(self.ffn_norm(collapsed)), post, comb)


class V4Layers(nn.Module):
    """The decoder layers (``model.layers``); the MoE blocks' executor gets their routers here (``hand_routers``)."""

    def __init__(self, layers: list[V4DecoderLayer]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        hand_routers([layer.mlp for layer in layers])


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 causal LM (module docstring); same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`.

    Raises:
        ModelLoadError: a bad config field (``layer_types``, rates, shapes, routing);
        ValueError: no executor given.
    """

    arch_name = "DeepseekV4ForCausalLM"
    hf_renames = (("model.", ""), ("layers.", "model.layers."), (".ffn.", ".mlp."), ("hc_head.hc_", "hc_head_"),
                  ("embed_tokens.", "embed."), (".gate.bias", ".gate.e_score_correction_bias"))
    float32_tensors = ("gate.e_score_correction_bias", "attn_sink", ".ape", "_fn", "_base", "_scale")
    partial_rotary = True
    fused_experts = "halves"
    # decode graphs capture the whole step (the pieces cut single-stream layers only)
    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities(piecewise_graphs=False)

    def __init__(self, config: ModelConfig, *, executor: ExpertExecutor | None = None,
                 device: torch.device | str | None = None):
        if executor is None:
            raise ValueError(f"{self.arch_name} needs an ExpertExecutor")
        super().__init__()
        self.check_config(config)
        self.config = config
        shape = self.shape = V4Shape.of(config)
        ropes = {label: _rope(config.raw, label, shape.rope_dim, config.max_position_embeddings, device)
                 for label in ("main", "compress")}
        layers = [V4DecoderLayer(config, i, shape, ropes, self._build_mlp(config, shape, i, executor))
                  for i in range(config.num_layers)]
        self.model = V4Layers(layers)
        h, n = config.hidden_size, shape.hyper.n
        self.embed = nn.Embedding(config.vocab_size, h)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.head = nn.Linear(h, config.vocab_size, bias=False)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * h, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        if config.raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {config.raw.get('hidden_act')!r} is not supported (only 'silu')")
        if config.num_kv_heads != 1:
            raise ModelLoadError(f"{cls.arch_name}: num_key_value_heads must be 1, got {config.num_kv_heads}")
        if not config.is_moe:
            raise ModelLoadError(f"{cls.arch_name} config needs n_routed_experts >= 1")
        shape = V4Shape.of(config)
        shape.routing.check(config.num_experts, cls.arch_name)
        for label in ("main", "compress"):
            _rope(config.raw, label, shape.rope_dim, config.max_position_embeddings)

    @classmethod
    def kv_layout(cls, config: ModelConfig):
        """Per token and layer one window row ``[1, D]`` (keys are values); per block of a compressing layer its
        entry and its pools (``engine/attention/compressed_pages.py``), and a CSA layer's indexer key and pools."""
        from ferrylm.engine.cache.kv_pool import BlockSpec, KVLayout

        shape, d = V4Shape.of(config), config.head_dim
        blocks = []
        for i, kind in enumerate(shape.layer_types):
            if kind == SLIDING:
                continue
            m = shape.rates[kind]
            blocks += [BlockSpec(i, "compressor", m, d), BlockSpec(i, "compressor_carry", m, 4 * d, float32=True)]
            if kind == CSA:
                di = shape.attention.index_dim
                blocks += [BlockSpec(i, "indexer", m, di), BlockSpec(i, "indexer_carry", m, 4 * di, float32=True)]
        return KVLayout(num_layers=config.num_layers, layers=tuple(range(config.num_layers)), k_heads=1, k_dim=d,
                        v_heads=0, v_dim=0, blocks=tuple(blocks))

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        """Every layer is MoE."""
        return tuple(range(config.num_layers))

    @classmethod
    def skips_tensor(cls, name: str, config: ModelConfig) -> bool:
        """The multi-token-prediction module (``mtp.*``) is not read."""
        return name.startswith(("mtp.", "model.mtp."))

    @classmethod
    def expert_swiglu(cls, config: ModelConfig) -> ClampedSwiGLU:
        """Plain SiLU gate, clamped at ``swiglu_limit``, no up shift, no biases."""
        return V4Shape.of(config).swiglu

    def _build_mlp(self, config: ModelConfig, shape: V4Shape, layer_idx: int, executor: ExpertExecutor) -> nn.Module:
        width = max(1, int(config.raw.get("n_shared_experts", 1))) * config.moe_intermediate_size
        shared = ClampedMLP(config.hidden_size, width, shape.swiglu.limit)
        if shape.mlp_types[layer_idx] == "hash_moe":
            return HashMoeBlock(layer_idx, config.hidden_size, config.num_experts, executor, shape.routing,
                                config.vocab_size, shared)
        return SigmoidMoeBlock(layer_idx, config.hidden_size, config.num_experts, executor, shape.routing,
                               shared_experts=shared, router_bias=router_has_bias(config))

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> final-normed hidden ``[T, H]``."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, HashMoeBlock):
                layer.mlp.bind_tokens(input_ids)
        x = self.embed(input_ids)[:, None, :].expand(-1, self.shape.hyper.n, -1).contiguous()
        for layer in self.model.layers:
            x = layer(positions, x, attn)
        return self.norm(hyper_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.shape.hyper))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` -> ``[N, V]`` float32 logits."""
        return self.head(hidden).float()
