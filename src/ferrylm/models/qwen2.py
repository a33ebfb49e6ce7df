"""Dense Qwen2 / Qwen2.5 (Yang et al. 2024, "Qwen2 Technical Report"): the Llama decoder with biases on the q/k/v
projections (none on the output projection).

Checkpoint names are Llama's (``model.layers.N.self_attn.q_proj.{weight,bias}`` ...). A config with
``use_sliding_window: true`` is served with full attention and a warning (see
:func:`~ferrylm.models.llama.warn_sliding_window`).
"""

from __future__ import annotations

from typing import Any

from ferrylm.config import ModelConfig
from ferrylm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Dense Qwen2 causal LM; same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`.

    Raises:
        ModelLoadError: unsupported config (activation, head layout, RoPE type).
    """

    arch_name = "Qwen2ForCausalLM"
    ignores_sliding_window = True

    @classmethod
    def attention_kwargs(cls, config: ModelConfig) -> dict[str, Any]:
        """q/k/v biases always (transformers' ``Qwen2Attention`` hard-codes them), no output bias."""
        return {"qkv_bias": True, "o_bias": False}
