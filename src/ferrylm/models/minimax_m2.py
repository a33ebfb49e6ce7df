"""MiniMax-M2 (``MiniMaxM2ForCausalLM``; MiniMax 2025, the MiniMax-M2 model card and transformers'
``modeling_minimax_m2``): the Llama decoder with

* attention: no biases; RMSNorm over the *whole* q and k projections (``q_norm.weight [Hq * D]``,
  ``k_norm.weight [Hkv * D]``, before the head split, as OLMoE); partial rotary over the first ``rotary_dim`` dims of
  each head (64 of 128 in the published config);
* every layer a sparse block of ``num_local_experts`` experts of ``intermediate_size`` chosen by a biased sigmoid
  router (no groups), the kept scores always renormalised to sum to 1 (:mod:`ferrylm.models.sigmoid_moe`); no
  shared expert.

Checkpoint names (original layout, what ``save_pretrained`` writes): ``block_sparse_moe.gate.weight [E, H]``,
``block_sparse_moe.e_score_correction_bias [E]`` (kept in float32), ``block_sparse_moe.experts.E.{w1,w3,w2}.weight``
(or the fused v5 ``mlp.experts.gate_up_proj`` / ``down_proj``). Tensors of layers numbered ``num_hidden_layers``
or more (multi-token-prediction modules) are not read.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.glm4_moe import skips_mtp_layer
from ferrylm.models.llama import LlamaForCausalLM
from ferrylm.models.moe import router_has_bias
from ferrylm.models.sigmoid_moe import SigmoidMoeBlock, SigmoidRouting, check_sigmoid_config


def minimax_m2_routing(config: ModelConfig) -> SigmoidRouting:
    """Biased sigmoid top-``num_experts_per_tok``, renormalised, unscaled, no groups."""
    return SigmoidRouting(top_k=config.num_experts_per_tok)


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    """MiniMax-M2 causal LM; same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`.

    Raises:
        ModelLoadError: no experts, ``num_experts_per_tok`` out of range, a bad ``rotary_dim``, or any decoder check;
        ValueError: no executor given.
    """

    arch_name = "MiniMaxM2ForCausalLM"
    partial_rotary = True
    hf_renames = ((".block_sparse_moe.", ".mlp."),
                  (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))
    float32_tensors = ("gate.e_score_correction_bias",)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Also refuses what the published config can state and this class does not compute: a ``scoring_func``
        other than sigmoid, ``use_routing_bias: false``, a shared expert (``shared_intermediate_size > 0``)."""
        check_sigmoid_config(config, minimax_m2_routing(config), cls.arch_name)
        raw = config.raw
        if raw.get("scoring_func", "sigmoid") != "sigmoid":
            raise ModelLoadError(f"{cls.arch_name}: scoring_func {raw['scoring_func']!r} is not supported "
                                 f"(only 'sigmoid')")
        if raw.get("use_routing_bias", True) is False:
            raise ModelLoadError(f"{cls.arch_name}: use_routing_bias false is not supported")
        if int(raw.get("shared_intermediate_size") or 0) > 0:
            raise ModelLoadError(f"{cls.arch_name}: shared_intermediate_size > 0 (a shared expert) is not supported")
        super().check_config(config)

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        """Every decoder layer is MoE."""
        return tuple(range(config.num_layers))

    @classmethod
    def skips_tensor(cls, name: str, config: ModelConfig) -> bool:
        return skips_mtp_layer(name, config)

    @classmethod
    def attention_kwargs(cls, config: ModelConfig) -> dict[str, Any]:
        """No biases; q/k RMSNorm over the whole projection with ``rms_norm_eps``."""
        return {"qkv_bias": False, "o_bias": False, "qk_norm": "proj", "norm_eps": config.rms_norm_eps}

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        return SigmoidMoeBlock(layer_idx, config.hidden_size, config.num_experts, executor,
                               minimax_m2_routing(config), router_bias=router_has_bias(config))
