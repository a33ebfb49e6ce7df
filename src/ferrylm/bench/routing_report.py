"""The routing model's statistics next to the published figures each profile was fitted to (docs/ROUTING.md,
and the ``routing`` section of ``ferry bench cache-policy --json``).

For each profile, at its published shape ``(E, k)``: ``S`` sequences (keys from :func:`sequence_key`) of ``N``
tokens at layers ``3..3+L-1`` of the routing model, summarised by
:func:`ferrylm.synthetic.routing_stats.trace_stats`, plus ``predict_recall``: the share of layer ``l + 1``'s chosen
experts that its early evaluation (:meth:`RoutingModel.predict`) names, per token.
"""

from __future__ import annotations

import numpy as np
import torch

from ferrylm.synthetic.routing_model import RoutingModel, sequence_key
from ferrylm.synthetic.routing_profiles import PROFILES, get_profile
from ferrylm.synthetic.routing_stats import trace_stats

#: ``(sequences, tokens)`` per profile: OLMoE's top-half share is a corpus figure, so many short sequences
SAMPLE = {"olmoe": (64, 128)}


def profile_trace(name: str, seqs: int = 2, tokens: int = 1024, layers: tuple[int, ...] = (3, 4, 5),
                  seed: int = 0) -> tuple[np.ndarray, float]:
    """``(trace [S, L, N, k], mean next-layer predict recall)`` of profile ``name`` at its published shape."""
    prof = get_profile(name)
    e, k = prof.shape
    model = RoutingModel(prof, e, k, seed=seed, layers=range(max(layers) + 2))
    pos = torch.arange(tokens)
    out = np.zeros((seqs, len(layers), tokens, k), np.int64)
    recall = []
    for s in range(seqs):
        keys = torch.full((tokens,), sequence_key([s, 7, 7], seed), dtype=torch.int64)
        for j, layer in enumerate(layers):
            out[s, j] = model.route(layer, keys, pos).numpy()
            pred = model.predict(layer + 1, keys, pos)
            actual = torch.zeros(tokens, e, dtype=torch.bool).scatter_(1, model.route(layer + 1, keys, pos), True)
            recall.append(actual.gather(1, pred).float().mean().item())
    return out, float(np.mean(recall))


def profile_statistics(name: str, scale: int = 1, seed: int = 0) -> dict[str, float]:
    """Every statistic of ``name``'s trace (``scale`` times the default number of sequences)."""
    prof = get_profile(name)
    seqs, tokens = SAMPLE.get(name, (2, 1024))
    trace, recall = profile_trace(name, seqs=seqs * scale, tokens=tokens, seed=seed)
    stats = trace_stats(trace, prof.shape[0], lru_slots=(64, 128) if prof.shape[0] == 512 else ())
    stats["predict_recall"] = recall
    return stats


def routing_report(scale: int = 2) -> dict:
    """``{profile: {"shape", "parameters", "published", "reproduced"}}`` for every profile."""
    out = {}
    for name, prof in PROFILES.items():
        out[name] = {"shape": list(prof.shape), "source": prof.source,
                     "parameters": {"zipf": prof.zipf, "phi": prof.phi, "depth": prof.depth,
                                    "hot": [vars(c) for c in prof.hot]},
                     "published": dict(prof.targets),
                     "reproduced": {k: round(v, 4) for k, v in profile_statistics(name, scale).items()}}
    return out
