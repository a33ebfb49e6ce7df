"""gpt-oss (``GptOssForCausalLM``, gpt-oss-20b / gpt-oss-120b; OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model
Card", and transformers' ``modeling_gpt_oss``): the Llama decoder with

* attention: q/k/v/o biases; a learned attention-sink logit per query head (``self_attn.sinks [Hq]``, kept in
  float32); layers alternating sliding-window (``sliding_window``, 128) and full attention by ``layer_types``
  (default: even layers sliding); YaRN RoPE (``truncate: false``);
* every layer a sparse block: router ``mlp.router.{weight,bias}`` (top-k of the logits, softmax over the kept
  ones), experts with biases and the clamped SwiGLU ``(clamp(u) + 1) * g * sigmoid(alpha g)`` of
  :class:`~ferrylm.experts.executor.ExpertMath` (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0).

Checkpoint names: ``mlp.experts.gate_up_proj [E, H, 2I]`` (transposed, gate and up columns interleaved) with
``gate_up_proj_bias [E, 2I]``, ``mlp.experts.down_proj [E, I, H]`` with ``down_proj_bias [E, H]`` (what
``save_pretrained`` writes); the published checkpoints hold the experts as MXFP4 ``*_blocks`` / ``*_scales``
(``checkpoints/quant/mxfp4.py``), kept as their bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ClampedSwiGLU, ExpertExecutor
from ferrylm.models.llama import SparseLlamaForCausalLM
from ferrylm.models.moe import SparseMoeBlock

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(config: ModelConfig) -> list[str]:
    """Each layer's attention kind: ``layer_types`` of the config, or transformers' default (even layers sliding).

    Raises:
        ModelLoadError: a kind other than ``LAYER_TYPES``, or a list of another length than the layers.
    """
    kinds = config.raw.get("layer_types")
    if kinds is None:
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_layers)]
    if len(kinds) != config.num_layers or any(k not in LAYER_TYPES for k in kinds):
        raise ModelLoadError(f"layer_types must list one of {', '.join(LAYER_TYPES)} per layer "
                             f"({config.num_layers}), got {kinds!r}")
    return list(kinds)


def sliding_window(config: ModelConfig) -> int | None:
    """The window of the sliding layers (``sliding_window``), or None when it is unset.

    Raises:
        ModelLoadError: a window below 1.
    """
    window = config.raw.get("sliding_window")
    if window is None:
        return None
    if int(window) < 1:
        raise ModelLoadError(f"sliding_window must be >= 1, got {window!r}")
    return int(window)


def swiglu_params(config: ModelConfig) -> ClampedSwiGLU:
    """``(swiglu_alpha, swiglu_limit)`` of the experts' clamped SwiGLU (defaults 1.702, 7.0).

    Raises:
        ModelLoadError: a limit that is not positive.
    """
    alpha = float(config.raw.get("swiglu_alpha", 1.702))
    limit = float(config.raw.get("swiglu_limit", 7.0))
    if limit <= 0:
        raise ModelLoadError(f"swiglu_limit must be > 0, got {limit}")
    return ClampedSwiGLU(alpha, limit)


class GptOssForCausalLM(SparseLlamaForCausalLM):
    """gpt-oss causal LM; same API as :class:`~ferrylm.models.llama.LlamaForCausalLM`.

    Raises:
        ModelLoadError: no experts, ``num_experts_per_tok`` out of range, bad ``layer_types`` / ``sliding_window`` /
            ``swiglu_limit``, or any decoder check;
        ValueError: no executor given.
    """

    arch_name = "GptOssForCausalLM"
    hf_renames = ((".mlp.router.", ".mlp.gate."),)
    float32_tensors = ("self_attn.sinks",)
    #: the experts of ``save_pretrained``: ``[E, H, 2I]`` gate/up interleaved, ``[E, I, H]`` down, with biases
    fused_experts = "gpt_oss"

    def __init__(self, config: ModelConfig, *, executor: ExpertExecutor | None = None,
                 device: torch.device | str | None = None):
        super().__init__(config, executor=executor, device=device)
        window = sliding_window(config)
        for layer, kind in zip(self.model.layers, layer_types(config)):
            layer.self_attn.window = window if kind == "sliding_attention" else None

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        layer_types(config)
        sliding_window(config)
        swiglu_params(config)

    @classmethod
    def attention_kwargs(cls, config: ModelConfig) -> dict[str, Any]:
        """q/k/v/o biases (``attention_bias``, on in the published configs) and the per-head sinks; the window is
        set per layer after construction."""
        bias = bool(config.raw.get("attention_bias", True))
        return {"qkv_bias": bias, "o_bias": bias, "sinks": True}

    @classmethod
    def expert_swiglu(cls, config: ModelConfig) -> ClampedSwiGLU:
        """``(alpha, limit)`` of the experts' :class:`~ferrylm.experts.executor.ExpertMath` (the loader's)."""
        return swiglu_params(config)

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        return SparseMoeBlock(layer_idx, config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              executor, renormalize=True, router_bias=True)
