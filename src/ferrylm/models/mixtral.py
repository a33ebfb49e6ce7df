"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): the Llama decoder with a sparse MoE block in every layer.

Router softmax over ``num_local_experts``, top ``num_experts_per_tok``, always renormalised. Checkpoints name the
block ``block_sparse_moe`` (original layout) or ``mlp`` (transformers v5 fused layout); both map onto ``mlp``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.llama import LlamaForCausalLM
from ferrylm.models.moe import SparseMoeBlock

log = logging.getLogger("ferrylm.models")


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
        window = config.raw.get("sliding_window")
        if window and window < config.max_position_embeddings:
            # NOTE: attention here is full causal; outputs differ from the reference past `window` tokens.
            log.warning("sliding_window=%d is ignored (full attention); contexts longer than it will differ",
                        window)
        super().__init__(config, executor=executor, device=device)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Raise ModelLoadError when ``config`` is not a computable Mixtral config."""
        if not config.is_moe or not 1 <= config.num_experts_per_tok <= config.num_experts:
            raise ModelLoadError("MixtralForCausalLM config needs num_local_experts >= num_experts_per_tok >= 1, "
                                 f"got {config.num_experts} and {config.num_experts_per_tok}")
        super().check_config(config)

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        """Every decoder layer is MoE."""
        return tuple(range(config.num_layers))

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        return SparseMoeBlock(layer_idx, config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              executor, renormalize=True)
