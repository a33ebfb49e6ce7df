"""Where routed experts live and run. ``build_executor`` picks a backend by its ``--moe-backend`` name."""

from __future__ import annotations

import torch

from ferrylm.experts.executor import ExpertExecutor, LayerExperts

# NOTE: names accepted by build_executor; "fused" is the vLLM/SGLang spelling of "resident".
MOE_BACKENDS: tuple[str, ...] = ("fused", "resident")


def check_backend(backend: str) -> str:
    """Return ``backend`` if it names a known MoE backend, else raise ValueError listing the valid names."""
    if backend not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; valid: {', '.join(MOE_BACKENDS)}")
    return backend


def build_executor(backend: str, layers: dict[int, LayerExperts], device: torch.device | str) -> ExpertExecutor:
    """Build the executor for ``--moe-backend backend``.

    Args:
        backend: one of ``MOE_BACKENDS``.
        layers: decoder layer index -> stacked expert weights (moved to ``device`` if elsewhere).
        device: the compute device.

    Raises:
        ValueError: unknown backend name (the message lists the valid ones).
    """
    check_backend(backend)
    from ferrylm.experts.resident import ResidentExecutor

    dev = torch.device(device)
    placed = {i: LayerExperts(gate=le.gate.to(dev), up=le.up.to(dev), down=le.down.to(dev))
              for i, le in layers.items()}
    return ResidentExecutor(placed)


__all__ = ["MOE_BACKENDS", "ExpertExecutor", "LayerExperts", "build_executor", "check_backend"]
