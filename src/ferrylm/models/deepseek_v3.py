"""DeepSeek-V3 / DeepSeek-R1 / Kimi-K2 (``DeepseekV3ForCausalLM``; DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report"): the Llama decoder's pre-norm blocks with

* multi-head latent attention (:class:`LatentAttention`; DeepSeek-V2 paper §2.1): queries through a low-rank
  ``q_a_proj -> q_a_layernorm -> q_b_proj`` (``q_lora_rank`` set) or one ``q_proj`` (``q_lora_rank`` null, as
  DeepSeek-V2-Lite), keys and values from the compressed latent ``c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:R])``
  and a decoupled rope key ``k_pe`` shared by all heads; the KV pool keeps ``[c ; k_pe]`` per token (``kv_layout``:
  one ``R + P`` row, no V), and the attention backend computes over it (``attend_latent``,
  :mod:`ferrylm.models.latent_attention`: absorbed for decode, expanded or absorbed for prefill chunks);
* RoPE over the ``qk_rope_head_dim`` dims only; with ``rope_interleave`` (the default of the published checkpoints)
  the pairs are adjacent dims ``(2i, 2i + 1)``: they are gathered into the half-split layout first (evens then
  odds), the same permutation for queries and keys, so the scores are those of the interleaved rotation; yarn
  scaling as :func:`~ferrylm.models.layers.rope_frequencies`, and the softmax scale
  ``(N + P) ** -0.5 * mscale(factor, mscale_all_dim) ** 2`` (``0.1 * m * ln(factor) + 1``; YaRN, Peng et al. 2023,
  as DeepSeek-V2's reference applies it);
* DeepSeekMoE (V3 paper §2.1.2): the first ``first_k_dense_replace`` layers a dense SwiGLU of
  ``intermediate_size``; every later layer ``n_routed_experts`` experts of ``moe_intermediate_size`` chosen by the
  ``noaux_tc`` rule (sigmoid scores, selection on ``score + e_score_correction_bias`` restricted to the best
  ``topk_group`` of ``n_group`` groups, weights the plain scores renormalised per ``norm_topk_prob`` times
  ``routed_scaling_factor``) — :class:`~ferrylm.models.sigmoid_moe.SigmoidMoeBlock`, so every expert backend runs it
  unchanged — plus ``n_shared_experts`` ungated shared experts fused into one SwiGLU.

Checkpoint names are transformers'/DeepSeek's (``self_attn.q_a_proj`` ... ``mlp.gate.e_score_correction_bias``,
``mlp.experts.E.{gate,up,down}_proj``, ``mlp.shared_experts.*``); the published checkpoints' multi-token-prediction
layers (``model.layers.<num_hidden_layers>...``) are not read. FP8 block checkpoints go through
:mod:`ferrylm.checkpoints.quant.fp8`: routed experts stay FP8, MLA's own linears are dequantized to the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.attention import AttentionBackend
from ferrylm.models.glm4_moe import DensePrefixMoeForCausalLM, grouped_routing
from ferrylm.models.latent_attention import LatentProjection
from ferrylm.models.layers import RMSNorm, RotaryEmbedding, rope_frequencies
from ferrylm.models.llama import DecoderLayer, DecoderStack
from ferrylm.models.sigmoid_moe import SigmoidRouting, check_sigmoid_config

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the reference builds them with its RMSNorm default


def _yarn_mscale(factor: float, m: float) -> float:
    """YaRN's attention temperature ``0.1 * m * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAShape:
    """One MLA layer's shape, from the config.

    Attributes:
        hidden_size, num_heads: ``H_model`` and ``H``.
        q_lora_rank: the query's low rank, or None (one ``q_proj``).
        kv_lora_rank: ``R``; nope_dim, rope_dim, v_dim: ``N``, ``P``, ``V`` per head.
        bias: ``attention_bias`` (on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``; never on ``q_proj`` or
            ``q_b_proj``, as the reference).
        interleave: ``rope_interleave``.
        scale: the softmax scale.
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    bias: bool
    interleave: bool
    scale: float

    @staticmethod
    def of(config: ModelConfig) -> "MLAShape":
        """Read the MLA fields. Raises ModelLoadError for a missing / non-positive field or an odd rope dim."""
        raw = config.raw

        def positive(key: str) -> int:
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"{config.architecture}: config field {key!r} must be a positive integer, "
                                     f"got {value!r}")
            return value

        q_lora = raw.get("q_lora_rank")
        q_lora = None if q_lora is None else positive("q_lora_rank")
        nope, rope = positive("qk_nope_head_dim"), positive("qk_rope_head_dim")
        if rope % 2:
            raise ModelLoadError(f"{config.architecture}: qk_rope_head_dim must be even, got {rope}")
        scale = (nope + rope) ** -0.5
        scaling = config.rope_scaling or {}
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        if kind != "default" and scaling.get("mscale_all_dim"):
            m = _yarn_mscale(float(scaling.get("factor") or 1.0), float(scaling["mscale_all_dim"]))
            scale *= m * m
        return MLAShape(hidden_size=config.hidden_size, num_heads=config.num_heads, q_lora_rank=q_lora,
                        kv_lora_rank=positive("kv_lora_rank"), nope_dim=nope, rope_dim=rope,
                        v_dim=positive("v_head_dim"), bias=bool(raw.get("attention_bias", False)),
                        interleave=bool(raw.get("rope_interleave", True)), scale=scale)


class LatentAttention(nn.Module):
    """Multi-head latent attention of one layer (module docstring); K/V storage is the backend's job.

    Args:
        layer_idx: passed to ``attn.attend_latent``.
        shape: :class:`MLAShape`.
        rotary: the model's shared RoPE over ``P`` dims.

    State-dict names: ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, ``kv_a_proj_with_mqa``,
    ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``.
    """

    def __init__(self, layer_idx: int, shape: MLAShape, rotary: RotaryEmbedding):
        super().__init__()
        s = shape
        self.layer_idx = layer_idx
        self.shape = s
        self.scale = s.scale
        qk = s.nope_dim + s.rope_dim
        if s.q_lora_rank is None:
            self.q_proj = nn.Linear(s.hidden_size, s.num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(s.hidden_size, s.q_lora_rank, bias=s.bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(s.q_lora_rank, s.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(s.hidden_size, s.kv_lora_rank + s.rope_dim, bias=s.bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, s.num_heads * (s.nope_dim + s.v_dim), bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.v_dim, s.hidden_size, bias=s.bias)
        self.rotary = rotary
        self._proj: LatentProjection | None = None

    def projection(self) -> LatentProjection:
        """The per-head views of ``kv_b_proj`` (made once, again only if the parameter was replaced)."""
        w = self.kv_b_proj.weight
        if self._proj is None or self._proj.weight is not w:
            s = self.shape
            self._proj = LatentProjection.of(w, s.num_heads, s.nope_dim, s.v_dim)
        return self._proj

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``hidden [T, H_model]`` at ``positions [T]`` -> ``[T, H_model]``; the latent goes through ``attn``."""
        s, t = self.shape, hidden.shape[0]
        if s.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(t, s.num_heads, s.nope_dim + s.rope_dim)
        latent = self.kv_a_proj_with_mqa(hidden)
        c_kv = self.kv_a_layernorm(latent[:, :s.kv_lora_rank])
        pe = torch.cat((q[..., s.nope_dim:], latent[:, None, s.kv_lora_rank:]), dim=1)  # [T, H + 1, P]
        if s.interleave:  # pairs (2i, 2i+1) -> (i, i + P/2): the half-split layout the rotary tables use
            pe = pe.unflatten(-1, (s.rope_dim // 2, 2)).transpose(-1, -2).flatten(-2)
        pe = self.rotary.rotate(positions, pe)
        out = attn.attend_latent(self.layer_idx, q[..., :s.nope_dim], pe[:, :s.num_heads], c_kv, pe[:, s.num_heads],
                                 self.projection(), self.scale)
        return self.o_proj(out.reshape(t, s.num_heads * s.v_dim))


class LatentDecoderLayer(DecoderLayer):
    """:class:`~ferrylm.models.llama.DecoderLayer` with :class:`LatentAttention` as ``self_attn`` (same forward)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module,
                 shape: MLAShape):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LatentAttention(layer_idx, shape, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.routing_context = None
        self.tp_reduce = None  # tensor parallel does not split latent attention (refused before loading)


class LatentDecoderStack(DecoderStack):
    """:class:`~ferrylm.models.llama.DecoderStack` of :class:`LatentDecoderLayer`; its ``rotary`` rotates the
    ``P`` rope dims (so the decode graphs size their RoPE buffers by ``P``)."""

    def __init__(self, config: ModelConfig, mlps: list[nn.Module], shape: MLAShape,
                 device: torch.device | str | None = None):
        nn.Module.__init__(self)
        inv_freq, factor = rope_frequencies(shape.rope_dim, config.rope_theta, config.rope_scaling,
                                            max_positions=config.max_position_embeddings,
                                            original_max_positions=config.raw.get("original_max_position_embeddings"))
        rotary = RotaryEmbedding(shape.rope_dim, config.max_position_embeddings, inv_freq, factor, device=device)
        self._assemble(config, mlps, rotary, lambda i, mlp: LatentDecoderLayer(config, i, rotary, mlp, shape), RMSNorm)


def deepseek_routing(config: ModelConfig) -> SigmoidRouting:
    """The ``noaux_tc`` rule from the config (transformers' DeepseekV3 defaults for absent fields: 8 groups, best 4,
    renormalised, scale 2.5). Raises ModelLoadError for a non-numeric ``routed_scaling_factor``."""
    return grouped_routing(config, n_group=8, topk_group=4, scale=2.5)


class DeepseekV3ForCausalLM(DensePrefixMoeForCausalLM):
    """DeepSeek-V3 causal LM (module docstring); same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`.

    Raises:
        ModelLoadError: a missing MLA field, ``topk_method`` other than ``noaux_tc`` / ``scoring_func`` other than
            ``sigmoid`` (DeepSeek-V2's softmax routers are another rule), routing fields out of range, a negative
            ``first_k_dense_replace`` / ``n_shared_experts``, dense layers without ``intermediate_size``, an
            activation other than SiLU or an unsupported RoPE type;
        ValueError: a MoE layer exists and no executor was given.
    """

    arch_name = "DeepseekV3ForCausalLM"
    # the reference keeps the router (weight and selection bias) in float32 whatever the load dtype
    float32_tensors = ("gate.e_score_correction_bias", "mlp.gate.weight")
    tensor_weights = ("kv_b_proj",)  # the latent attention's absorbed projection (models/latent_attention.py)
    first_dense_default = 3

    def __init__(self, config: ModelConfig, *, executor: ExpertExecutor | None = None,
                 device: torch.device | str | None = None):
        if executor is None and self.moe_layer_indices(config):
            raise ValueError(f"{self.arch_name} needs an ExpertExecutor")
        nn.Module.__init__(self)
        self.check_config(config)
        self.config = config
        shape = MLAShape.of(config)
        mlps = [self._build_mlp(config, i, executor) for i in range(config.num_layers)]
        self.model = LatentDecoderStack(config, mlps, shape, device=device)
        self.set_lm_head(config)

    @classmethod
    def kv_layout(cls, config: ModelConfig):
        """One ``[1, kv_lora_rank + qk_rope_head_dim]`` row per token and layer, no V (the latent and the rope key)."""
        from ferrylm.engine.cache.kv_pool import KVLayout

        s = MLAShape.of(config)
        return KVLayout(num_layers=config.num_layers, layers=tuple(range(config.num_layers)), k_heads=1,
                        k_dim=s.kv_lora_rank + s.rope_dim, v_heads=0, v_dim=0)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        raw = config.raw
        for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            if raw.get(key) not in (None, want):
                raise ModelLoadError(f"{cls.arch_name}: {key} {raw.get(key)!r} is not supported (only {want!r})")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act {act!r} is not supported (only 'silu')")
        shape = MLAShape.of(config)
        rope_frequencies(shape.rope_dim, config.rope_theta, config.rope_scaling,
                         max_positions=config.max_position_embeddings)
        cls.check_layer_plan(config)
        if cls.moe_layer_indices(config):
            check_sigmoid_config(config, deepseek_routing(config), cls.arch_name)

    @classmethod
    def routing(cls, config: ModelConfig) -> SigmoidRouting:
        return deepseek_routing(config)
