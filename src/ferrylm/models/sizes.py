"""Byte figures of a built model that rooflines need."""

from __future__ import annotations

import torch

from ferrylm.models.quant_linear import QuantEmbedding, QuantLinear


def non_expert_step_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the model's own weights: every parameter and every compact layer's blocks
    (``models/quant_linear.py``; routed experts are not part of the model: their executor holds them), less the
    embedding table unless the output layer is tied to it (a step gathers a few embedding rows but reads the whole
    output layer)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.weight.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and getattr(model, "lm_head", None) is not None and not isinstance(embed, QuantEmbedding):
        total -= embed.weight.numel() * embed.weight.element_size()
    return total
