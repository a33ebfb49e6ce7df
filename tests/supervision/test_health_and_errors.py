"""Supervision pieces that need no engine process: /health and /health/generate, the stall / unavailable error
codes on both response shapes, the supervisor's health states, stale IPC dir sweeping. Fast (fake engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import EngineStalled, EngineUnavailable
from ferrylm.server.api.app import create_app
from ferrylm.server.process.engine_client import HealthState, ModelInfo
from ferrylm.server.api.errors import status_for
from ferrylm.server.process.ipc_dir import sweep_stale_ipc_dirs
from ferrylm.server.process.processes import describe_exit
from ferrylm.server.process.supervisor import Supervisor
from tests.server.conftest import SERVED, FakeEngine, assert_error, endless, make_client, parse_sse

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


class ExtraHealthEngine(FakeEngine):
    def health(self) -> HealthState:
        return HealthState(self.health_status, "", {"engine_pid": 4242, "restarts": 1})


@pytest.mark.parametrize("exc", [EngineStalled("the engine stalled"), EngineUnavailable("the engine died")])
async def test_engine_death_codes_in_both_shapes(codec, exc) -> None:
    # mid-stream: an error event with the code, then [DONE]
    eng = FakeEngine(codec, fail_at=3, fail_exc=exc)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await c.post(CHAT, json={"model": SERVED, "messages": MSGS, "stream": True})
        assert r.status_code == 200
        events = parse_sse(r.text)
        assert events[-2]["error"]["code"] == exc.code and events[-2]["error"]["type"] == "service_unavailable_error"
        # non-stream: 503 with the code and Retry-After
        r = await c.post(CHAT, json={"model": SERVED, "messages": MSGS})
        assert_error(r, 503, code=exc.code)
        assert r.headers["retry-after"] == "5"
    assert status_for(EngineStalled("x")) == 503 and EngineStalled.code == "engine_stalled"


async def test_health_carries_engine_facts(codec) -> None:
    async with make_client(create_app(ExtraHealthEngine(codec), codec, SERVED)) as c:
        assert (await c.get("/health")).json() == {"status": "ready", "engine_pid": 4242, "restarts": 1}
    async with make_client(create_app(ExtraHealthEngine(codec, health_status="stalled"), codec, SERVED)) as c:
        r = await c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "stalled" and r.json()["engine_pid"] == 4242
        assert r.headers["retry-after"] == "5"


async def test_health_generate(codec) -> None:
    eng = FakeEngine(codec)
    async with make_client(create_app(eng, codec, SERVED)) as c:
        r = await c.get("/health/generate")
        assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["tokens"] == 1
    _, _, params = eng.requests[0]
    assert params.max_tokens == 1 and params.temperature == 0.0
    async with make_client(create_app(FakeEngine(codec, health_status="restarting"), codec, SERVED)) as c:
        r = await c.get("/health/generate")
        assert r.status_code == 503 and r.json()["status"] == "restarting"
    slow = FakeEngine(codec, script=endless(codec), delay=30.0)
    async with make_client(create_app(slow, codec, SERVED)) as c:
        r = await c.get("/health/generate?timeout=0.2")
        assert r.status_code == 503 and r.json()["status"] == "timeout"
    assert slow.closed_early  # the probe left the engine request (the supervisor aborts it then)
    failing = FakeEngine(codec, start_exc=EngineStalled("stuck"))
    async with make_client(create_app(failing, codec, SERVED)) as c:
        r = await c.get("/health/generate")
        assert r.status_code == 503 and r.json()["code"] == "engine_stalled"


async def test_supervisor_health_states(tmp_path) -> None:
    sup = Supervisor(str(tmp_path), {}, ModelInfo("m", str(tmp_path), 128), watchdog_timeout=5)
    try:
        assert sup.health().status == "loading"
        sup.state = "ready"
        sup._watch.last_heartbeat = time.monotonic()
        assert sup.health().ready
        sup._watch.last_heartbeat -= 6  # no heartbeat for 6 s (> 5 s)
        h = sup.health()
        assert h.status == "stalled" and "heartbeat" in h.detail and "engine_pid" in h.extra
        sup._watch.last_heartbeat += 6
        sup.last_stats = {"num_running": 2}
        assert sup.health().extra["engine"] == {"num_running": 2}
        sup.state = "restarting"   # the engine died: its last figures are not the new engine's
        assert sup.health().extra["engine"] == {}
        sup.state = "ready"
        sup.begin_drain()
        assert sup.health().status == "draining"
        with pytest.raises(EngineUnavailable, match="shutting down"):
            async for _ in sup.generate("r1", [1, 2], SamplingParams()):
                pass
        with pytest.raises(EngineUnavailable, match="shutting down"):
            sup.check_admission("r1", [1, 2], SamplingParams())
        assert await sup.drain(0.1) == 0
    finally:
        await sup.close()
    assert not os.path.exists(sup._dir)


def test_describe_exit() -> None:
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(1) == "exit code 1"
    assert describe_exit(None) == "exit code unknown"


def test_sweep_removes_only_dead_servers_ipc_dirs(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"ferrylm-{dead.pid}-abc123"
    stale.mkdir()
    (stale / "in-1").touch()
    (stale / "out-1").touch()
    foreign = tmp_path / f"ferrylm-{dead.pid}-other1"
    foreign.mkdir()
    (foreign / "notes.txt").touch()
    alive = tmp_path / f"ferrylm-{os.getpid()}-mine99"
    alive.mkdir()
    assert sweep_stale_ipc_dirs(str(tmp_path)) == 1
    assert not stale.exists() and foreign.exists() and alive.exists()


def test_the_ipc_dir_goes_when_its_server_is_sigkilled(tmp_path) -> None:
    """Issue 18: the IPC temp folder was left behind when the frontend was SIGKILLed (the kernel kills the engine
    at once, so it cannot clean up): the server's janitor removes it."""
    code = ("import sys, time; from ferrylm.server.process.ipc_dir import IpcDir; d = IpcDir(tmpdir=sys.argv[1]); "
            "print(d.path, d.janitor_pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    path, janitor = proc.stdout.readline().split()
    assert os.path.isdir(path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 5
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(path)
    while psutil.pid_exists(int(janitor)) and psutil.Process(int(janitor)).status() != psutil.STATUS_ZOMBIE \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not psutil.pid_exists(int(janitor)) or psutil.Process(int(janitor)).status() == psutil.STATUS_ZOMBIE


def test_a_clean_close_removes_the_dir_and_reaps_the_janitor(tmp_path) -> None:
    from ferrylm.server.process.ipc_dir import IpcDir

    d = IpcDir(tmpdir=str(tmp_path))
    pid = d.janitor_pid
    assert os.path.isdir(d.path) and pid is not None
    d.remove()
    assert not os.path.exists(d.path) and not psutil.pid_exists(pid)


async def test_boot_responder_answers_as_the_app_does_while_the_engine_loads(codec) -> None:
    """The port's 503 before uvicorn runs (server/process/boot_responder.py) has the app's own shape, status and
    Retry-After on the OpenAI and Anthropic routes and /health, for an engine still loading."""
    import json

    from ferrylm.server.process.boot_responder import starting_answer

    loading = EngineUnavailable("the engine is not ready (loading)")
    app = create_app(FakeEngine(codec, refuse_exc=loading, health_status="loading"), codec, SERVED)
    requests = [("GET", "/health", None), ("POST", CHAT, {"model": SERVED, "messages": MSGS}),
                ("POST", "/v1/messages", {"model": SERVED, "max_tokens": 8, "messages": MSGS})]
    async with make_client(app) as c:
        for method, path, body in requests:
            r = await c.request(method, path, json=body)
            head, _, raw = starting_answer(path, lambda: HealthState("loading", "fake says so")).partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines[1:])
            assert r.status_code == int(lines[0].split()[1]) == 503, path
            assert r.headers["retry-after"] == headers["Retry-After"], path
            want, got = r.json(), json.loads(raw)
            if "error" in want:
                assert got["error"]["type"] == want["error"]["type"], path
                assert got.get("type") == want.get("type") and got["error"].get("code") == want["error"].get("code")
            else:
                assert got == {k: want[k] for k in ("status", "detail")}
