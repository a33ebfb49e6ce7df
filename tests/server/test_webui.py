"""The web page's server side: ``/`` and its static files, ``GET /v1/live`` (rates sampled from the metrics registry
and the engine's heartbeat stats, the ``/v1/memory`` body as it is), ``?since=``, and ``--no-webui``."""

from __future__ import annotations

import re
import time

import pytest
from starlette.testclient import TestClient

from ferrylm.cli import build_parser
from ferrylm.server.api.app import create_app
from ferrylm.server.process.engine_client import HealthState
from ferrylm.server.webui import STATIC_DIR
from ferrylm.server.webui.live import LiveView

from .conftest import SERVED, FakeEngine, assert_error, make_client

pytestmark = pytest.mark.anyio

MEMORY = {"engine_pid": 42, "state": "ready", "plan": {"kind": "cuda", "kv_pages": 8, "reserve_bytes": 5},
          "live": {"expert_slots": 3}, "oom_recoveries": {}, "kv_pages_used": 2, "kv_pages_total": 8}


class StatsEngine(FakeEngine):
    """A fake engine with heartbeat stats (read by /metrics as ``last_stats``, by /health as ``extra["engine"]``)
    and a memory plan."""

    def __init__(self, codec):
        super().__init__(codec)
        self.last_stats: dict = {"num_running": 1, "num_waiting": 2, "kv_pages_used": 2, "kv_pages_total": 8,
                                 "oom_recoveries": {}, "experts": self.experts(0, 0, [0, 0], [0, 0], 0)}
        self.engine_pid = 42
        self.memory = lambda: MEMORY

    @staticmethod
    def experts(copied: int, mapped: int, hits: list[int], misses: list[int], cpu: int) -> dict:
        return {"backend": "offload", "num_slots": 3, "expert_bytes": 1000, "hits": sum(hits), "misses": sum(misses),
                "hit_rate": 0.5, "layers": [0, 1], "layer_hits": hits, "layer_misses": misses,
                "bytes_copied": copied, "bytes_mapped": mapped, "cpu_experts": cpu}

    def health(self) -> HealthState:
        return HealthState(self.health_status, "", {"engine": self.last_stats, "restarts": 0, "engine_pid": 42})


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def test_samples_are_rates_between_two_reads(codec) -> None:
    eng = StatsEngine(codec)
    app = create_app(eng, codec, SERVED)
    clock = Clock()
    view = LiveView(app.state.server, clock=clock, wall=lambda: 1.7e9)
    assert view.sample_now() is None          # the baseline
    async with make_client(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
    eng.last_stats = {**eng.last_stats, "num_running": 0, "num_waiting": 0, "kv_pages_used": 4,
                      "oom_recoveries": {"halve_chunk": 2},
                      "experts": eng.experts(6_000_000_000, 2_000_000_000, [3, 0], [1, 0], 1_000_000)}
    clock.t += 2.0
    s = view.sample_now()
    assert s is not None and s.seq == 1 and s.dt_s == 2.0 and s.state == "ready"
    assert s.gen_tok_s == 2.5                 # 5 tokens in 2 s
    assert s.ttft_s is not None and s.ttft_s >= 0
    assert (s.running, s.waiting, s.kv_used) == (0, 0, 0.5)
    assert s.pcie_gb_s == 4.0                 # (6 GB copied + 2 GB mapped) / 2 s
    assert s.host_dram_gb_s == 4.5            # + 1e6 CPU experts x 1000 bytes
    assert s.layer_hit_rate == [0.75, None]   # layer 1 had no lookup
    assert s.oom == {"halve_chunk": 2}
    clock.t += 1.0
    s2 = view.sample_now()
    assert (s2.gen_tok_s, s2.ttft_s, s2.pcie_gb_s, s2.oom, s2.layer_hit_rate) == (0.0, None, 0.0, {}, [None, None])


async def test_a_new_engine_counts_its_layers_from_zero(codec) -> None:
    eng = StatsEngine(codec)
    clock = Clock()
    view = LiveView(create_app(eng, codec, SERVED).state.server, clock=clock)
    eng.last_stats = {**eng.last_stats, "experts": eng.experts(0, 0, [50, 50], [50, 50], 0)}
    view.sample_now()
    eng.last_stats = {**eng.last_stats, "experts": eng.experts(0, 0, [1, 0], [3, 0], 0)}   # restarted: smaller
    clock.t += 1.0
    assert view.sample_now().layer_hit_rate == [0.25, None]


async def test_live_route_answers_memory_as_is_and_samples_after_since(codec) -> None:
    eng = StatsEngine(codec)
    app = create_app(eng, codec, SERVED)
    view = app.state.live_view
    for _ in range(4):
        view.sample_now()
    async with make_client(app) as c:
        body = (await c.get("/v1/live")).json()
        assert body["memory"] == MEMORY
        assert body["state"] == {"status": "ready", "detail": "", "restarts": 0, "engine_pid": 42}
        assert body["model"] == {"name": SERVED, "max_model_len": 256}
        assert body["experts"]["layers"] == [0, 1] and body["experts"]["backend"] == "offload"
        assert [s["seq"] for s in body["samples"]] == [1, 2, 3] and body["last_seq"] == 3
        assert [s["seq"] for s in (await c.get("/v1/live?since=2")).json()["samples"]] == [3]
        for bad in ("x", "-1", "1.5"):
            assert_error(await c.get(f"/v1/live?since={bad}"), 400, param="since")


async def test_live_route_before_the_plan_and_while_loading(codec) -> None:
    eng = StatsEngine(codec)
    eng.memory = lambda: None
    eng.health_status = "loading"
    async with make_client(create_app(eng, codec, SERVED)) as c:
        body = (await c.get("/v1/live")).json()
    assert body["memory"] is None and body["state"]["status"] == "loading"


async def test_page_and_its_files_are_served_and_reach_nothing_outside(client) -> None:
    r = await client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    local = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert "webui/main.js" in local and "webui/style.css" in local
    names = sorted(p.name for p in STATIC_DIR.iterdir())
    assert {"index.html", "main.js", "chat.js", "live.js", "markdown.js", "api.js", "store.js", "style.css"} <= set(names)
    for name in names:
        text = (STATIC_DIR / name).read_text()
        assert (await client.get(f"/webui/{name}")).status_code == 200, name
        for ref in re.findall(r'(?:src|href)="([^"]+)"', text) + re.findall(r'\bfrom\s+"([^"]+)"', text) + \
                re.findall(r'url\(([^)]+)\)', text):
            assert not re.match(r"^(https?:)?//", ref), (name, ref)   # nothing fetched from another host
        if name.endswith(".js"):
            assert all(m.startswith("./") for m in re.findall(r'\bfrom\s+"([^"]+)"', text)), name
    assert all(ref.startswith(("webui/", "data:")) for ref in local), local
    assert "/v1/live" in (await client.get("/openapi.json")).json()["paths"]


async def test_no_webui_serves_neither_page_nor_data(codec, engine) -> None:
    async with make_client(create_app(engine, codec, SERVED, webui=False)) as c:
        for path in ("/", "/v1/live", "/webui/main.js"):
            assert (await c.get(path)).status_code == 404, path


def test_sampler_runs_while_the_app_does(codec) -> None:
    app = create_app(StatsEngine(codec), codec, SERVED)
    with TestClient(app) as c:
        deadline = time.monotonic() + 10
        while not c.get("/v1/live").json()["samples"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.get("/v1/live").json()["samples"], "no sample within 10 s"


def test_webui_flag() -> None:
    p = build_parser()
    assert p.parse_args(["serve", "m"]).webui is True
    assert p.parse_args(["serve", "m", "--no-webui"]).webui is False
