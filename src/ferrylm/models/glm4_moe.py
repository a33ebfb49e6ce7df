"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (``Glm4MoeForCausalLM``; Zeng et al. 2025, "GLM-4.5: Agentic, Reasoning, and
Coding (ARC) Foundation Models"): the Llama decoder with

* attention: q/k/v biases per ``attention_bias`` (none on the output), per-head q/k RMSNorm when ``use_qk_norm``
  (GLM-4.5: on, GLM-4.5-Air: off), partial rotary over the first ``int(head_dim * partial_rotary_factor)`` dims
  of each head (0.5 in the published configs; half-split pairing within them, the rest unrotated);
* the first ``first_k_dense_replace`` layers a dense SwiGLU MLP of ``intermediate_size``; every later layer a
  sparse block: ``n_routed_experts`` experts of ``moe_intermediate_size`` chosen by a biased sigmoid router with
  group-limited top-k (``n_group`` / ``topk_group``), weights renormalised per ``norm_topk_prob`` and scaled by
  ``routed_scaling_factor`` (:mod:`ferrylm.models.sigmoid_moe`), plus ``n_shared_experts`` shared experts fused
  into one ungated SwiGLU of ``n_shared_experts * moe_intermediate_size``.

Checkpoint names: ``mlp.gate.weight [E, H]``, ``mlp.gate.e_score_correction_bias [E]`` (kept in float32),
``mlp.experts.E.{gate,up,down}_proj.weight`` (or the fused v5 layout), ``mlp.shared_experts.{gate,up,down}_proj``.
The published checkpoints also hold ``num_nextn_predict_layers`` multi-token-prediction layers numbered from
``num_hidden_layers`` on; they are not read (no speculative decoding here).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.layers import SwiGLUMLP
from ferrylm.models.llama import LlamaForCausalLM
from ferrylm.models.moe import router_has_bias
from ferrylm.models.sigmoid_moe import SigmoidMoeBlock, SigmoidRouting, check_sigmoid_config

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def skips_mtp_layer(name: str, config: ModelConfig) -> bool:
    """True for a tensor of a layer numbered ``num_hidden_layers`` or more (the multi-token-prediction layers
    GLM-4.5 and MiniMax-M2 checkpoints carry past the decoder)."""
    m = _LAYER.match(name)
    return m is not None and int(m[1]) >= config.num_layers


def _int_field(raw: dict, key: str, default: int) -> int:
    value = raw.get(key, default)
    try:
        return int(default if value is None else value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"config field {key!r} must be an integer, got {value!r}") from None


def grouped_routing(config: ModelConfig, *, n_group: int, topk_group: int, scale: float) -> SigmoidRouting:
    """The group-limited biased sigmoid rule (``noaux_tc``) from the config; ``n_group`` / ``topk_group`` /
    ``scale`` are the family's defaults for absent fields (``norm_topk_prob`` defaults to on). Raises
    ModelLoadError for a non-integer group field or a non-numeric ``routed_scaling_factor``."""
    raw = config.raw
    value = raw.get("routed_scaling_factor")
    try:
        scale = float(scale if value is None else value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"config field 'routed_scaling_factor' must be a number, got {value!r}") from None
    return SigmoidRouting(top_k=config.num_experts_per_tok, n_group=_int_field(raw, "n_group", n_group),
                          topk_group=_int_field(raw, "topk_group", topk_group),
                          renormalize=bool(raw.get("norm_topk_prob", True)), scale=scale, eps=1e-20)


def glm4_routing(config: ModelConfig) -> SigmoidRouting:
    """The GLM-4.5 routing rule from the config (transformers' defaults for absent fields: one group, unscaled)."""
    return grouped_routing(config, n_group=1, topk_group=1, scale=1.0)


class DensePrefixMoeForCausalLM(LlamaForCausalLM):
    """The layer plan GLM-4.5 and DeepSeek-V3 share: the first ``first_k_dense_replace`` layers a dense SwiGLU of
    ``intermediate_size``, every later layer a :class:`~ferrylm.models.sigmoid_moe.SigmoidMoeBlock` routed by
    :meth:`routing` with ``n_shared_experts`` shared experts fused into one SwiGLU; the multi-token-prediction
    layers past the decoder are not read. Subclasses set ``first_dense_default`` (transformers' default of
    ``first_k_dense_replace``) and :meth:`routing`."""

    first_dense_default: ClassVar[int] = 1

    @classmethod
    def routing(cls, config: ModelConfig) -> SigmoidRouting:
        """The family's router rule (raises ModelLoadError for a malformed field)."""
        raise NotImplementedError

    @classmethod
    def check_layer_plan(cls, config: ModelConfig) -> None:
        """Raise ModelLoadError for a negative ``first_k_dense_replace`` / ``n_shared_experts``, or dense layers
        without ``intermediate_size``."""
        first = _int_field(config.raw, "first_k_dense_replace", cls.first_dense_default)
        if first < 0:
            raise ModelLoadError(f"{cls.arch_name}: first_k_dense_replace must be >= 0, got {first}")
        if min(first, config.num_layers) > 0 and config.intermediate_size < 1:
            raise ModelLoadError(f"{cls.arch_name}: the first {first} layers are dense (first_k_dense_replace) "
                                 f"but intermediate_size is {config.intermediate_size}")
        if _int_field(config.raw, "n_shared_experts", 1) < 0:
            raise ModelLoadError(f"{cls.arch_name}: n_shared_experts must be >= 0")

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        """Layers ``first_k_dense_replace .. num_hidden_layers - 1``."""
        first = max(_int_field(config.raw, "first_k_dense_replace", cls.first_dense_default), 0)
        return tuple(range(first, config.num_layers)) if config.is_moe else ()

    @classmethod
    def skips_tensor(cls, name: str, config: ModelConfig) -> bool:
        return skips_mtp_layer(name, config)

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        if layer_idx not in self.moe_layer_indices(config):
            return SwiGLUMLP(config.hidden_size, config.intermediate_size)
        width = _int_field(config.raw, "n_shared_experts", 1) * config.moe_intermediate_size
        shared = SwiGLUMLP(config.hidden_size, width) if width > 0 else None
        return SigmoidMoeBlock(layer_idx, config.hidden_size, config.num_experts, executor, self.routing(config),
                               shared_experts=shared, router_bias=router_has_bias(config))


class Glm4MoeForCausalLM(DensePrefixMoeForCausalLM):
    """GLM-4.5 causal LM; same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`.

    Raises:
        ModelLoadError: no experts, a routing field out of range (``n_group``, ``topk_group``,
            ``num_experts_per_tok``), ``first_k_dense_replace`` negative, dense layers without
            ``intermediate_size``, or any decoder check (activation, RoPE);
        ValueError: a MoE layer exists and no executor was given.
    """

    arch_name = "Glm4MoeForCausalLM"
    partial_rotary = True
    float32_tensors = ("gate.e_score_correction_bias",)

    @classmethod
    def routing(cls, config: ModelConfig) -> SigmoidRouting:
        return glm4_routing(config)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        check_sigmoid_config(config, glm4_routing(config), cls.arch_name)
        cls.check_layer_plan(config)
        super().check_config(config)

    @classmethod
    def attention_kwargs(cls, config: ModelConfig) -> dict[str, Any]:
        """``attention_bias`` on q/k/v only; per-head q/k RMSNorm when ``use_qk_norm``."""
        return {"qkv_bias": bool(config.raw.get("attention_bias", False)), "o_bias": False,
                "qk_norm": "head" if config.raw.get("use_qk_norm") else None, "norm_eps": config.rms_norm_eps}
