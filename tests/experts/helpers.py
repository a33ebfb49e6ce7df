"""Shared helpers for tests/experts: a one-sequence KV cache, a greedy trace through a model, model loading with a
given expert backend."""

from __future__ import annotations

import torch

from ferrylm.experts import Bandwidths, ExpertOptions
from ferrylm.models.attention import SequenceCacheAttention

# Bandwidths for the hybrid split in tests: B_cpu_eff = min(1, 3 - 1) = 1 = B_pcie, so half the misses are fetched.
TEST_BANDWIDTHS = Bandwidths(pcie=1.0, host=3.0, cpu=1.0, hbm=10.0)


def greedy_trace(model, prompt: list[int], new_tokens: int, chunks: tuple[int, ...] = (7,)
                 ) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt`` in chunks split at ``chunks``, then decode ``new_tokens`` greedily one token per step.

    Returns:
        (generated ids, the logits ``[V]`` each generated id was taken from).
    """
    cache = SequenceCacheAttention()
    bounds = [0, *[c for c in chunks if 0 < c < len(prompt)], len(prompt)]
    logits = None
    with torch.inference_mode():
        for lo, hi in zip(bounds, bounds[1:]):
            ids = torch.tensor(prompt[lo:hi])
            hidden = model(ids, torch.arange(lo, hi), cache)
            logits = model.compute_logits(hidden[-1:])[0]
        out, trace = [], []
        pos = len(prompt)
        for _ in range(new_tokens):
            tok = int(torch.argmax(logits))
            out.append(tok)
            trace.append(logits)
            hidden = model(torch.tensor([tok]), torch.tensor([pos]), cache)
            logits = model.compute_logits(hidden)[0]
            pos += 1
    return out, trace


def options(backend: str, cache_size: int | None, **kw) -> ExpertOptions:
    """Test options: fixed hybrid bandwidths, the given cache size."""
    return ExpertOptions(backend=backend, cache_size=cache_size, bandwidths=TEST_BANDWIDTHS, **kw)
