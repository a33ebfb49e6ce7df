"""``ferry bench cache-policy``: expert-cache hit rate vs slots per layer, by simulation on routing-model traces.

CPU only, no model weights: traces come from :class:`~ferrylm.synthetic.routing_model.RoutingModel` (the profiles of
:mod:`ferrylm.synthetic.routing_profiles`), the cache is the engine's own :class:`~ferrylm.experts.cache.SlotCache`
driven the way the offloading executors drive it.

Simulated step (one decode step of ``B`` sequences, layers in order): a layer's *needed* experts are the union of
its ``B`` tokens' choices; the cached ones are hits and pinned, the rest are admitted (the policy picks victims
among unpinned experts) and pinned; pins drop after the layer. With prefetch, while layer ``l - 1`` runs the
routing model's early evaluation of layer ``l`` (:meth:`RoutingModel.predict`, the synthetic stand-in for the
next layer's router applied to the current hidden state) names the predicted experts; the uncached ones are
copied ahead (admitted and pinned), so at layer ``l`` a predicted-and-needed expert is a hit, and a
predicted-not-needed copy is wasted bytes. Hit rates count steps after a 64-token warm-up.

Policies (``--policies``): ``lru`` (global LRU, :class:`~ferrylm.experts.cache.LRUPolicy`), ``layer-lru`` (LRU
within per-layer shares, the executors' default :class:`~ferrylm.experts.cache.LayerLRUPolicy`), ``layer-lfu``
(least frequently used within shares, counts kept across evictions), ``layer-lrfu-H`` (the LRU/LFU blend of
Lee et al. 2001, "LRFU": each expert's score decays by half every ``H`` tokens of its layer and gains 1 per use;
:class:`~ferrylm.experts.cache.LayerLRFUPolicy`), and ``opt`` (Belady's optimal replacement per layer: it knows the
future, so no policy can beat it; an upper bound).

Output: a table per profile and batch, and ``--json PATH`` with every curve and the prefetch figures
(docs/bench/2026-12-01-cache-policy.json; docs/ROUTING.md has the tables).
"""

from __future__ import annotations

import bisect
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ferrylm.bench.report import write_json
from ferrylm.experts.cache import (CacheFull, LayerLRFUPolicy, LayerLRUPolicy, LRUPolicy, ScoredLayerPolicy,
                                   SlotCache)
from ferrylm.synthetic.routing_model import RoutingModel, sequence_key
from ferrylm.synthetic.routing_profiles import get_profile

WARMUP_STEPS = 64
#: bytes of one bf16 expert (gate + up + down = 3 * H * I * 2) of the shape each profile stands for
EXPERT_BYTES = {"qwen3": 3 * 2048 * 768 * 2,      # Qwen3-30B-A3B (the qwen3-30b-a3b preset)
                "uniform": 3 * 2048 * 768 * 2,    # same shape, no locality
                "olmoe": 3 * 2048 * 1024 * 2,     # OLMoE-1B-7B (the olmoe-1b-7b preset)
                "wide512": 3 * 2048 * 512 * 2}    # a 512-expert top-10 shape (Qwen3-Next-80B-A3B: H 2048, I 512)
#: slots per layer swept for each profile (by its expert count)
SLOTS = {128: (16, 24, 32, 51, 64, 96), 64: (12, 16, 24, 32, 48), 512: (32, 64, 128, 192, 256)}
DEFAULT_POLICIES = ("lru", "layer-lru", "layer-lfu", "layer-lrfu-q0.5", "layer-lrfu", "layer-lrfu-q2", "layer-lrfu-q4",
                    "opt")


@dataclass
class Trace:
    """Routing of ``B`` sequences decoding ``steps`` tokens through ``L`` MoE layers.

    Attributes:
        route: ``[L, steps, B, k]`` the experts each token chose.
        pred: ``[L, steps, B, k]`` the early evaluation of each layer (made while the layer before runs).
        num_experts: ``E``.
    """

    route: np.ndarray
    pred: np.ndarray
    num_experts: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.route.shape  # type: ignore[return-value]


def make_trace(profile: str, num_experts: int, top_k: int, *, layers: int = 8, batch: int = 1, steps: int = 384,
               seed: int = 0) -> Trace:
    """A decode trace of ``profile``: sequence ``b`` has key ``sequence_key([b], seed)`` and starts at position
    ``37 * b`` (a prompt of its own length), layers ``1..layers`` of the routing model (layer 0 has no
    predecessor to predict it from)."""
    model = RoutingModel(get_profile(profile), num_experts, top_k, seed=seed, layers=range(layers + 1))
    keys = torch.tensor([sequence_key([b], seed) for b in range(batch)], dtype=torch.int64)
    pos = (torch.arange(steps)[:, None] + 37 * torch.arange(batch)[None, :]).reshape(-1)
    keys = keys[None, :].expand(steps, -1).reshape(-1)
    route = np.stack([model.route(l, keys, pos).numpy().reshape(steps, batch, top_k) for l in range(1, layers + 1)])
    pred = np.stack([model.predict(l, keys, pos).numpy().reshape(steps, batch, top_k) for l in range(1, layers + 1)])
    return Trace(route, pred, num_experts)


class LayerLFUPolicy(ScoredLayerPolicy):
    """Least frequently used within per-layer shares; a use count per expert kept across evictions (so an expert
    that was popular comes back with its history), ties by recency."""

    def __init__(self, quota: int) -> None:
        super().__init__(quota)
        self._count: dict = {}

    def _used(self, key) -> None:
        self._count[key] = self._count.get(key, 0) + 1

    def score(self, key) -> float:
        return self._count.get(key, 0)


def make_policy(name: str, num_slots: int, num_layers: int, top_k: int):
    """The :class:`~ferrylm.experts.cache.EvictionPolicy` called ``name`` for ``num_slots`` slots over
    ``num_layers`` layers. ``layer-lrfu``: half-life = the per-layer quota in uses (``--moe-cache-policy
    layer-lrfu``); ``layer-lrfu-qX``: ``X`` quotas; ``layer-lrfu-tH``: ``H`` tokens at batch 1 (``H * top_k``
    uses)."""
    quota = max(1, num_slots // num_layers)
    if name == "lru":
        return LRUPolicy()
    if name == "layer-lru":
        return LayerLRUPolicy(quota)
    if name == "layer-lfu":
        return LayerLFUPolicy(quota)
    if name == "layer-lrfu":
        return LayerLRFUPolicy(quota)
    if name.startswith("layer-lrfu-q"):
        return LayerLRFUPolicy(quota, half_life_slots=float(name.removeprefix("layer-lrfu-q")))
    if name.startswith("layer-lrfu-t"):
        return LayerLRFUPolicy(quota, half_life=float(name.removeprefix("layer-lrfu-t")) * top_k)
    raise ValueError(f"unknown policy {name!r}; policies: {', '.join(DEFAULT_POLICIES)}")


@dataclass
class SimResult:
    """One simulation: ``hit_rate`` over needed experts after the warm-up, and with prefetch the predictor's
    ``recall`` (predicted & needed / needed), ``precision`` (predicted & needed / predicted), copies ahead per
    token that were ``useful`` or ``wasted``, and the wasted bytes per token."""

    hit_rate: float
    needed_per_step: float
    recall: float | None = None
    precision: float | None = None
    prefetch_useful_per_token: float | None = None
    prefetch_wasted_per_token: float | None = None
    wasted_bytes_per_token: float | None = None
    extra: dict = field(default_factory=dict)


def simulate(trace: Trace, policy: str, slots_per_layer: int, *, prefetch: bool = False,
             expert_bytes: int = 0) -> SimResult:
    """Run ``trace`` through a :class:`SlotCache` of ``slots_per_layer * L`` slots under ``policy`` (module
    docstring). ``opt`` goes to :func:`simulate_opt`.

    Raises:
        ValueError: fewer slots than one layer's needed experts plus its predicted ones.
    """
    if policy == "opt":
        if prefetch:
            raise ValueError("opt is simulated without prefetch")
        return simulate_opt(trace, slots_per_layer)
    layers, steps, batch, k = trace.shape
    cache = SlotCache(slots_per_layer * layers, make_policy(policy, slots_per_layer * layers, layers, k))
    hits = needed_total = 0
    pred_hit = pred_total = need_for_recall = useful = wasted = 0
    ahead: set = set()   # keys copied ahead for the coming layer
    for t in range(steps):
        count = t >= WARMUP_STEPS
        for li in range(layers):
            need = [(li, e) for e in dict.fromkeys(trace.route[li, t].reshape(-1).tolist())]  # in routing order
            if prefetch and ahead:
                needed = {key for key in need}
                useful += count * len(ahead & needed)
                wasted += count * len(ahead - needed)
            missing = []
            for key in need:          # the layer's cached experts are pinned before any miss is admitted
                if cache.lookup(key) is not None:
                    hits += count
                    cache.pin(key)
                else:
                    missing.append(key)
            for key in missing:
                try:
                    cache.admit(key)
                except CacheFull:
                    raise ValueError(f"{slots_per_layer} slots per layer cannot hold a layer's experts") from None
                cache.pin(key)
            needed_total += count * len(need)
            cache.unpin_all(ahead)
            ahead = set()
            if prefetch and li + 1 < layers:
                pred = {(li + 1, int(e)) for e in np.unique(trace.pred[li + 1, t])}
                actual = {(li + 1, int(e)) for e in np.unique(trace.route[li + 1, t])}
                pred_hit += count * len(pred & actual)
                pred_total += count * len(pred)
                need_for_recall += count * len(actual)
                for key in sorted(pred):
                    if key in cache:
                        cache.touch(key)
                        continue
                    if cache.evictable() == 0:
                        break
                    cache.admit(key)
                    cache.pin(key)
                    ahead.add(key)
            cache.unpin_all(need)
    counted = max(1, steps - WARMUP_STEPS)
    res = SimResult(hit_rate=hits / max(1, needed_total), needed_per_step=needed_total / counted)
    if prefetch:
        tokens = counted * batch
        res.recall = pred_hit / max(1, need_for_recall)
        res.precision = pred_hit / max(1, pred_total)
        res.prefetch_useful_per_token = useful / tokens
        res.prefetch_wasted_per_token = wasted / tokens
        res.wasted_bytes_per_token = wasted * expert_bytes / tokens
    return res


def simulate_opt(trace: Trace, slots_per_layer: int) -> SimResult:
    """Belady's optimal replacement per layer (each layer its own ``slots_per_layer`` slots): evict the cached
    expert not needed now whose next use is farthest (never: first)."""
    layers, steps, _, _ = trace.shape
    hits = total = 0
    for li in range(layers):
        needs = [set(np.unique(trace.route[li, t]).tolist()) for t in range(steps)]
        uses: dict[int, list[int]] = {}
        for t, s in enumerate(needs):
            for e in s:
                uses.setdefault(e, []).append(t)

        def next_use(e: int, t: int) -> int:
            u = uses[e]
            i = bisect.bisect_right(u, t)
            return u[i] if i < len(u) else steps + 1

        cached: set[int] = set()
        for t, need in enumerate(needs):
            count = t >= WARMUP_STEPS
            hits += count * len(need & cached)
            total += count * len(need)
            for e in need - cached:
                if len(cached) >= slots_per_layer:
                    victims = cached - need
                    if not victims:
                        raise ValueError(f"{slots_per_layer} slots per layer cannot hold a layer's experts")
                    cached.remove(max(victims, key=lambda v: next_use(v, t)))
                cached.add(e)
    counted = max(1, steps - WARMUP_STEPS)
    return SimResult(hit_rate=hits / max(1, total), needed_per_step=total / counted)


def run(profiles=("qwen3", "olmoe", "wide512", "uniform"), batches=(1, 8), policies=DEFAULT_POLICIES, *,
        layers: int = 8, steps: int = 384, seed: int = 0, progress=None, with_routing: bool = True) -> dict:
    """Every curve and the prefetch figures as one JSON-ready dict (see :func:`main`); with ``with_routing``
    the routing model's statistics next to the published ones (:func:`ferrylm.bench.routing_report.routing_report`)
    as ``routing``."""
    from ferrylm.bench.routing_report import routing_report

    out: dict = {"setup": {"layers": layers, "steps": steps, "warmup_steps": WARMUP_STEPS, "seed": seed,
                           "policies": list(policies), "batches": list(batches)},
                 "routing": routing_report() if with_routing else {}, "curves": {}, "prefetch": {}}
    for name in profiles:
        prof = get_profile(name)
        e, k = prof.shape
        out["curves"][name] = {"shape": [e, k]}
        out["prefetch"][name] = {"expert_bytes": EXPERT_BYTES.get(name, 0)}
        for b in batches:
            trace = make_trace(name, e, k, layers=layers, batch=b, steps=steps, seed=seed)
            peak = max(len(np.unique(trace.route[li, t])) for li in range(layers) for t in range(steps))
            # a layer may need more experts than its share (the shares lend to each other); below half its peak
            # need every policy thrashes (and the scans get slow), so those sizes are left out
            sizes = [c for c in SLOTS[e] if 2 * c >= peak]
            curve: dict = {}
            for pol in policies:
                curve[pol] = {}
                for c in sizes:
                    if pol == "opt" and c < peak:  # opt keeps each layer to its own slots
                        continue
                    t0 = time.perf_counter()
                    curve[pol][str(c)] = round(simulate(trace, pol, c).hit_rate, 4)
                    if progress:
                        progress(f"{name} c{b} {pol} {c}: {curve[pol][str(c)]:.3f} "
                                 f"({time.perf_counter() - t0:.1f} s)")
            out["curves"][name][f"c{b}"] = curve
            out["curves"][name][f"c{b}_peak_needed"] = peak
            pf: dict = {}
            for c in sizes:
                r = simulate(trace, "layer-lru", c, prefetch=True, expert_bytes=EXPERT_BYTES.get(name, 0))
                pf[str(c)] = {k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in asdict(r).items()
                              if k2 != "extra"}
            out["prefetch"][name][f"c{b}"] = pf
    return out


def format_tables(result: dict) -> str:
    """Markdown tables: hit rate per policy (rows) and slots per layer (columns), per profile and batch."""
    lines = []
    for name, per in result["curves"].items():
        for bkey, curve in per.items():
            if not isinstance(curve, dict) or bkey == "shape":
                continue
            sizes = sorted({int(c) for pol in curve.values() for c in pol})
            lines.append(f"\n{name} ({per['shape'][0]} experts, top-{per['shape'][1]}), {bkey}: hit rate by slots "
                         "per layer")
            lines.append("| policy | " + " | ".join(str(c) for c in sizes) + " |")
            lines.append("|---|" + "---|" * len(sizes))
            order = [p for p in DEFAULT_POLICIES if p in curve] + [p for p in curve if p not in DEFAULT_POLICIES]
            for pol in order:
                row = curve[pol]
                lines.append(f"| {pol} | " + " | ".join(f"{row[str(c)]:.3f}" if str(c) in row else "-"
                                                         for c in sizes) + " |")
    return "\n".join(lines)


def main(args) -> int:
    result = run(profiles=tuple(args.profiles.split(",")), batches=tuple(int(b) for b in args.batches.split(",")),
                 policies=tuple(args.policies.split(",")), layers=args.layers, steps=args.steps, seed=args.seed,
                 progress=(lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else None)
    print(format_tables(result))
    if args.json:
        write_json(args.json, result, sort_keys=True)
    return 0
