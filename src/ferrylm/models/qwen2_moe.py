"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; Yang et al. 2024, "Qwen2 Technical Report"): Qwen2
attention (q/k/v biases, none on the output) with sparse MoE blocks plus a shared expert.

Each MoE block: router softmax over ``num_experts``, top ``num_experts_per_tok``, renormalised only when
``norm_topk_prob`` (false in the published configs); plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``
with a dense SwiGLU ``shared_expert`` of ``shared_expert_intermediate_size``. Checkpoint names:
``mlp.gate.weight``, ``mlp.experts.E.{gate,up,down}_proj.weight``, ``mlp.shared_expert.{gate,up,down}_proj.weight``,
``mlp.shared_expert_gate.weight [1, H]``. Dense/sparse layer rule as Qwen3-MoE (``decoder_sparse_step``,
``mlp_only_layers``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.models.layers import SwiGLUMLP
from ferrylm.models.qwen3_moe import QwenMoeBase


class Qwen2MoeForCausalLM(QwenMoeBase):
    """Qwen2-MoE causal LM; same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`.

    A ``shared_expert_intermediate_size`` of 0 (or absent) builds blocks without a shared expert.
    """

    arch_name = "Qwen2MoeForCausalLM"

    @classmethod
    def attention_kwargs(cls, config: ModelConfig) -> dict[str, Any]:
        """q/k/v biases per config ``qkv_bias`` (absent in older configs: true), no output bias."""
        return {"qkv_bias": bool(config.raw.get("qkv_bias", True)), "o_bias": False}

    def _shared_expert(self, config: ModelConfig) -> nn.Module | None:
        width = int(config.raw.get("shared_expert_intermediate_size") or 0)
        return SwiGLUMLP(config.hidden_size, width) if width > 0 else None
