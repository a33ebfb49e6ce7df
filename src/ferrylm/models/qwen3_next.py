"""Qwen3-Next (``Qwen3NextForCausalLM``, Qwen3-Next-80B-A3B) and Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``,
Qwen3.5-35B-A3B): hybrid decoders of Gated DeltaNet layers and gated full-attention layers, every MLP a sparse MoE
block with a sigmoid-gated shared expert.

Layer pattern: config ``layer_types`` (``"linear_attention"`` / ``"full_attention"``), else every
``full_attention_interval``-th layer (default 4) is full attention: layer ``i`` is linear when
``(i + 1) % interval != 0``.

* Gated DeltaNet: the linear-attention token mixer (``models/gated_deltanet.py``; Qwen3-Next packs its projections
  per key-head group, Qwen3.5 keeps four matrices).
* Gated attention: ``q_proj`` gives per head ``[q | gate]`` (``2 D``), q/k get a zero-centred RMSNorm per head
  (``x * rsqrt(mean x^2 + eps) * (1 + w)``), RoPE over the first ``partial_rotary_factor * D`` dims (0.25 when the
  config names none, the reference's default), ``attention(q, k, v) * sigmoid(gate)``, ``o_proj``.
* Norms of the residual stream (input / post-attention / final) are zero-centred too.
* MoE: softmax router, top ``num_experts_per_tok``, renormalised when ``norm_topk_prob`` (Qwen3-Next; always for
  Qwen3.5), plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (``models/moe.SparseMoeBlock``).

State: only the full-attention layers store K/V (:meth:`Qwen3NextForCausalLM.kv_layout`); each linear layer keeps a
per-sequence recurrent state in the engine's state pool (``engine/cache/state_pool.py``,
:meth:`Qwen3NextForCausalLM.state_layout`), reached through ``attn.recurrent``. Without one (a reference backend
such as ``models/reference_attention.DenseCausalAttention``) the backend object holds one sequence's state itself.

Checkpoint names follow transformers: ``model.layers.N.linear_attn.{in_proj_qkvz,in_proj_ba,conv1d,A_log,dt_bias,
norm,out_proj}``, ``model.layers.N.self_attn.{q,k,v,o}_proj / q_norm / k_norm``, ``mlp.gate``, ``mlp.experts``,
``mlp.shared_expert``, ``mlp.shared_expert_gate``. Multi-token-prediction tensors (``mtp.*``) are not read; a
Qwen3.5 checkpoint's ``model.language_model.*`` names map onto ``model.*`` and its vision tower is not read.
Decode CUDA graphs: the whole-step graphs (``engine/cuda_graphs.py``) and the piecewise graphs of the offloading
backends (``engine/decode_graph.py``) capture these models, the linear layers reading static slot / fresh buffers.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.attention import AttentionBackend
from ferrylm.models.capabilities import ModelCapabilities
from ferrylm.models.gated_deltanet import (GatedDeltaNet, LinearShape, Qwen3NextGatedDeltaNet, Qwen35GatedDeltaNet,
                                           ZeroCentredRMSNorm, positive_int)
from ferrylm.models.kernels import gated_delta as gd
from ferrylm.models.layers import RotaryEmbedding, SwiGLUMLP
from ferrylm.models.llama import DecoderStack, StackCausalLM, check_decoder_config
from ferrylm.models.moe import SparseMoeBlock, check_moe_config, router_has_bias, sparse_layer_indices
from ferrylm.models.quant_linear import FusedLinears

LINEAR, FULL = "linear_attention", "full_attention"


# --- config ---------------------------------------------------------------------------------------------------


def layer_types(config: ModelConfig) -> tuple[str, ...]:
    """Each layer's token mixer (``"linear_attention"`` or ``"full_attention"``): ``layer_types``, else from
    ``full_attention_interval`` (module docstring).

    Raises:
        ModelLoadError: ``layer_types`` of the wrong length or with another kind; a bad interval.
    """
    raw = config.raw
    types = raw.get("layer_types")
    if types is None:
        every = positive_int(raw, "full_attention_interval", 4)
        return tuple(LINEAR if (i + 1) % every else FULL for i in range(config.num_layers))
    if not isinstance(types, list) or len(types) < config.num_layers:
        raise ModelLoadError(f"config field 'layer_types' must list the {config.num_layers} layers' kinds, got "
                             f"{types!r}")
    bad = [t for t in types if t not in (LINEAR, FULL)]
    if bad:
        raise ModelLoadError(f"config field 'layer_types': unsupported layer kind {bad[0]!r} (only {LINEAR!r} and "
                             f"{FULL!r})")
    return tuple(types[:config.num_layers])


def _with_default_rotary(config: ModelConfig) -> ModelConfig:
    """``config`` with ``partial_rotary_factor`` 0.25 when it names none (the reference config's default)."""
    raw = config.raw
    named = raw.get("rotary_dim") is not None or raw.get("partial_rotary_factor") is not None or any(
        isinstance(p, dict) and p.get("partial_rotary_factor") is not None
        for p in (raw.get("rope_parameters"), raw.get("rope_scaling")))
    return config if named else dataclasses.replace(config, raw={**raw, "partial_rotary_factor": 0.25})


# --- the gated full-attention layer ----------------------------------------------------------------------------


class GatedAttention(FusedLinears):
    """GQA attention with an output gate and zero-centred per-head q/k norms (module docstring); q (with its gate),
    k and v from one matrix multiply once fused.

    Args:
        layer_idx: passed to ``attn.attend``; config: the model config (heads, ``head_dim``, ``attention_bias``,
            ``rms_norm_eps``); rotary: the model's partial RoPE.
    """

    def __init__(self, layer_idx: int, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        h, hq, hk, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        bias = bool(config.raw.get("attention_bias", False))
        self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim = layer_idx, hq, hk, d
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(h, hq * d * 2, bias=bias)
        self.k_proj = nn.Linear(h, hk * d, bias=bias)
        self.v_proj = nn.Linear(h, hk * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, h, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``hidden [T, H]`` at ``positions [T]`` -> ``[T, H]``; K/V go through ``attn``."""
        q, k, v, gate = self.project(positions, hidden)
        return self.output(attn.attend(self.layer_idx, q, k, v, self.scale), gate)

    def project(self, positions: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden [T, H]`` -> ``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], gate [T, Hq, D])``, q/k normed and
        rotated."""
        t, hq, hk, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.projections(hidden)
        q, gate = qg.unflatten(-1, (hq, 2 * d)).split([d, d], dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.unflatten(-1, (hk, d)))
        v = v.unflatten(-1, (hk, d))
        q, k = self.rotary(positions, q, k)
        return q, k, v, gate

    def fused_children(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj]

    def output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Attention output ``[T, Hq, D]`` gated by ``sigmoid(gate)``, through ``o_proj`` -> ``[T, H]``."""
        t = out.shape[0]
        return self.o_proj(out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))


# --- decoder ----------------------------------------------------------------------------------------------------


class HybridDecoderLayer(nn.Module):
    """``h = x + mixer(norm1(x)); y = h + mlp(norm2(h))`` with a Gated DeltaNet (``linear_attn``) or a gated
    attention (``self_attn``) as the mixer."""

    def __init__(self, config: ModelConfig, layer_idx: int, kind: str, rotary: RotaryEmbedding, mlp: nn.Module,
                 linear_cls: type[GatedDeltaNet]):
        super().__init__()
        self.kind = kind
        self.layer_idx = layer_idx
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == LINEAR:
            self.linear_attn = linear_cls(layer_idx, config.hidden_size, LinearShape.of(config), config.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(layer_idx, config, rotary)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.routing_context = None  # synthetic routing model (models/moe.py)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``."""
        h = self.attention_residual(positions, x, attn)
        return h + self.mlp(self.post_attention_layernorm(h))

    def attention_residual(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``x + mixer(input_layernorm(x))`` (binds ``positions`` into a routing model's context first)."""
        if self.routing_context is not None:
            self.routing_context.bind(positions, self)
        y = self.input_layernorm(x)
        if self.kind == LINEAR:
            return x + self.linear_attn(y, attn)
        return x + self.self_attn(positions, y, attn)


class HybridStack(DecoderStack):
    """:class:`~ferrylm.models.llama.DecoderStack` of hybrid decoder layers with the final zero-centred norm (HF
    ``model.*``)."""

    def __init__(self, config: ModelConfig, mlps: list[nn.Module], linear_cls: type[GatedDeltaNet],
                 device: torch.device | str | None = None):
        nn.Module.__init__(self)
        rotary = RotaryEmbedding.from_config(_with_default_rotary(config), device=device, allow_partial=True)
        kinds = layer_types(config)
        self._assemble(config, mlps, rotary,
                       lambda i, mlp: HybridDecoderLayer(config, i, kinds[i], rotary, mlp, linear_cls),
                       ZeroCentredRMSNorm)


class Qwen3NextForCausalLM(StackCausalLM):
    """Qwen3-Next causal LM; the API of :class:`~ferrylm.models.llama.LlamaForCausalLM` (``forward(input_ids [T],
    positions [T], attn) -> [T, H]``, ``compute_logits``), plus :meth:`kv_layout` / :meth:`state_layout`.

    Raises:
        ModelLoadError: an unsupported config (activation, heads, layer kinds, linear dims, experts, rotary);
        ValueError: a MoE layer exists and no executor was given.
    """

    arch_name = "Qwen3NextForCausalLM"
    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities()
    linear_cls: type[GatedDeltaNet] = Qwen3NextGatedDeltaNet
    hf_renames: tuple[tuple[str, str], ...] = ()
    float32_tensors: tuple[str, ...] = ()
    tensor_weights: tuple[str, ...] = ()
    partial_rotary = True
    fused_experts = "halves"

    @classmethod
    def expert_swiglu(cls, config: ModelConfig) -> None:
        """Plain SwiGLU experts (see :meth:`~ferrylm.models.llama.LlamaForCausalLM.expert_swiglu`)."""
        return None

    def __init__(self, config: ModelConfig, *, executor: ExpertExecutor | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.check_config(config)
        if executor is None and self.moe_layer_indices(config):
            raise ValueError(f"{self.arch_name} needs an ExpertExecutor")
        self.config = config
        mlps = [self._build_mlp(config, i, executor) for i in range(config.num_layers)]
        self.model = HybridStack(config, mlps, self.linear_cls, device=device)
        self.set_lm_head(config)

    # --- what the engine and the loader ask the class ---------------------------------------------------------
    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        check_decoder_config(_with_default_rotary(config), allow_partial_rotary=True)
        kinds = cls.layer_kinds(config)
        if LINEAR in kinds:
            LinearShape.of(config)
        if config.is_moe or cls.moe_layer_indices(config):
            check_moe_config(config, cls.arch_name)
        if len(cls.moe_layer_indices(config)) < config.num_layers and config.intermediate_size < 1:
            raise ModelLoadError(f"{cls.arch_name}: dense layers need intermediate_size, got "
                                 f"{config.intermediate_size}")

    @classmethod
    def layer_kinds(cls, config: ModelConfig) -> tuple[str, ...]:
        """Each layer's mixer, ``LINEAR`` or ``FULL`` (:func:`layer_types`)."""
        return layer_types(config)

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        return sparse_layer_indices(config)

    @classmethod
    def renormalize(cls, config: ModelConfig) -> bool:
        return bool(config.raw.get("norm_topk_prob", True))

    @classmethod
    def skips_tensor(cls, name: str, config: ModelConfig) -> bool:
        """Multi-token-prediction (``mtp.*``) and vision-tower tensors are not read."""
        return name.startswith(("mtp.", "model.visual.", "visual.", "model.mtp."))

    @classmethod
    def kv_layout(cls, config: ModelConfig):
        """Only the full-attention layers store K/V (``engine/cache/kv_pool.KVLayout``)."""
        from ferrylm.engine.cache.kv_pool import KVLayout

        full = tuple(i for i, k in enumerate(cls.layer_kinds(config)) if k == FULL)
        return KVLayout(num_layers=config.num_layers, layers=full, k_heads=config.num_kv_heads, k_dim=config.head_dim,
                        v_heads=config.num_kv_heads, v_dim=config.head_dim)

    @classmethod
    def state_layout(cls, config: ModelConfig):
        """The linear layers' per-sequence state (``engine/cache/state_pool.StateLayout``), or None without any."""
        from ferrylm.engine.cache.state_pool import StateLayout

        linear = tuple(i for i, k in enumerate(cls.layer_kinds(config)) if k == LINEAR)
        if not linear:
            return None
        s = LinearShape.of(config)
        return StateLayout(layers=linear, conv_channels=s.conv_channels, conv_kernel=s.conv_kernel,
                           heads=s.value_heads, key_dim=s.key_dim, value_dim=s.value_dim)

    @classmethod
    def synthetic_constant(cls, name: str) -> float | None:
        """Constant initial values of a synthetic model's tensors: zero-centred norms 0 (they scale by 1 + w), the
        DeltaNet gated norm 1, ``A_log`` 0 and ``dt_bias`` 0 (a decay of ``exp(-softplus(a))`` per token)."""
        if name.endswith("linear_attn.norm.weight"):
            return 1.0
        if name.endswith("norm.weight"):
            return 0.0
        if name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
            return 0.0
        return None

    @classmethod
    def workspace_extra_bytes(cls, config: ModelConfig, tokens: int) -> int:
        """Peak scratch of one linear layer's chunk form over a prefill chunk of ``tokens`` (bytes, float32): the
        chunked q / k / v and the solved ``[beta V | beta G K]`` (``~ 3 Dk + 2 Dv`` per token and head) and the
        ``C x C`` decay, ``K K^T``, ``A`` and ``Q K^T`` matrices (``4 C``), ``C = 64``. The boot plan adds it to
        the estimated workspace on the CPU (on CUDA the warmup's full chunk measures it)."""
        if LINEAR not in cls.layer_kinds(config):
            return 0
        s = LinearShape.of(config)
        return 4 * tokens * s.value_heads * (3 * s.key_dim + 3 * s.value_dim + 4 * gd.DEFAULT_CHUNK)

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        if layer_idx not in self.moe_layer_indices(config):
            return SwiGLUMLP(config.hidden_size, config.intermediate_size)
        width = int(config.raw.get("shared_expert_intermediate_size") or 0)
        shared = SwiGLUMLP(config.hidden_size, width) if width > 0 else None
        return SparseMoeBlock(layer_idx, config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              executor, renormalize=self.renormalize(config), router_bias=router_has_bias(config),
                              shared_expert=shared)


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE's text model: Qwen3-Next with four DeltaNet projections and a router that always renormalises.
    A multimodal checkpoint's text tower (``model.language_model.*``) loads under the same names."""

    arch_name = "Qwen3_5MoeForCausalLM"
    linear_cls = Qwen35GatedDeltaNet
    hf_renames = (("model.language_model.", "model."),)

    @classmethod
    def renormalize(cls, config: ModelConfig) -> bool:
        return True
