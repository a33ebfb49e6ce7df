"""GET /metrics over a short scripted run with the fake engine: counters increase, histograms observe, engine
figures (heartbeat stats, memory plan, restarts) appear and stay monotonic across an engine restart."""

from __future__ import annotations

import asyncio
import re

import pytest

from ferrylm.server.api.app import create_app

from .conftest import SERVED, FakeEngine, make_client

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def sample(text: str, name: str, labels: str = "") -> float:
    """The value of ``name{labels}``; every sample also carries ``model_name`` (the served name)."""
    want = dict(re.findall(r'(\w+)="([^"]*)"', labels), model_name=SERVED)
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")) == want:
            return float(m.group(2))
    raise AssertionError(f"{name}{want} not in /metrics")


def engine_with_stats(codec) -> FakeEngine:
    eng = FakeEngine(codec)
    eng.engine_pid = 100
    eng.num_restarts = 0
    eng.last_stats = {"num_running": 2, "num_waiting": 1, "kv_pages_used": 25, "kv_pages_total": 100,
                      "num_preemptions": 3, "oom_recoveries": {"halve_chunk": 2},
                      "memory": {"free_bytes": 1000, "expert_slots": 12, "prefill_budget": 512},
                      "experts": {"hits": 40, "misses": 10, "bytes_copied": 4096, "cpu_experts": 7},
                      "decode_graphs": {"steps": 30, "replays": 29, "graph_bytes": 1 << 20, "stage_bytes": 512}}
    eng.memory_plan = {"total_bytes": 10_000, "budget_bytes": 8000, "kv_bytes": 3000, "expert_bytes": 2000,
                       "weights_bytes": 2500, "kv_pages": 100, "kv_tokens": 1600, "expert_slots": 12,
                       "expert_total": 64}
    return eng


async def test_metrics_move_over_a_scripted_run(codec) -> None:
    eng = engine_with_stats(codec)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r0 = await c.get("/metrics")
        assert r0.status_code == 200 and r0.headers["content-type"].startswith("text/plain")
        t0 = r0.text
        assert sample(t0, "ferrylm:time_to_first_token_seconds_count") == 0
        assert sample(t0, "ferrylm:request_success_total", '{finished_reason="stop"}') == 0

        r = await c.post(CHAT, json={"model": SERVED, "messages": MSGS})                      # stop
        assert r.status_code == 200
        gen1 = r.json()["usage"]["completion_tokens"]
        r = await c.post(CHAT, json={"model": SERVED, "messages": MSGS, "max_tokens": 3, "stream": True})
        assert r.status_code == 200                                                         # length, streamed
        r = await c.post(CHAT, json={"model": SERVED, "messages": MSGS, "temperature": -1})  # 400
        assert r.status_code == 400
        t1 = (await c.get("/metrics")).text

    assert sample(t1, "ferrylm:time_to_first_token_seconds_count") == 2
    assert sample(t1, "ferrylm:e2e_request_latency_seconds_count") == 2
    assert sample(t1, "ferrylm:inter_token_latency_seconds_count") == (gen1 - 1) + (3 - 1)
    assert sample(t1, "ferrylm:generation_tokens_total") == gen1 + 3
    prompt_len = len(eng.requests[0][1])
    assert sample(t1, "ferrylm:prompt_tokens_total") == 2 * prompt_len
    assert sample(t1, "ferrylm:request_success_total", '{finished_reason="stop"}') == 1
    assert sample(t1, "ferrylm:request_success_total", '{finished_reason="length"}') == 1
    assert sample(t1, "ferrylm:request_errors_total", '{code="invalid_request"}') == 1
    # engine figures from the heartbeat stats and the memory plan
    assert sample(t1, "ferrylm:num_requests_running") == 2
    assert sample(t1, "ferrylm:num_requests_waiting") == 1
    assert sample(t1, "ferrylm:kv_cache_usage_perc") == 0.25
    assert sample(t1, "ferrylm:num_preemptions_total") == 3
    assert sample(t1, "ferrylm:expert_cache_hits_total") == 40
    assert sample(t1, "ferrylm:expert_cache_misses_total") == 10
    assert sample(t1, "ferrylm:expert_bytes_copied_total") == 4096
    assert sample(t1, "ferrylm:expert_cpu_computed_total") == 7
    assert sample(t1, "ferrylm:oom_recoveries_total", '{action="halve_chunk"}') == 2
    assert sample(t1, "ferrylm:engine_restarts_total") == 0
    assert sample(t1, "ferrylm:engine_ready") == 1
    assert sample(t1, "ferrylm:memory_plan_bytes", '{part="budget"}') == 8000
    assert sample(t1, "ferrylm:memory_plan_bytes", '{part="kv"}') == 3000
    assert sample(t1, "ferrylm:memory_plan_kv_pages") == 100
    assert sample(t1, "ferrylm:memory_plan_expert_slots") == 12
    assert sample(t1, "ferrylm:expert_cache_slots") == 12
    assert sample(t1, "ferrylm:memory_free_bytes") == 1000
    assert sample(t1, "ferrylm:decode_graph_steps_total") == 30
    assert sample(t1, "ferrylm:decode_graph_replays_total") == 29
    assert sample(t1, "ferrylm:decode_graph_memory_bytes") == (1 << 20) + 512


async def test_engine_counters_stay_monotonic_across_a_restart(codec) -> None:
    eng = engine_with_stats(codec)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        await c.get("/metrics")
        eng.engine_pid, eng.num_restarts = 101, 1   # a new engine process counts from 0 again
        eng.last_stats = {"num_running": 0, "num_waiting": 0, "kv_pages_used": 0, "kv_pages_total": 100,
                          "num_preemptions": 1, "oom_recoveries": {}, "experts": {"hits": 5, "misses": 1,
                                                                                  "bytes_copied": 10}}
        t = (await c.get("/metrics")).text
    assert sample(t, "ferrylm:num_preemptions_total") == 3 + 1
    assert sample(t, "ferrylm:expert_cache_hits_total") == 45
    assert sample(t, "ferrylm:oom_recoveries_total", '{action="halve_chunk"}') == 2
    assert sample(t, "ferrylm:engine_restarts_total") == 1


async def test_metrics_without_engine_stats_and_registries_are_per_app(codec) -> None:
    eng = FakeEngine(codec)   # no last_stats / memory_plan: engine gauges read 0, no plan gauges
    a, b = create_app(eng, codec, SERVED), create_app(eng, codec, SERVED)
    async with make_client(a) as ca, make_client(b) as cb:
        assert (await ca.post(CHAT, json={"model": SERVED, "messages": MSGS})).status_code == 200
        ta, tb = (await ca.get("/metrics")).text, (await cb.get("/metrics")).text
    assert sample(ta, "ferrylm:e2e_request_latency_seconds_count") == 1
    assert sample(tb, "ferrylm:e2e_request_latency_seconds_count") == 0
    assert sample(ta, "ferrylm:kv_cache_usage_perc") == 0
    assert "ferrylm:memory_plan_bytes" not in ta


async def test_engine_error_is_counted_by_code(codec) -> None:
    from ferrylm.errors import InsufficientMemory

    eng = FakeEngine(codec, start_exc=InsufficientMemory("no room"))
    async with make_client(create_app(eng, codec, SERVED)) as c:
        assert (await c.post(CHAT, json={"model": SERVED, "messages": MSGS})).status_code == 503
        t = (await c.get("/metrics")).text
    assert sample(t, "ferrylm:request_errors_total", '{code="insufficient_memory"}') == 1


async def test_done_log_line(codec, caplog) -> None:
    eng = FakeEngine(codec)
    caplog.set_level("INFO", logger="ferrylm.server")
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await c.post(CHAT, json={"model": SERVED, "messages": MSGS, "max_tokens": 4},
                         headers={"x-request-id": "req-42"})
        assert r.headers["x-request-id"] == "req-42"
        assert (await c.post(CHAT, json={"model": "nope", "messages": MSGS},
                             headers={"x-request-id": "req-43"})).status_code == 404
    done = [m for m in caplog.messages if "done" in m]
    line = next(m for m in done if m.startswith("[req-42]"))
    for part in ("finish=length", "prompt_tokens=", "completion_tokens=4", "ttft=", "tok/s="):
        assert part in line, line
    assert any(m.startswith("[req-43] done error=model_not_found") for m in done), done


async def test_queue_time_one_sample_per_finished_request(codec) -> None:
    eng = FakeEngine(codec, queue_time=0.125)   # the engine sends the queue time once, on the first output
    async with make_client(create_app(eng, codec, SERVED)) as c:
        t0 = (await c.get("/metrics")).text
        assert sample(t0, "ferrylm:request_queue_time_seconds_count") == 0
        for extra in ({}, {"stream": True, "max_tokens": 3}, {"max_tokens": 1}):
            assert (await c.post(CHAT, json={"model": SERVED, "messages": MSGS, **extra})).status_code == 200
        assert (await c.post(CHAT, json={"model": SERVED, "messages": MSGS, "top_p": 7})).status_code == 400
        t = (await c.get("/metrics")).text
    finished = sum(sample(t, "ferrylm:request_success_total", f'{{finished_reason="{r}"}}') for r in ("stop", "length"))
    assert finished == 3
    assert sample(t, "ferrylm:request_queue_time_seconds_count") == finished
    assert sample(t, "ferrylm:request_queue_time_seconds_sum") == pytest.approx(3 * 0.125)
    assert sample(t, "ferrylm:request_queue_time_seconds_bucket", '{le="0.3"}') == 3


class _InProcessEngine(FakeEngine):
    """The real :class:`Engine` (fake model, CPU) behind the engine-client interface, every output through the
    IPC codec (msgpack) as between the two processes."""

    def __init__(self, codec, core):
        super().__init__(codec, max_model_len=core.limits.max_model_len)
        self.core = core
        self.queues: dict[str, asyncio.Queue] = {}
        self.seen: list = []
        self._driver: asyncio.Task | None = None

    async def _drive(self) -> None:
        from ferrylm.engine import ipc

        while self.core.has_work():
            for o in ipc.decode(ipc.encode(ipc.Outputs(self.core.step()))).outputs:
                self.seen.append(o)
                self.queues[o.request_id].put_nowait(o)
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    async def generate(self, request_id, prompt_token_ids, params):
        from ferrylm.engine.sampling_params import SamplingParams

        q = self.queues[request_id] = asyncio.Queue()
        self.core.add_request(request_id, list(prompt_token_ids), SamplingParams.from_dict(params.to_dict()))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        while True:
            out = await q.get()
            yield out
            if out.finished:
                return


async def test_queue_time_is_measured_by_the_engine(codec) -> None:
    """A request queued behind a long one (one running request, 2-token prefill budget) reports a positive queue
    time; each engine request sends exactly one. Fails if the engine never sets the field."""
    import torch

    from ferrylm.config import EngineConfig
    from ferrylm.engine.boot import engine_for_model
    from ferrylm.engine.engine import Engine
    from tests.engine.fake_model import FakeModel, fake_config

    cfg = fake_config(vocab=codec.vocab_size, max_len=256, eos=codec.eos_token_ids[0])
    ec = EngineConfig(device="cpu", page_size=4, num_pages=64, max_running_requests=1, max_prefill_length=2,
                      check_invariants=True)
    core = engine_for_model(FakeModel(cfg), cfg, ec, device=torch.device("cpu"), dtype=torch.float32)
    eng = _InProcessEngine(codec, core)
    body = {"model": SERVED, "messages": MSGS, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    async with make_client(create_app(eng, codec, SERVED)) as c:
        rs = await asyncio.gather(*(c.post(CHAT, json=body) for _ in range(2)))
        assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
        t = (await c.get("/metrics")).text
    sent = {}
    for o in eng.seen:
        if o.queue_time is not None:
            assert o.request_id not in sent, "queue time sent twice"
            sent[o.request_id] = o.queue_time
    assert len(sent) == 2, sent
    first, second = sorted(sent.values())
    assert second > 0   # waited for the whole first request (prefill in 2-token chunks + 4 tokens)
    assert sample(t, "ferrylm:request_queue_time_seconds_count") == 2
    assert sample(t, "ferrylm:request_queue_time_seconds_sum") == pytest.approx(first + second)


async def test_every_sample_carries_model_name(codec) -> None:
    """vLLM labels each metric with model_name (dashboards filter on it): every sample line of /metrics has it."""
    async with make_client(create_app(engine_with_stats(codec), codec, "my-served-name")) as c:
        await c.post(CHAT, json={"model": "my-served-name", "messages": MSGS, "max_tokens": 2})
        text = (await c.get("/metrics")).text
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) > 50
    assert all('model_name="my-served-name"' in ln for ln in lines), [ln for ln in lines if "model_name" not in ln]
