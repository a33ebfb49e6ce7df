"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B; Yang et al. 2025, "Qwen3 Technical Report"): Qwen3 attention
(per-head q/k RMSNorm) with sparse MoE blocks and no shared expert.

Router: softmax over ``num_experts``, top ``num_experts_per_tok``, renormalised only when ``norm_topk_prob`` (true
in the published Qwen3-MoE configs; transformers' default is false). Layer ``i`` is MoE unless it is listed in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; those layers use a dense SwiGLU MLP of
``intermediate_size`` (see :func:`~ferrylm.models.moe.sparse_layer_indices`). Experts are
``mlp.experts.E.{gate,up,down}_proj`` on disk (or the fused v5 layout), width ``moe_intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.layers import SwiGLUMLP
from ferrylm.models.llama import LlamaForCausalLM
from ferrylm.models.moe import SparseMoeBlock, check_moe_config, router_has_bias, sparse_layer_indices
from ferrylm.models.qwen3 import qwen3_attention_kwargs


class QwenMoeBase(LlamaForCausalLM):
    """What Qwen2-MoE and Qwen3-MoE share: the sparse/dense layer rule, ``norm_topk_prob``.

    Subclasses set :meth:`attention_kwargs` and, for a shared expert, override :meth:`_shared_expert`.

    Raises:
        ModelLoadError: no experts, ``top_k`` out of range, a dense layer without ``intermediate_size``;
        ValueError: a MoE layer exists and no executor was given.
    """

    arch_name = "QwenMoe"
    ignores_sliding_window = True

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        check_moe_config(config, cls.arch_name)
        moe = set(cls.moe_layer_indices(config))
        if len(moe) < config.num_layers and config.intermediate_size < 1:
            raise ModelLoadError(f"{cls.arch_name}: layers {sorted(set(range(config.num_layers)) - moe)[:8]} are "
                                 f"dense (mlp_only_layers / decoder_sparse_step) but intermediate_size is "
                                 f"{config.intermediate_size}")
        super().check_config(config)

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        return sparse_layer_indices(config)

    def _shared_expert(self, config: ModelConfig) -> nn.Module | None:
        return None

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        if layer_idx not in self.moe_layer_indices(config):
            return SwiGLUMLP(config.hidden_size, config.intermediate_size)
        return SparseMoeBlock(layer_idx, config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              executor, renormalize=bool(config.raw.get("norm_topk_prob", False)),
                              router_bias=router_has_bias(config), shared_expert=self._shared_expert(config))


class Qwen3MoeForCausalLM(QwenMoeBase):
    """Qwen3-MoE causal LM; same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`."""

    arch_name = "Qwen3MoeForCausalLM"

    @classmethod
    def attention_kwargs(cls, config: ModelConfig) -> dict[str, Any]:
        return qwen3_attention_kwargs(config)
