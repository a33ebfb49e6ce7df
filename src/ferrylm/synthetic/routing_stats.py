"""Statistics of expert-routing traces: the figures published for real MoE models, computed the same way on the
routing model's traces (docs/ROUTING.md puts them side by side).

A trace of one sequence at one layer is ``ids [N, k]`` (int, the experts each of ``N`` consecutive tokens chose;
distinct within a row). Every function here is CPU numpy on such arrays; :func:`trace_stats` averages over
sequences and layers of a ``[S, L, N, k]`` trace.

Definitions (those of the sources, as far as they state them):

- ``repeat_next``: the share of a token's ``k`` selections that the previous token of the sequence also made.
- ``jaccard_next``: mean Jaccard index ``|A & B| / |A | B|`` of adjacent tokens' expert sets.
- ``reuse_within_8``: the share of selections whose expert was chosen by one of the 8 previous tokens.
- ``median_reuse_distance``: median, over selections, of the tokens since that expert was last chosen (never
  before counts as infinite).
- ``top_half_share``: the share of all selections of a layer that go to its ``E / 2`` most chosen experts (counts
  pooled over the trace's sequences, as a corpus-level figure is).
- ``lru_<C>`` / ``lru_40pct``: steady-state hit rate of a per-layer LRU cache of ``C`` experts (``40pct``: 40 % of
  ``E``) on one sequence, counted after a 64-token warm-up; a token's ``k`` experts are all resident while it
  runs, so eviction never takes one of them.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

WARMUP_TOKENS = 64


def _onehot(ids: np.ndarray, num_experts: int) -> np.ndarray:
    m = np.zeros((ids.shape[0], num_experts), dtype=bool)
    np.put_along_axis(m, ids.astype(np.int64), True, axis=1)
    return m


def repeat_next(ids: np.ndarray, num_experts: int) -> float:
    m = _onehot(ids, num_experts)
    return float((m[1:] & m[:-1]).sum() / (ids.shape[1] * (ids.shape[0] - 1)))


def jaccard_next(ids: np.ndarray, num_experts: int) -> float:
    m = _onehot(ids, num_experts)
    inter = (m[1:] & m[:-1]).sum(1)
    union = (m[1:] | m[:-1]).sum(1)
    return float(np.mean(inter / union))


def reuse_within(ids: np.ndarray, num_experts: int, window: int = 8) -> float:
    """Share of selections of tokens ``t >= window`` whose expert one of the ``window`` previous tokens chose."""
    m = _onehot(ids, num_experts).astype(np.int32)
    c = np.concatenate([np.zeros((1, num_experts), np.int32), np.cumsum(m, 0)])  # c[t] = sum of rows < t
    n = ids.shape[0]
    t = np.arange(window, n)
    seen = (c[t] - c[t - window]) > 0                                            # [n - window, E]
    return float((seen & (m[t] > 0)).sum() / (ids.shape[1] * len(t)))


def reuse_distances(ids: np.ndarray, num_experts: int, start: int = 8) -> np.ndarray:
    """Tokens since each selection's expert was last chosen, for tokens ``t >= start`` (``inf``: never)."""
    last = np.full(num_experts, -np.inf)
    out = []
    for t, row in enumerate(ids):
        if t >= start:
            out.append(t - last[row])
        last[row] = t
    return np.concatenate(out) if out else np.zeros(0)


def top_half_share(ids: np.ndarray, num_experts: int) -> float:
    counts = np.bincount(ids.reshape(-1).astype(np.int64), minlength=num_experts)
    top = np.sort(counts)[::-1][: num_experts // 2]
    return float(top.sum() / counts.sum())


def lru_hit_rate(ids: np.ndarray, slots: int, warmup: int = WARMUP_TOKENS) -> float:
    """Hit rate of a per-layer LRU of ``slots`` (>= k) experts over tokens after ``warmup``."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for t, row in enumerate(ids.tolist()):
        need = set(row)
        missing = []
        for e in row:           # as the engine: the token's cached experts are used (and kept) first
            if e in cache:
                cache.move_to_end(e)
                hits += t >= warmup
            else:
                missing.append(e)
        for e in missing:
            while len(cache) >= slots:
                victim = next(k for k in cache if k not in need)
                del cache[victim]
            cache[e] = None
        total += (t >= warmup) * len(row)
    return hits / max(1, total)


def trace_stats(trace: np.ndarray, num_experts: int, lru_slots: tuple[int, ...] = ()) -> dict[str, float]:
    """Every statistic of the module docstring, averaged over sequences and layers of ``trace [S, L, N, k]``
    (``median_reuse_distance`` pooled). ``lru_slots``: extra ``lru_<C>`` entries."""
    s, layers = trace.shape[:2]
    per: dict[str, list[float]] = {}
    dists = []
    slots40 = max(trace.shape[-1], round(0.4 * num_experts))
    for i in range(s):
        for j in range(layers):
            ids = trace[i, j]
            vals = {"repeat_next": repeat_next(ids, num_experts), "jaccard_next": jaccard_next(ids, num_experts),
                    "reuse_within_8": reuse_within(ids, num_experts, 8),
                    "lru_40pct": lru_hit_rate(ids, slots40)}
            for c in lru_slots:
                vals[f"lru_{c}"] = lru_hit_rate(ids, c)
            for k, v in vals.items():
                per.setdefault(k, []).append(v)
            dists.append(reuse_distances(ids, num_experts))
    out = {k: float(np.mean(v)) for k, v in per.items()}
    out["top_half_share"] = float(np.mean([top_half_share(trace[:, j].reshape(-1, trace.shape[-1]), num_experts)
                                           for j in range(layers)]))
    out["median_reuse_distance"] = float(np.median(np.concatenate(dists)))
    return out
