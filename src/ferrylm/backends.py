"""The names of the engine's swappable backends, and where each is implemented (``module:attribute``, imported on
first use: :class:`~ferrylm.registry.Registry`).

- ``--attention-backend``: :data:`ATTENTION_BACKENDS` (``engine/attention/``), ``auto`` besides.
- ``--moe-backend``: the backends behind a device slot cache, :data:`CACHED_BACKENDS` (``experts/``), built as
  ``cls(banks, device, options)``; :data:`MOE_BACKENDS` every accepted name.

They live here, beside ``config.py``, so the flags list and check the names without importing an engine package
(or torch). This module must import nothing but the registry.
"""

from __future__ import annotations

from ferrylm.registry import Registry

#: resolved backend name -> ``(pool, meta, device, faults) -> backend object`` of a step (``auto`` is a choice,
#: ``engine.attention.resolve_backend``)
ATTENTION_BACKENDS = Registry("--attention-backend", {
    "triton": "ferrylm.engine.attention.triton_backend:triton_attention",
    "torch": "ferrylm.engine.attention.torch_backend:torch_attention",
})
ATTENTION_CHOICES: tuple[str, ...] = ("auto", *ATTENTION_BACKENDS.names)

#: the backends that keep experts in host banks behind a device slot cache: name -> executor class, built as
#: ``cls(banks, device, options)``
CACHED_BACKENDS = Registry("--moe-backend", {
    "cpu": "ferrylm.experts.cpu:CpuExecutor",
    "hybrid": "ferrylm.experts.hybrid:HybridExecutor",
    "offload": "ferrylm.experts.offload:OffloadExecutor",
})
# NOTE: names accepted by build_executor; "fused" is the vLLM/SGLang spelling of "resident".
MOE_BACKENDS: tuple[str, ...] = tuple(sorted(("auto", "fused", "resident", *CACHED_BACKENDS.names)))
