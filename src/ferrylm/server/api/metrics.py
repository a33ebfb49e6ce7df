"""Prometheus metrics for ``GET /metrics`` (names prefixed ``ferrylm:``, following vLLM's where one exists).

Two sources, one registry per app (never prometheus_client's global default registry):

- request-level figures, observed by the HTTP layer (``server/api/app.py``) as requests run: TTFT, inter-token
  latency, end-to-end latency, prompt / generation tokens, finished requests by reason, errors by code, and the
  queue time, which the engine measures on its own clock (arrival → first scheduled) and sends on the request's
  first output (``EngineOutput.queue_time``).
- engine figures, read at scrape time from the engine client (the supervisor): the latest heartbeat stats
  (``Engine.stats()``, every ~0.5 s over the existing IPC), the boot memory plan from the engine's Ready
  message, and the supervisor's restart count. No second metrics server, nothing in the engine process.

Engine counters (preemptions, expert hits / misses / bytes, OOM recoveries, prefix-cache queries / hits in
tokens) restart at 0 with a restarted engine;
:class:`EngineCollector` keeps them monotonic across restarts by adding what earlier engines had counted.

This module must not import torch.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

P = "ferrylm:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets as vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

# memory-plan fields exported as ferrylm:memory_plan_bytes{part=...}
_PLAN_BYTES = ("total_bytes", "free_at_boot_bytes", "reserve_bytes", "budget_bytes", "weights_bytes",
               "workspace_bytes", "kv_bytes", "expert_bytes", "headroom_bytes")
# engine counters kept monotonic across engine restarts: metric name → path in the heartbeat stats
_ENGINE_COUNTERS = {
    "num_preemptions": ("num_preemptions",),
    "expert_cache_hits": ("experts", "hits"),
    "expert_cache_misses": ("experts", "misses"),
    "expert_bytes_copied": ("experts", "bytes_copied"),
    "expert_bytes_mapped": ("experts", "bytes_mapped"),
    "expert_cpu_computed": ("experts", "cpu_experts"),
    "decode_graph_steps": ("decode_graphs", "steps"),
    "decode_graph_replays": ("decode_graphs", "replays"),
    "prefix_cache_queries": ("prefix_cache", "queries"),
    "prefix_cache_hits": ("prefix_cache", "hits"),
}


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _graph_bytes(d: Any) -> float | None:
    """``graph_bytes + stage_bytes`` of the engine's ``decode_graphs`` stats, or None without them."""
    if not isinstance(d, dict):
        return None
    a, b = _num(d.get("graph_bytes")), _num(d.get("stage_bytes"))
    return None if a is None and b is None else (a or 0.0) + (b or 0.0)


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


_COUNTER_HELP = {
    "num_preemptions": "Requests preempted by the scheduler (KV pages short)",
    "expert_cache_hits": "Needed (layer, expert) pairs found in the device expert cache",
    "expert_cache_misses": "Needed (layer, expert) pairs not in the device expert cache",
    "expert_bytes_copied": "Expert bytes copied host to device (demand, prefetch, streaming)",
    "expert_bytes_mapped": "Expert bytes the fused kernel read from mapped host memory over PCIe (offload decode "
                           "table misses)",
    "expert_cpu_computed": "Needed (layer, expert) pairs computed on the CPU (cpu / hybrid backends)",
    "decode_graph_steps": "Decode steps run through the piecewise decode path (CUDA graphs)",
    "decode_graph_replays": "Decode steps replayed from captured CUDA graphs",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache (at each request's first scheduling)",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache (their prefill was skipped)"}


class EngineCollector:
    """Reads the engine client's latest figures at scrape time.

    The client may provide (all optional, so a test fake without them still works): ``last_stats`` (heartbeat
    stats dict), ``memory_plan`` (the boot plan dict), ``num_restarts`` (int), ``engine_pid``, and ``health()``.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self._pid: Any = None
        self._base: dict[str, float] = {}     # counted by earlier engine processes
        self._last: dict[str, float] = {}     # last value seen from the current one

    def _monotonic(self, key: str, value: float, new_engine: bool) -> float:
        base = self._base.get(key, 0.0)
        last = self._last.get(key, 0.0)
        if new_engine or value < last:        # a restarted engine counts from 0 again
            base += last
            self._base[key] = base
        self._last[key] = value
        return base + value

    def describe(self) -> Iterable[Metric]:
        return []   # no fixed description: the families depend on what the engine reports

    def collect(self) -> Iterable[Metric]:
        eng = self.engine
        stats = getattr(eng, "last_stats", None) or {}
        pid = getattr(eng, "engine_pid", None)
        new_engine = pid is not None and self._pid is not None and pid != self._pid
        if pid is not None:
            self._pid = pid
        yield from self._engine_state(stats)
        yield from self._counters(stats, new_engine)
        yield from self._memory(stats)
        plan = getattr(eng, "memory_plan", None)
        if isinstance(plan, dict):
            yield from self._plan(plan)

    def _engine_state(self, stats: dict) -> Iterable[Metric]:
        """Ready, restarts, running / waiting requests, KV cache usage."""
        eng = self.engine
        ready = 0.0
        try:
            ready = 1.0 if eng.health().ready else 0.0
        except Exception:  # noqa: BLE001 - a scrape must never fail on the engine's state
            pass
        g = GaugeMetricFamily(P + "engine_ready", "1 when the engine is ready to serve, else 0")
        g.add_metric([], ready)
        yield g
        c = CounterMetricFamily(P + "engine_restarts", "Engine process restarts since the server started")
        c.add_metric([], float(getattr(eng, "num_restarts", 0) or 0))
        yield c
        for name, help_, key in (("num_requests_running", "Requests in the engine's running batch", "num_running"),
                                 ("num_requests_waiting", "Requests waiting in the engine's queue", "num_waiting")):
            g = GaugeMetricFamily(P + name, help_)
            g.add_metric([], _num(stats.get(key)) or 0.0)
            yield g
        used, total = _num(stats.get("kv_pages_used")), _num(stats.get("kv_pages_total"))
        g = GaugeMetricFamily(P + "kv_cache_usage_perc", "KV cache usage (fraction of pages in use, 1 = full)")
        g.add_metric([], used / total if used is not None and total else 0.0)
        yield g

    def _counters(self, stats: dict, new_engine: bool) -> Iterable[Metric]:
        """The engine's counters, monotonic across restarts; the prefix cache hit rate; OOM recoveries."""
        totals: dict[str, float] = {}
        for name, path in _ENGINE_COUNTERS.items():
            v = _num(_get(stats, path))
            c = CounterMetricFamily(P + name, _COUNTER_HELP[name])
            totals[name] = self._monotonic(name, v or 0.0, new_engine)
            c.add_metric([], totals[name])
            yield c
        g = GaugeMetricFamily(P + "prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since the "
                              "server started (0 before any query)")
        q = totals["prefix_cache_queries"]
        g.add_metric([], totals["prefix_cache_hits"] / q if q else 0.0)
        yield g
        rec = stats.get("oom_recoveries") or {}
        c = CounterMetricFamily(P + "oom_recoveries", "Out-of-memory recoveries at the step boundary, by action",
                                labels=["action"])
        actions = sorted(set(rec) | {k.split(":", 1)[1] for k in self._last if k.startswith("oom:")})
        for action in actions:
            v = _num(rec.get(action)) or 0.0
            c.add_metric([str(action)], self._monotonic(f"oom:{action}", v, new_engine))
        yield c

    @staticmethod
    def _memory(stats: dict) -> Iterable[Metric]:
        """Memory now, as the engine last measured it."""
        mem = stats.get("memory") or {}
        for name, help_, v in (
                ("memory_free_bytes", "Free device (or host) memory now, as the engine last measured it",
                 mem.get("free_bytes")),
                ("expert_cache_slots", "Expert slots in the device cache now", mem.get("expert_slots")),
                ("prefill_budget_tokens", "Prefill tokens per step now (lowered by OOM recoveries)",
                 mem.get("prefill_budget")),
                ("decode_graph_memory_bytes", "Device memory held by decode CUDA graphs and expert stages (outside "
                 "the boot memory plan)", _graph_bytes(stats.get("decode_graphs")))):
            v = _num(v)
            if v is not None:
                g = GaugeMetricFamily(P + name, help_)
                g.add_metric([], v)
                yield g

    @staticmethod
    def _plan(plan: dict) -> Iterable[Metric]:
        """The boot memory plan: bytes by part, KV pages / tokens, expert slots."""
        g = GaugeMetricFamily(P + "memory_plan_bytes", "The boot memory plan, bytes by part", labels=["part"])
        for k in _PLAN_BYTES:
            v = _num(plan.get(k))
            if v is not None:
                g.add_metric([k[:-len("_bytes")]], v)
        yield g
        for name, help_, key in (("memory_plan_kv_pages", "KV pages in the boot plan", "kv_pages"),
                                 ("memory_plan_kv_tokens", "KV tokens in the boot plan", "kv_tokens"),
                                 ("memory_plan_expert_slots", "Device expert slots in the boot plan", "expert_slots"),
                                 ("memory_plan_expert_total", "Routed experts in the model (all layers)",
                                  "expert_total")):
            v = _num(plan.get(key))
            if v is not None:
                g = GaugeMetricFamily(P + name, help_)
                g.add_metric([], v)
                yield g


class _ConstLabels:
    """A registry's metrics with constant labels added to every sample at scrape time (vLLM labels each metric
    with ``model_name``): the observing code stays label-free."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        self.registry, self.labels = registry, labels

    def collect(self) -> Iterable[Metric]:
        for m in self.registry.collect():
            out = Metric(m.name, m.documentation, m.type, m.unit)
            for smp in m.samples:
                out.add_sample(smp.name, {**smp.labels, **self.labels}, smp.value, smp.timestamp, smp.exemplar)
            yield out


class Metrics:
    """The app's metrics: a private registry with the request-level metrics and the engine collector; every
    sample carries ``model_name`` (the served model name, as vLLM's)."""

    def __init__(self, engine: Any, model_name: str | None = None):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds",
                              "Time from the request's arrival to its first generated token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between two outputs of one request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds",
                             "Time from the request's arrival to its last token", buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds",
                                    "Time from the engine receiving the request to its first scheduling "
                                    "(first prefill chunk), per engine request (choice)",
                                    buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens prefilled (counted at the first token)",
                                     registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.success = Counter(P + "request_success", "Finished requests (choices) by finish reason",
                               ["finished_reason"], registry=r)
        self.errors = Counter(P + "request_errors", "Requests answered with an error, by error code", ["code"],
                              registry=r)
        for reason in ("stop", "length"):
            self.success.labels(reason)
        r.register(EngineCollector(engine))

    def render(self) -> bytes:
        if self.model_name is None:
            return generate_latest(self.registry)
        return generate_latest(_ConstLabels(self.registry, {"model_name": self.model_name}))
