"""Faults against live ``ferry serve`` processes (issue 6): what clients see and how fast the server comes back.

Three servers (small dense built-in model, small KV pool), started together once for the module:

- ``s1`` (``--watchdog-timeout 5 --shutdown-timeout 10``, stall fault armed, ``step_delay`` for prompts of at
  least 320 tokens): a step longer than the watchdog that makes progress, kill -9 of the engine mid-stream,
  SIGSTOP of the engine, a hung engine step, then SIGTERM during streams (it ends the server);
- ``s2`` (``--max-engine-restarts 0``): the two-servers check, then its engine is killed → exit non-zero;
- ``s3``: SIGKILL of the frontend → the engine must go too, and its IPC dir with it.

Tests that end a server (SIGTERM, the restart limit, SIGKILL) may run in any order: a server that has exited is
started again by the next test that needs it.

Every measured time is printed as ``[measured] ...`` (run with ``-s`` to see them; docs/ROBUSTNESS.md has them).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from ferrylm.server.process.launch import bind_socket
from tests.e2e.conftest import LiveServer, free_port, stop_server

pytestmark = pytest.mark.slow

MODEL_ARGS = ("--model", "smollm2-135m", "--num-tokens", "4096", "--max-running-requests", "8")
MSGS = [{"role": "user", "content": "Tell me a long story about a ferry."}]
WATCHDOG_S = 5
SHUTDOWN_S = 10
STARTUP_S = 240
SLOW_PROMPT = 320        # s1's step_delay fires for steps holding a prompt of at least this many tokens
SLOW_LAYER_MS = 250      # 30 layers: ~7.5 s a step, longer than WATCHDOG_S


def measured(what: str, seconds: float) -> None:
    print(f"[measured] {what}: {seconds:.2f} s")


# --- servers ----------------------------------------------------------------------------------------------------
def launch(tmp_path: Path, *args: str, env: dict | None = None) -> LiveServer:
    port = free_port()
    log_path = str(tmp_path / f"serve-{port}.log")
    cmd = [sys.executable, "-m", "ferrylm.cli", "serve", "--port", str(port), *MODEL_ARGS, *args]
    # NOTE: one compute thread per engine: three engines on a 2-core CI machine with torch's default thread
    # pools oversubscribe the cores so badly that single steps take seconds, which a 5 s watchdog would call a stall.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    return LiveServer(proc, port, log_path)


def wait_ready(srv: LiveServer, timeout: float = STARTUP_S) -> float:
    """Poll /health until 200; return the seconds it took. Fails with the log when the server exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if srv.proc.poll() is not None:
            pytest.fail(f"server exited with {srv.proc.returncode}:\n{srv.log()[-3000:]}")
        try:
            code = httpx.get(f"{srv.base_url}/health", timeout=2).status_code
            srv.health_codes.append(code)
            if code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"server not ready within {timeout} s:\n{srv.log()[-3000:]}")


def shutdown(srv: LiveServer) -> None:
    stop_server(srv, timeout=20)
    try:
        os.killpg(srv.proc.pid, signal.SIGKILL)  # whatever is left of its process group (nothing, normally)
    except (ProcessLookupError, PermissionError):
        pass


class Servers:
    """The module's servers by name, started together; one that has exited (a test ended it) is started again
    when a test asks for it, so the tests pass in any order."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.stall_file = str(tmp / "stall-now")
        self.args = {
            "s1": (("--watchdog-timeout", str(WATCHDOG_S), "--shutdown-timeout", str(SHUTDOWN_S)),
                   {"FERRYLM_FAULT_STALL_FILE": self.stall_file,
                    "FERRYLM_FAULTS": f"step_delay:ms={SLOW_LAYER_MS}:min_prompt={SLOW_PROMPT}"}),
            "s2": (("--max-engine-restarts", "0"), {}),
            "s3": ((), {}),
        }
        self.live: dict[str, LiveServer] = {}

    def start_all(self) -> None:
        for name, (args, env) in self.args.items():
            self.live[name] = launch(self.tmp, *args, env=env)
        with ThreadPoolExecutor(len(self.live)) as ex:
            for t in ex.map(wait_ready, self.live.values()):
                measured(f"start to ready ({len(self.live)} servers at once)", t)

    def get(self, name: str) -> LiveServer:
        srv = self.live.get(name)
        if srv is None or srv.proc.poll() is not None:
            args, env = self.args[name]
            srv = self.live[name] = launch(self.tmp, *args, env=env)
            wait_ready(srv)
        return srv

    def __getitem__(self, key: str) -> str:   # servers["stall_file"]
        return getattr(self, key)

    def close(self) -> None:
        for s in self.live.values():
            shutdown(s)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    srvs = Servers(tmp_path_factory.mktemp("supervision"))
    try:
        srvs.start_all()
        yield srvs
    finally:
        srvs.close()


@pytest.fixture
def s1(servers):
    return servers.get("s1")


@pytest.fixture
def s2(servers):
    return servers.get("s2")


@pytest.fixture
def s3(servers):
    return servers.get("s3")


# --- clients ----------------------------------------------------------------------------------------------------
def health(srv: LiveServer) -> tuple[int, dict]:
    r = httpx.get(f"{srv.base_url}/health", timeout=5)
    return r.status_code, r.json()


def engine_pid(srv: LiveServer) -> int:
    code, body = health(srv)
    assert code == 200, body
    return int(body["engine_pid"])


def chat(srv: LiveServer, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"messages": MSGS, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=120)


class Stream(threading.Thread):
    """One SSE chat stream read in a thread; ``events`` holds (monotonic time, payload) of every data event."""

    def __init__(self, srv: LiveServer, max_tokens: int = 2000):
        super().__init__(daemon=True)
        self.srv, self.max_tokens = srv, max_tokens
        self.events: list[tuple[float, str]] = []
        self.status: int | None = None
        self.exc: BaseException | None = None

    def run(self) -> None:
        body = {"messages": MSGS, "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True}
        try:
            with httpx.stream("POST", f"{self.srv.base_url}/v1/chat/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[len("data: "):]))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.exc = e

    @property
    def num_chunks(self) -> int:
        return sum(1 for _, p in self.events if p != "[DONE]")

    def error(self) -> tuple[float, dict] | None:
        for t, p in self.events:
            if p != "[DONE]" and "error" in json.loads(p):
                return t, json.loads(p)["error"]
        return None

    def finish_reason(self) -> str | None:
        for _, p in self.events:
            if p != "[DONE]":
                for ch in json.loads(p).get("choices", ()):
                    if ch.get("finish_reason"):
                        return ch["finish_reason"]
        return None

    def check_ended(self) -> None:
        assert self.exc is None, self.exc
        assert self.status == 200 and self.events and self.events[-1][1] == "[DONE]", self.events[-3:]


class Post(threading.Thread):
    """One non-stream chat request in a thread; records when and how it was answered."""

    def __init__(self, srv: LiveServer, max_tokens: int = 2000):
        super().__init__(daemon=True)
        self.srv, self.max_tokens = srv, max_tokens
        self.resp: httpx.Response | None = None
        self.t_end = 0.0

    def run(self) -> None:
        self.resp = chat(self.srv, self.max_tokens, ignore_eos=True)
        self.t_end = time.monotonic()


def wait_until(cond, timeout: float, what: str, *clients: threading.Thread) -> None:
    """Poll ``cond``; fail after ``timeout`` s, or at once when one of ``clients`` ended early."""
    deadline = time.monotonic() + timeout
    while not cond():
        for c in clients:
            if not c.is_alive():
                info = c.events[-3:] if isinstance(c, Stream) else getattr(c.resp, "text", None)
                pytest.fail(f"a client ended while waiting for {what}: status {getattr(c, 'status', None) or c.resp}"
                            f" {info}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def start_load(srv: LiveServer, n_posts: int) -> tuple[Stream, list[Post]]:
    """A long stream plus ``n_posts`` long non-stream requests, all running in the engine when this returns."""
    stream = Stream(srv)
    posts = [Post(srv) for _ in range(n_posts)]
    stream.start()
    for p in posts:
        p.start()
    wait_until(lambda: stream.num_chunks >= 3 and health(srv)[1].get("in_flight") == 1 + n_posts, 90,
               "the stream to produce tokens with every request in flight", stream, *posts)
    return stream, posts


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_answered(stream: Stream, posts: list[Post], t_fault: float, code: str, within: float) -> float:
    """The stream ended with an error event ``code`` then [DONE]; every post got 503 ``code``; all within
    ``within`` s of the fault. Returns the slowest answer time."""
    stream.join(within + 10)
    for p in posts:
        p.join(within + 10)
    stream.check_ended()
    err = stream.error()
    assert err is not None, stream.events[-3:]
    t_err, body = err
    assert body["code"] == code, body
    times = [t_err - t_fault]
    for p in posts:
        assert p.resp is not None and p.resp.status_code == 503, p.resp and p.resp.text
        assert p.resp.json()["error"]["code"] == code and p.resp.headers["retry-after"] == "5"
        times.append(p.t_end - t_fault)
    assert max(times) < within, times
    return max(times)


# --- tests ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(STARTUP_S + 60)
def test_two_servers_do_not_interfere(s1, s2):
    p1, p2 = engine_pid(s1), engine_pid(s2)
    assert p1 != p2
    for srv, pid in ((s1, p1), (s2, p2)):
        proc = psutil.Process(pid)
        assert "ferrylm-engine" in " ".join(proc.cmdline()), proc.cmdline()  # operators can find it
        assert proc.ppid() == srv.proc.pid
        assert all(c.laddr.port != srv.port for c in proc.net_connections())  # never holds the HTTP port
        assert len(glob.glob(os.path.join(tempfile.gettempdir(), f"ferrylm-{srv.proc.pid}-*"))) == 1
    with ThreadPoolExecutor(4) as ex:
        resps = list(ex.map(lambda s: chat(s, 8), (s1, s2, s1, s2)))
    assert [r.status_code for r in resps] == [200] * 4
    texts = {r.json()["choices"][0]["message"]["content"] for r in resps}
    assert len(texts) == 1  # same model, greedy, same prompt: no cross-talk between the two servers


@pytest.mark.timeout(180)
def test_a_step_longer_than_the_watchdog_is_not_a_stall(s1):
    """Issue 18: one valid prompt whose prefill step took longer than --watchdog-timeout got 503 engine_stalled
    (and its resends took the server down). The engine now ticks per layer; the watchdog sees the progress."""
    old = engine_pid(s1)
    log_start = len(s1.log())
    prompt = [100 + i for i in range(SLOW_PROMPT + 10)]   # token ids: every step of it is slowed down
    t0 = time.monotonic()
    r = httpx.post(f"{s1.base_url}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    took = time.monotonic() - t0
    measured(f"a {took:.1f} s step with --watchdog-timeout {WATCHDOG_S}: answered", took)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert took > WATCHDOG_S + 1                      # the step really outlasted the watchdog
    assert engine_pid(s1) == old
    assert "is stalled" not in s1.log()[log_start:]


@pytest.mark.timeout(180)
def test_kill9_engine_mid_stream(s1, s2):
    old = engine_pid(s1)
    other = engine_pid(s2)
    s2_codes: list[int] = []
    stop = threading.Event()

    def watch_s2() -> None:
        while not stop.is_set():
            s2_codes.append(health(s2)[0])
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_s2, daemon=True)
    watcher.start()
    stream, posts = start_load(s1, 3)
    t_kill = time.monotonic()
    os.kill(old, signal.SIGKILL)
    answered = assert_answered(stream, posts, t_kill, "engine_unavailable", within=2.0)
    measured("kill -9 engine: in-flight requests answered", answered)
    # while it restarts: /health 503 with a reason, new requests 503 + Retry-After, the probe 503
    code, body = health(s1)
    assert code == 503 and body["status"] in ("restarting", "loading") and body["detail"], body
    r = chat(s1)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable" and "retry-after" in r.headers
    assert httpx.get(f"{s1.base_url}/health/generate", timeout=10).status_code == 503
    # s2 serves on, untouched, while s1 restarts
    assert chat(s2).status_code == 200
    back = wait_ready(s1, 120)
    measured("kill -9 engine: back to ready", time.monotonic() - t_kill)
    assert back > 0 and engine_pid(s1) != old and gone(old)
    r = chat(s1)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    probe = httpx.get(f"{s1.base_url}/health/generate", timeout=30)
    assert probe.status_code == 200 and probe.json()["status"] == "ok", probe.text
    stop.set()
    watcher.join()
    assert s2_codes and set(s2_codes) == {200} and engine_pid(s2) == other


@pytest.mark.timeout(180)
def test_sigstop_engine_is_restarted_by_the_watchdog(s1):
    old = engine_pid(s1)
    stream, posts = start_load(s1, 1)
    t_stop = time.monotonic()
    os.kill(old, signal.SIGSTOP)
    try:
        answered = assert_answered(stream, posts, t_stop, "engine_stalled", within=WATCHDOG_S + 2.5)
    finally:
        if not gone(old):
            try:
                os.kill(old, signal.SIGKILL)  # only if the watchdog failed to
            except ProcessLookupError:
                pass
    measured(f"SIGSTOP engine (--watchdog-timeout {WATCHDOG_S}): in-flight requests answered", answered)
    wait_ready(s1, 120)
    measured("SIGSTOP engine: back to ready", time.monotonic() - t_stop)
    assert engine_pid(s1) != old and gone(old)
    assert chat(s1).status_code == 200
    log = s1.log()
    assert "is stalled" in log and "cannot dump the stalled engine's Python stacks" in log


@pytest.mark.timeout(180)
def test_hung_step_stacks_are_dumped_and_engine_restarted(s1, servers):
    old = engine_pid(s1)
    stream, posts = start_load(s1, 1)
    t_hang = time.monotonic()
    Path(servers["stall_file"]).touch()  # the engine loop hangs before its next step; heartbeats go on
    answered = assert_answered(stream, posts, t_hang, "engine_stalled", within=WATCHDOG_S + 2.5)
    measured(f"hung engine step (--watchdog-timeout {WATCHDOG_S}): in-flight requests answered", answered)
    wait_ready(s1, 120)
    measured("hung engine step: back to ready", time.monotonic() - t_hang)
    assert engine_pid(s1) != old and gone(old)
    assert chat(s1).status_code == 200
    log = s1.log()
    assert "no progress" in log and "between steps" in log
    assert "in _fault_stall" in log and "Thread 0x" in log  # faulthandler's dump of every thread


@pytest.mark.timeout(120)
def test_restart_limit_exits_nonzero(s2):
    children = psutil.Process(s2.proc.pid).children(recursive=True)
    assert children
    t0 = time.monotonic()
    os.kill(engine_pid(s2), signal.SIGKILL)
    rc = s2.proc.wait(60)
    measured("restart limit reached (--max-engine-restarts 0): server exited", time.monotonic() - t0)
    assert rc == 1, s2.log()[-2000:]
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive or all(gone(p.pid) for p in alive), alive
    assert "dead for good" in s2.log()


@pytest.mark.timeout(60)
def test_sigkill_frontend_takes_the_engine_down(s3):
    pid = engine_pid(s3)
    t0 = time.monotonic()
    ipc_dirs = glob.glob(os.path.join(tempfile.gettempdir(), f"ferrylm-{s3.proc.pid}-*"))
    assert len(ipc_dirs) == 1
    os.kill(s3.proc.pid, signal.SIGKILL)
    s3.proc.wait(10)
    wait_until(lambda: gone(pid), 5, "the orphaned engine to exit")
    measured("SIGKILL frontend: engine gone", time.monotonic() - t0)
    wait_until(lambda: not os.path.exists(ipc_dirs[0]), 5, "the IPC dir to be removed")
    measured("SIGKILL frontend: IPC dir removed", time.monotonic() - t0)


@pytest.mark.timeout(120)
def test_sigterm_drains_then_exits_zero(s1):
    children = psutil.Process(s1.proc.pid).children(recursive=True)
    short, long_ = Stream(s1, max_tokens=24), Stream(s1, max_tokens=2000)
    short.start()
    long_.start()
    wait_until(lambda: short.num_chunks >= 2 and long_.num_chunks >= 2, 90, "both streams to start", short, long_)
    t_term = time.monotonic()
    s1.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)   # a process group's signal relayed again by its parent (make, timeout): taken as one
    s1.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: health(s1)[0] == 503, 5, "/health to go 503")
    code, body = health(s1)
    assert body["status"] == "draining", body
    r = chat(s1)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    short.join(SHUTDOWN_S + 10)
    short.check_ended()
    assert short.error() is None and short.finish_reason() == "length"  # the running request completed
    long_.join(SHUTDOWN_S + 15)
    long_.check_ended()
    err = long_.error()
    assert err is not None and err[1]["code"] == "engine_unavailable" and "shutting down" in err[1]["message"]
    measured(f"SIGTERM: unfinished stream answered (--shutdown-timeout {SHUTDOWN_S})", err[0] - t_term)
    rc = s1.proc.wait(30)
    measured("SIGTERM: server exited", time.monotonic() - t_term)
    assert rc == 0, s1.log()[-2000:]
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive or all(gone(p.pid) for p in alive), alive
    sock = bind_socket("127.0.0.1", s1.port)  # the port is free at once (as a restarted server binds it)
    sock.close()
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"ferrylm-{s1.proc.pid}-*"))


@pytest.mark.timeout(60)
def test_port_in_use_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "ferrylm.cli", "serve", "--port", str(port), *MODEL_ARGS],
                             capture_output=True, text=True, timeout=50)
    measured("port in use: exit 2", time.monotonic() - t0)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "--port" in lines[0], res.stderr
    assert "engine" not in res.stdout + res.stderr  # nothing was loaded
