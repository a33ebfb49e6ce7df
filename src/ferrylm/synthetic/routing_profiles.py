"""Routing profiles: the parameters of the synthetic routing model (:mod:`ferrylm.synthetic.routing_model`) and the
published figures each was fitted to. Torch-free (the CLI and the spec parser read it).

Figures, sources and the reproduced statistics side by side: docs/ROUTING.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HotComponent:
    """One time scale of temporal reuse.

    Attributes:
        period: tokens between an expert's re-draws (its clock period, >= 1).
        prob: probability that an expert is hot in a period (0..1); about ``prob * E`` experts are hot at once.
        bonus: score added to a hot expert (in units of the per-token noise's standard deviation).
        continuous: instead of the hot/cold step, every expert gets ``bonus * z`` with ``z`` a standard normal
            re-drawn each period (``prob`` unused): the ranking by ``z`` moves one re-draw at a time, so the
            top of it is far stickier than a Bernoulli hot set whose size fluctuates (OLMoE's Jaccard ~0.83).
    """

    period: int
    prob: float
    bonus: float
    continuous: bool = False


@dataclass(frozen=True)
class RoutingProfile:
    """The parameters of the routing model (module docstring) and the published figures they were fitted to.

    Attributes:
        name: profile name (``routing=<name>``).
        zipf: popularity skew (0 = flat).
        hot: temporal reuse components.
        phi: fresh share of the per-token noise's variance (1 = no cross-layer correlation).
        depth: earlier layers whose noise a layer mixes in (``D``; unused when ``phi == 1``).
        targets: published statistic -> value (keys of :func:`ferrylm.synthetic.routing_stats.trace_stats`), what
            the tests check the model against.
        source: where the targets come from (docs/ROUTING.md has the full references).
        shape: ``(num_experts, top_k)`` the targets were measured on (the model runs at any shape).
    """

    name: str
    zipf: float = 0.0
    hot: tuple[HotComponent, ...] = ()
    phi: float = 1.0
    depth: int = 2
    targets: dict[str, float] = field(default_factory=dict, compare=False)
    source: str = ""
    shape: tuple[int, int] = (128, 8)

    def __post_init__(self) -> None:
        if self.zipf < 0 or not math.isfinite(self.zipf):
            raise ValueError(f"routing profile {self.name}: zipf must be finite and >= 0, got {self.zipf}")
        if not 0.0 <= self.phi <= 1.0:
            raise ValueError(f"routing profile {self.name}: phi must be in [0, 1], got {self.phi}")
        if self.depth < 1:
            raise ValueError(f"routing profile {self.name}: depth must be >= 1, got {self.depth}")
        for c in self.hot:
            if c.period < 1 or not 0.0 <= c.prob <= 1.0:
                raise ValueError(f"routing profile {self.name}: bad hot component {c}")


#: Published figures (sources in docs/ROUTING.md). Parameters fitted by an ad-hoc random, then local,
#: search on the statistics of ferrylm.synthetic.routing_stats (1-2 sequences x 512-768 tokens x 3 layers per
#: candidate; the search scripts were not kept: tests/models/test_routing_model.py checks the result).
PROFILES: dict[str, RoutingProfile] = {p.name: p for p in (
    RoutingProfile("uniform", targets={}, source="none: independent uniform top-k, the worst case for a cache"),
    RoutingProfile(
        "qwen3", zipf=0.67, hot=(HotComponent(6, 0.121, 2.04), HotComponent(64, 0.257, 2.74)), phi=0.27,
        targets={"repeat_next": 0.45, "reuse_within_8": 0.80, "median_reuse_distance": 2.0, "lru_40pct": 0.925,
                 "predict_recall": 0.78},
        source="kekzl/imp PR #1359 (Qwen3-30B-A3B decode traces, 3 prompts x 512 tokens); recall: issue 30",
        shape=(128, 8)),
    RoutingProfile(
        "olmoe", zipf=5.3, hot=(HotComponent(128, 0.0, 11.5, continuous=True),), phi=0.5,
        targets={"top_half_share": 0.765, "jaccard_next": 0.83},
        source="JustVugg/colibri issue #864 (OLMoE-1B-7B-0924, 520 prompts, ~50k tokens)", shape=(64, 8)),
    RoutingProfile(
        "wide512", zipf=0.05, hot=(HotComponent(6, 0.02, 3.3), HotComponent(256, 0.12, 1.8)), phi=0.30,
        targets={"lru_64": 0.67, "lru_128": 0.81, "predict_recall": 0.78},
        source="issue 30's 512-expert LRU figures (their source not located; docs/ROUTING.md)", shape=(512, 10)),
)}

#: ``routing=router``: no routing model; the random router's own top-k (with ``skew=``'s Zipf bias)
ROUTER = "router"
#: every ``routing=`` value
ROUTING_CHOICES = (ROUTER, *PROFILES)
#: the calibrated profile a preset's ``model_type`` gets when the spec names none (and gives no ``skew=``)
FAMILY_PROFILE = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen3", "olmoe": "olmoe", "mixtral": ROUTER,
                  "qwen3_next": "qwen3", "qwen3_5_moe_text": "qwen3",
                  # DeepSeek-V3 / Kimi-K2 (no published locality figures of their own): the Qwen3 profile, top-8 too
                  "deepseek_v3": "qwen3", "kimi_k2": "qwen3"}


def default_routing(model_type: str, skew: float) -> str:
    """The ``routing=`` of a spec that names none: ``router`` when ``skew > 0`` (the skew is the router's),
    else the family's calibrated profile (``router`` for families without published figures)."""
    return ROUTER if skew > 0 else FAMILY_PROFILE.get(model_type, ROUTER)


def get_profile(name: str) -> RoutingProfile:
    """The profile called ``name``. Raises ValueError naming the profiles when there is none."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown routing profile {name!r}; profiles: {', '.join(PROFILES)}") from None
