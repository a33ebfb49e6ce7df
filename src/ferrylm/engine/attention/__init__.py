"""Attention over the paged KV pool, behind one small interface.

A step's :class:`AttentionMetadata` (built once per step by the model runner, ``engine/model_runner.py``) says where
every sequence's tokens live: ``slot_mapping`` (the cache slot of each new token), ``block_table`` (each sequence's
pages), ``seq_lens`` (tokens after the step) and ``query_start_loc`` (where each sequence's new tokens start in the
flattened batch). A backend object, made per step from the pool and the metadata, is the
:class:`~ferrylm.models.attention.AttentionBackend` the model's layers call: it stores the layer's new K/V and
returns the attention of the step's queries.

Backends (``--attention-backend``):

* ``triton`` (``engine/attention/triton_backend.py``; kernels ``triton_paged.py``, ``triton_latent.py`` (MLA),
  ``triton_compress.py`` / ``triton_compressed.py`` (DeepSeek-V4)): one kernel for any mix of prefill chunks over a
  cached prefix and decode steps, reading K/V in place through the block table, GQA without expanding heads, memory
  linear in tokens; split-KV for decode. CUDA only (and Triton's CPU interpreter in tests).
* ``torch`` (``engine/attention/torch_backend.py``): gathers each sequence's K/V and calls SDPA; the
  CPU path and the test oracle.
* ``auto``: ``triton`` on a CUDA device when Triton imports, else ``torch``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ferrylm.backends import ATTENTION_BACKENDS

if TYPE_CHECKING:
    import torch

    from ferrylm.engine.attention.metadata import AttentionMetadata
    from ferrylm.engine.cache.kv_pool import KVPool
    from ferrylm.faults import FaultInjector


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` on CUDA when Triton imports, else ``torch``; ``triton`` off CUDA is an error.

    Raises:
        ValueError: unknown name, or ``triton`` asked for where it cannot run (message names
            ``--attention-backend``).
    """
    ATTENTION_BACKENDS.check(name, extra=("auto",))
    if name == "torch":
        return "torch"
    ok = device.type == "cuda" and _triton_available()
    if name == "triton" and not ok:
        raise ValueError(f"--attention-backend triton needs a CUDA device and Triton (device {device}); use "
                         f"--attention-backend torch")
    return "triton" if ok else "torch"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_factory(name: str) -> Callable[[KVPool, AttentionMetadata, torch.device, FaultInjector], Any]:
    """The constructor of resolved backend ``name`` (``triton`` or ``torch``), looked up once by a runner:
    ``factory(pool, meta, device, faults)`` is a step's backend object. Raises ValueError for an unknown name."""
    return ATTENTION_BACKENDS.get(name)
