"""OLMoE (Muennighoff et al. 2024, "OLMoE: Open Mixture-of-Experts Language Models"): every layer a sparse MoE
block; attention with RMSNorm of the whole q and k projections (``q_norm.weight [Hq * D]``,
``k_norm.weight [Hkv * D]``) before the head split and RoPE, and an optional ``clip_qkv`` clamp.

Router: softmax over ``num_experts``, top ``num_experts_per_tok``, *not* renormalised unless the config says
``norm_topk_prob: true`` (OLMoE-1B-7B: false). Expert width is ``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.llama import LlamaForCausalLM
from ferrylm.models.moe import SparseMoeBlock, check_moe_config, router_has_bias


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE causal LM; same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`.

    Raises:
        ModelLoadError: no experts or ``top_k`` out of range; ValueError: no executor given.
    """

    def __init__(self, config: ModelConfig, *, executor: ExpertExecutor | None = None,
                 device: torch.device | str | None = None):
        if executor is None:
            raise ValueError("OlmoeForCausalLM needs an ExpertExecutor")
        super().__init__(config, executor=executor, device=device)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        check_moe_config(config, "OlmoeForCausalLM")
        super().check_config(config)

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        """Every decoder layer is MoE."""
        return tuple(range(config.num_layers))

    @classmethod
    def attention_kwargs(cls, config: ModelConfig) -> dict[str, Any]:
        """``attention_bias`` on q/k/v/o, q/k RMSNorm over the whole projection, ``clip_qkv`` clamp."""
        bias = bool(config.raw.get("attention_bias", False))
        clip = config.raw.get("clip_qkv")
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": "proj", "norm_eps": config.rms_norm_eps,
                "clip_qkv": None if clip is None else float(clip)}

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        return SparseMoeBlock(layer_idx, config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              executor, renormalize=bool(config.raw.get("norm_topk_prob", False)),
                              router_bias=router_has_bias(config))
