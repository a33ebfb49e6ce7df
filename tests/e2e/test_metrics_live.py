"""/metrics on the live server (session ``default_server``): engine figures arrive over the heartbeat IPC, the
memory plan from Ready, and request metrics move after a completion."""

from __future__ import annotations

import re
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def sample(text: str, name: str, labels: str = "") -> float | None:
    """The value of ``name{labels}`` (every sample also carries ``model_name``, whatever its value)."""
    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if "model_name" in got and {k: v for k, v in got.items() if k != "model_name"} == want:
            return float(m.group(2))
    return None


def test_metrics_live(default_server) -> None:
    base = default_server.base_url
    before = httpx.get(f"{base}/metrics", timeout=10).text
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                    "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    time.sleep(1.2)   # one heartbeat or two
    after = httpx.get(f"{base}/metrics", timeout=10).text
    for name in ("ferrylm:time_to_first_token_seconds_count", "ferrylm:e2e_request_latency_seconds_count",
                 "ferrylm:request_queue_time_seconds_count",
                 "ferrylm:generation_tokens_total", "ferrylm:prompt_tokens_total"):
        assert (sample(after, name) or 0) > (sample(before, name) or 0), name
    assert (sample(after, "ferrylm:request_success_total", '{finished_reason="length"}') or 0) >= 1
    assert sample(after, "ferrylm:engine_ready") == 1
    assert sample(after, "ferrylm:num_requests_running") is not None
    assert 0 <= sample(after, "ferrylm:kv_cache_usage_perc") <= 1
    assert sample(after, "ferrylm:engine_restarts_total") == 0
    assert sample(after, "ferrylm:num_preemptions_total") is not None
    memory = httpx.get(f"{base}/v1/memory", timeout=10).json()
    assert sample(after, "ferrylm:memory_plan_kv_pages") == memory["plan"]["kv_pages"]
    assert sample(after, "ferrylm:memory_plan_bytes", '{part="budget"}') == memory["plan"]["budget_bytes"]
    # no --max-running-requests: the plan's number (1024-token requests its KV pool holds), which the engine runs
    plan = memory["plan"]
    assert plan["max_running_requests"] == memory["server"]["max_running_requests"] == max(1, min(
        256, plan["kv_tokens"] // 1024)) and "KV pool holds" in plan["running_note"]
