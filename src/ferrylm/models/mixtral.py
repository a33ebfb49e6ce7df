"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): the Llama decoder with a sparse MoE block in every layer.

Router softmax over ``num_local_experts``, top ``num_experts_per_tok``, always renormalised. Checkpoints name the
block ``block_sparse_moe`` (original layout) or ``mlp`` (transformers v5 fused layout); both map onto ``mlp``.
"""

from __future__ import annotations

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.llama import LlamaForCausalLM, warn_sliding_window
from ferrylm.models.moe import SparseMoeBlock, check_moe_config, router_has_bias


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral causal LM; same API as :class:`LlamaForCausalLM`.

    Args:
        config: model config with ``num_experts`` / ``num_experts_per_tok``.
        executor: runs the routed experts of every layer (required).
        device: where the RoPE tables are built.

    Raises:
        ModelLoadError: the config has no experts; ValueError: no executor given.
    """

    hf_renames = ((".block_sparse_moe.", ".mlp."),)

    def __init__(self, config: ModelConfig, *, executor: ExpertExecutor | None = None,
                 device: torch.device | str | None = None):
        if executor is None:
            raise ValueError("MixtralForCausalLM needs an ExpertExecutor")
        warn_sliding_window(config)
        super().__init__(config, executor=executor, device=device)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Raise ModelLoadError when ``config`` is not a computable Mixtral config."""
        check_moe_config(config, "MixtralForCausalLM")
        super().check_config(config)

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        """Every decoder layer is MoE."""
        return tuple(range(config.num_layers))

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        return SparseMoeBlock(layer_idx, config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              executor, renormalize=True, router_bias=router_has_bias(config))
