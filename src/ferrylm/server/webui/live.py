"""The web page's live view: one JSON body (``GET /v1/live``) from what the server already computes.

Sources, never a second copy of their figures:

- the memory plan and its live figures: :meth:`LiveSource.memory_info`, the body of ``GET /v1/memory``;
- the engine's state and its last heartbeat stats (per-layer expert hits / misses): the engine client's
  ``health()``, what ``GET /health`` answers;
- counters and histograms: the app's metrics registry, read as ``GET /metrics`` scrapes it (engine counters are
  kept monotonic across engine restarts there).

A sampler task reads the registry every ``interval_s`` and keeps ``window`` samples of what changed in between:
generated tokens/s, the mean TTFT of the requests that got their first token, running / waiting requests, KV use,
expert bytes over PCIe and read from host DRAM per second, the hit rate of each MoE layer, OOM recoveries by
action. Each sample has a sequence number; ``?since=N`` answers only the samples after ``N``.

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

from prometheus_client import CollectorRegistry

from ferrylm.errors import InvalidRequest
from ferrylm.server.process.engine_client import EngineClient

if TYPE_CHECKING:
    from ferrylm.server.api.metrics import Metrics

log = logging.getLogger("ferrylm.server.webui")

SAMPLE_INTERVAL_S = 1.0
WINDOW = 300          # samples kept: five minutes at one a second
P = "ferrylm:"
GB = 1e9


@dataclass(frozen=True)
class Reading:
    """One read of the sources. ``t``: monotonic seconds; ``values``: unlabelled metric samples by name;
    ``oom``: OOM recoveries by action (since the server started); ``layer_hits`` / ``layer_misses``: the current
    engine's per-MoE-layer counts; ``expert_bytes``: bytes of one routed expert (0: none or unknown). ``running``,
    ``waiting`` (requests) and ``kv_used`` (fraction of KV pages in use) are the running engine's (None while it
    loads or restarts)."""

    t: float
    values: dict[str, float]
    oom: dict[str, float]
    running: int | None = None
    waiting: int | None = None
    kv_used: float | None = None
    layer_hits: tuple[int, ...] = ()
    layer_misses: tuple[int, ...] = ()
    expert_bytes: int = 0

    def get(self, name: str) -> float:
        return self.values.get(P + name, 0.0)

    @property
    def pcie_bytes(self) -> float:
        """Expert bytes that crossed PCIe: copied into slots, or read by the fused kernel from mapped host memory."""
        return self.get("expert_bytes_copied_total") + self.get("expert_bytes_mapped_total")

    @property
    def host_dram_bytes(self) -> float:
        """Expert bytes read from host DRAM: what crossed PCIe (its source is host memory) plus the weights of
        the experts the CPU computed."""
        return self.pcie_bytes + self.get("expert_cpu_computed_total") * self.expert_bytes


@dataclass(frozen=True)
class Sample:
    """What changed between two readings, ``seq`` numbered; rates per second of ``dt_s``. ``ttft_s``: mean
    TTFT of the requests whose first token came in this interval (None: none did); ``running``, ``waiting``,
    ``kv_used``: as :class:`Reading` has them at the end of the interval; ``layer_hit_rate``: hits / lookups per MoE layer in this interval (None: no lookup); ``oom``:
    recoveries in this interval by action."""

    seq: int
    t: float
    dt_s: float
    state: str
    gen_tok_s: float
    ttft_s: float | None
    running: int | None
    waiting: int | None
    kv_used: float | None
    pcie_gb_s: float
    host_dram_gb_s: float
    layer_hit_rate: list[float | None] | None
    oom: dict[str, int] = field(default_factory=dict)


def scrape(registry: CollectorRegistry) -> tuple[dict[str, float], dict[str, float]]:
    """One pass over ``registry``: unlabelled samples by name, and ``oom_recoveries_total`` by ``action``."""
    values: dict[str, float] = {}
    oom: dict[str, float] = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == P + "oom_recoveries_total":
                oom[s.labels.get("action", "")] = s.value
            elif not s.labels:
                values[s.name] = s.value
    return values, oom


def _rate(cur: float, prev: float, dt: float) -> float:
    """Per-second growth of a counter; a counter that went back (a new engine's per-layer counts) counts from 0."""
    d = cur - prev if cur >= prev else cur
    return d / dt if dt > 0 else 0.0


def _layer_rates(cur: Reading, prev: Reading) -> list[float | None] | None:
    if not cur.layer_hits or len(cur.layer_hits) != len(cur.layer_misses):
        return None
    same = len(prev.layer_hits) == len(cur.layer_hits)
    out: list[float | None] = []
    for i, (h, m) in enumerate(zip(cur.layer_hits, cur.layer_misses)):
        ph, pm = (prev.layer_hits[i], prev.layer_misses[i]) if same else (0, 0)
        dh, dm = (h - ph, m - pm) if h >= ph and m >= pm else (h, m)
        out.append(round(dh / (dh + dm), 4) if dh + dm > 0 else None)
    return out


def make_sample(seq: int, cur: Reading, prev: Reading, state: str, wall: float) -> Sample:
    """The sample between ``prev`` and ``cur`` (``wall``: unix seconds of ``cur``)."""
    dt = cur.t - prev.t
    n_ttft = cur.get("time_to_first_token_seconds_count") - prev.get("time_to_first_token_seconds_count")
    s_ttft = cur.get("time_to_first_token_seconds_sum") - prev.get("time_to_first_token_seconds_sum")
    oom = {a: int(v - prev.oom.get(a, 0.0)) for a, v in cur.oom.items() if v > prev.oom.get(a, 0.0)}
    return Sample(seq=seq, t=round(wall, 3), dt_s=round(dt, 3), state=state,
                  gen_tok_s=round(_rate(cur.get("generation_tokens_total"), prev.get("generation_tokens_total"), dt),
                                  2),
                  ttft_s=round(s_ttft / n_ttft, 4) if n_ttft > 0 else None,
                  running=cur.running, waiting=cur.waiting, kv_used=cur.kv_used,
                  pcie_gb_s=round(_rate(cur.pcie_bytes, prev.pcie_bytes, dt) / GB, 4),
                  host_dram_gb_s=round(_rate(cur.host_dram_bytes, prev.host_dram_bytes, dt) / GB, 4),
                  layer_hit_rate=_layer_rates(cur, prev), oom=oom)


def _experts(stats: dict) -> dict | None:
    """The expert cache's figures of the heartbeat stats (None for a dense model)."""
    e = stats.get("experts")
    if not isinstance(e, dict) or not e:
        return None
    keys = ("backend", "num_slots", "expert_bytes", "hits", "misses", "hit_rate", "layers", "layer_hits",
            "layer_misses", "prefetch", "cpu_experts")
    return {k: e.get(k) for k in keys}


class LiveSource(Protocol):
    """What the live view reads of the app's server (``server/api/app.py``): the engine client (its health), the
    metrics (their registry), the served name and context, and ``GET /v1/memory``'s body."""

    engine: EngineClient
    metrics: Metrics
    served_model_name: str

    @property
    def max_model_len(self) -> int: ...

    def memory_info(self) -> dict | None: ...


class LiveView:
    """Samples ``server``'s figures every ``interval_s`` (:meth:`lifespan` runs the task) and answers
    :meth:`snapshot`."""

    def __init__(self, server: LiveSource, *, interval_s: float = SAMPLE_INTERVAL_S, window: int = WINDOW,
                 clock=time.monotonic, wall=time.time):
        self.server = server
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=window)
        self._clock, self._wall = clock, wall
        self._prev: Reading | None = None
        self._seq = 0
        self._failed = False

    def _stats(self) -> tuple[str, dict]:
        """The engine's state and, when ready, its last heartbeat stats (what GET /health answers)."""
        h = self.server.engine.health()
        stats = (h.extra or {}).get("engine") or {}
        return h.status, stats if isinstance(stats, dict) else {}

    def read(self) -> tuple[Reading, str]:
        """Read the sources now: (the reading, the engine's state)."""
        values, oom = scrape(self.server.metrics.registry)
        state, stats = self._stats()
        e = _experts(stats) or {}
        hits, misses = e.get("layer_hits"), e.get("layer_misses")
        if e.get("backend") == "resident":   # every expert on the device: its per-layer counts stay 0
            hits, misses = None, None
        used, total = stats.get("kv_pages_used"), stats.get("kv_pages_total")
        return Reading(self._clock(), values, oom, running=stats.get("num_running"), waiting=stats.get("num_waiting"),
                       kv_used=round(used / total, 4) if isinstance(used, int) and total else None,
                       layer_hits=tuple(hits or ()), layer_misses=tuple(misses or ()),
                       expert_bytes=int(e.get("expert_bytes") or 0)), state

    def sample_now(self) -> Sample | None:
        """Take one sample (None for the first reading, which only sets the baseline)."""
        cur, state = self.read()
        prev, self._prev = self._prev, cur
        if prev is None:
            return None
        self._seq += 1
        s = make_sample(self._seq, cur, prev, state, self._wall())
        self.samples.append(s)
        return s

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled; a failed read is logged once and skipped."""
        while True:
            try:
                self.sample_now()
                self._failed = False
            except Exception:  # noqa: BLE001 - the live view must never take the server down
                if not self._failed:
                    log.exception("live view: reading the server's figures failed")
                self._failed = True
            await asyncio.sleep(self.interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """The app's lifespan: the sampler runs while the app does."""
        task = asyncio.create_task(self.run(), name="ferrylm-live-view")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def snapshot(self, since: int | None = None) -> dict:
        """The body of ``GET /v1/live``: model, engine state, the ``/v1/memory`` body (null before the first plan),
        the expert cache, OOM recoveries by action since the server started, the last sample's number (``last_seq``)
        and the samples after ``since``."""
        srv = self.server
        h = srv.engine.health()
        extra = h.extra or {}
        stats = extra.get("engine") if isinstance(extra.get("engine"), dict) else {}
        _, oom = scrape(srv.metrics.registry)
        return {
            "model": {"name": srv.served_model_name, "max_model_len": srv.max_model_len},
            "state": {"status": h.status, "detail": h.detail, "restarts": extra.get("restarts", 0),
                      "engine_pid": extra.get("engine_pid")},
            "memory": srv.memory_info(),
            "experts": _experts(stats or {}),
            "oom_recoveries": {a: int(v) for a, v in oom.items()},
            "interval_s": self.interval_s,
            "window": self.samples.maxlen,
            "last_seq": self._seq,
            "samples": [asdict(s) for s in self.samples if since is None or s.seq > since],
        }


def parse_since(raw: str | None) -> int | None:
    """``?since=`` as a sample sequence number (None when absent). Raises InvalidRequest naming ``since``."""
    if raw is None:
        return None
    try:
        v = int(raw)
    except ValueError:
        v = -1
    if v < 0:
        raise InvalidRequest(f"'since' must be a sample number >= 0, got {raw!r}", param="since")
    return v
