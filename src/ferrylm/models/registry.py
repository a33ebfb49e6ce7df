"""Architecture name (config.json ``architectures[0]``) -> model class, imported lazily on first use."""

from __future__ import annotations

import importlib

from ferrylm.errors import UnsupportedArchitecture

# NOTE: values are "module:Class" so that importing the registry does not import torch-heavy model code.
MODEL_REGISTRY: dict[str, str] = {
    "DeepseekV3ForCausalLM": "ferrylm.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM": "ferrylm.models.deepseek_v4:DeepseekV4ForCausalLM",
    "Glm4MoeForCausalLM": "ferrylm.models.glm4_moe:Glm4MoeForCausalLM",
    "GptOssForCausalLM": "ferrylm.models.gpt_oss:GptOssForCausalLM",
    "LlamaForCausalLM": "ferrylm.models.llama:LlamaForCausalLM",
    "MiniMaxM2ForCausalLM": "ferrylm.models.minimax_m2:MiniMaxM2ForCausalLM",
    "MixtralForCausalLM": "ferrylm.models.mixtral:MixtralForCausalLM",
    "OlmoeForCausalLM": "ferrylm.models.olmoe:OlmoeForCausalLM",
    "Qwen2ForCausalLM": "ferrylm.models.qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "ferrylm.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "ferrylm.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "ferrylm.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM": "ferrylm.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM": "ferrylm.models.qwen3_next:Qwen3_5MoeForCausalLM",
    "Qwen4ExpForCausalLM": "ferrylm.models.qwen4_exp:Qwen4ExpForCausalLM",
}


def supported_architectures() -> tuple[str, ...]:
    """Sorted names of the architectures ferrylm implements."""
    return tuple(sorted(MODEL_REGISTRY))


def get_model_class(architecture: str) -> type:
    """Import and return the class for ``architecture``.

    Raises:
        UnsupportedArchitecture: the name is not registered (the message lists the supported ones).
    """
    target = MODEL_REGISTRY.get(architecture)
    if target is None:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
