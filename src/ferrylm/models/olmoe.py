"""OLMoE (Muennighoff et al. 2024, "OLMoE: Open Mixture-of-Experts Language Models"): every layer a sparse MoE
block; attention with RMSNorm of the whole q and k projections (``q_norm.weight [Hq * D]``,
``k_norm.weight [Hkv * D]``) before the head split and RoPE, and an optional ``clip_qkv`` clamp.

Router: softmax over ``num_experts``, top ``num_experts_per_tok``, *not* renormalised unless the config says
``norm_topk_prob: true`` (OLMoE-1B-7B: false). Expert width is ``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from ferrylm.config import ModelConfig
from ferrylm.models.llama import SparseLlamaForCausalLM


class OlmoeForCausalLM(SparseLlamaForCausalLM):
    """OLMoE causal LM; same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`.

    Raises:
        ModelLoadError: no experts or ``top_k`` out of range; ValueError: no executor given.
    """

    arch_name = "OlmoeForCausalLM"

    @classmethod
    def attention_kwargs(cls, config: ModelConfig) -> dict[str, Any]:
        """``attention_bias`` on q/k/v/o, q/k RMSNorm over the whole projection, ``clip_qkv`` clamp."""
        bias = bool(config.raw.get("attention_bias", False))
        clip = config.raw.get("clip_qkv")
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": "proj", "norm_eps": config.rms_norm_eps,
                "clip_qkv": None if clip is None else float(clip)}

    @classmethod
    def renormalize(cls, config: ModelConfig) -> bool:
        """Per ``norm_topk_prob`` (OLMoE-1B-7B: off)."""
        return bool(config.raw.get("norm_topk_prob", False))
