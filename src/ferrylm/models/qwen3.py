"""Dense Qwen3 (Yang et al. 2025, "Qwen3 Technical Report"): the Llama decoder with per-head RMSNorm of queries
and keys before RoPE (``self_attn.q_norm.weight [D]`` / ``self_attn.k_norm.weight [D]``, shared by all heads),
no q/k/v biases (``attention_bias`` false in every published config), ``head_dim`` independent of
``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

from typing import Any

from ferrylm.config import ModelConfig
from ferrylm.models.llama import LlamaForCausalLM


def qwen3_attention_kwargs(config: ModelConfig) -> dict[str, Any]:
    """Qwen3 / Qwen3-MoE attention: ``attention_bias`` on q/k/v/o, per-head q/k RMSNorm with ``rms_norm_eps``."""
    bias = bool(config.raw.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": "head", "norm_eps": config.rms_norm_eps}


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Dense Qwen3 causal LM; same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`.

    Raises:
        ModelLoadError: unsupported config (activation, head layout, RoPE type).
    """

    arch_name = "Qwen3ForCausalLM"
    ignores_sliding_window = True

    @classmethod
    def attention_kwargs(cls, config: ModelConfig) -> dict[str, Any]:
        return qwen3_attention_kwargs(config)
