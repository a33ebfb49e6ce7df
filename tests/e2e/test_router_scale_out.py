"""Replicas behind vllm-router (issue 27, docs/SCALE-OUT.md): two CPU replicas of the built-in smollm2-135m and
``vllm-router --policy cache_aware`` in front of them, loopback only, free ports, the real ``openai`` client
through the router. One test in three phases on one fleet (the last phase kills an engine, so the phases cannot
be separate tests that a random order could shuffle):

(a) distinct long prompts spread over both replicas;
(b) a repeated long prefix lands on the replica that holds it: its follow-ups report the prefix as cached
    (``usage.prompt_tokens_details.cached_tokens``) and only that replica's counters move;
(c) that replica's engine is SIGKILLed: the router stops sending to it (its /health is 503 while the supervisor
    restarts the engine), every request is still answered, by the other replica, and the router takes the
    replica back once its /health is 200 again.

Which replica served a request is read from each replica's own ``/metrics`` (``ferrylm:request_success_total``,
``ferrylm:prefix_cache_hits_total``); the router's prefix inputs are read from its Prometheus port
(``vllm_router_kv_routing_inputs_total``: it asks a worker's render routes for the prompt's token ids).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import LiveServer, free_port, start_server, stop_server

openai = pytest.importorskip("openai")
pytest.importorskip("vllm_router")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
REPLICA_ARGS = ("--model", MODEL, "--num-tokens", "4096", "--max-model-len", "2048")
# once SLOW_BOOTS exists, every engine boot waits 10 s first (fault point boot_delay): the victim of (c) stays down
# for at least that long, so the failover requests are served while it is (they take ~2 s; its restart alone took
# ~3 s on an idle host and sometimes beat them); the first boots run at speed
SLOW_BOOTS = "slow-boots"
BODY = "Read the repository carefully, answer in one short sentence, cite the file you used and never guess. "


def _router_binary() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    if not os.path.exists(path):
        pytest.skip("the vllm-router script is not installed beside this Python (pip install -e '.[dev]')")
    return path


def _system(tag: str) -> str:
    """A long system prompt (~300 tokens) whose first word differs per tag, so two tags share only the template's
    first tokens (far below the router's --cache-threshold)."""
    return f"{tag}. " + BODY * 12


def _samples(text: str, name: str) -> list[tuple[str, float]]:
    """Every sample of ``name`` in a Prometheus text page: ``(labels, value)``."""
    return [(m.group(1) or "", float(m.group(2)))
            for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M)]


HEARTBEAT_LAG_S = 1.2   # the engine's figures (prefix-cache hits) reach /metrics with its heartbeat (every 0.5 s)


def _counts(srv: LiveServer) -> tuple[float, float]:
    """A replica's (finished requests, prefix-cache hit tokens) so far. The request count is the frontend's own
    (current); the hits come from the engine's last heartbeat: read them ``HEARTBEAT_LAG_S`` after the last
    request."""
    text = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    return (sum(v for _, v in _samples(text, "ferrylm:request_success_total")),
            sum(v for _, v in _samples(text, "ferrylm:prefix_cache_hits_total")))


class Router:
    """``vllm-router`` as a subprocess: cache-aware policy; a worker's circuit opens after two failed attempts (a
    503 from a restarting engine counts), so the router's retries of that request go to another worker at once;
    a health check every second drops a worker after one failure and takes it back after one success (the
    defaults, 60 s and 3 failures, keep a dead engine in the rotation for minutes)."""

    def __init__(self, tmp_path, workers: list[LiveServer]):
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = tmp_path / "router.log"
        self.workers = [w.base_url for w in workers]
        cmd = [_router_binary(), "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *self.workers,
               "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port",
               str(self.metrics_port), "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--health-success-threshold", "1", "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "2",
               "--worker-startup-timeout-secs", "30",
               "--worker-startup-check-interval", "1", "--log-level", "debug"]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm-router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"vllm-router not ready within 30 s:\n{self.log()}")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        """The end of the router's log: its routing decisions (debug level) and health changes, without the
        per-request rate-limiter lines."""
        lines = [ln for ln in self.log_path.read_text().splitlines()
                 if "token_bucket" not in ln and "Acquired token" not in ln]
        return "\n".join(lines)[-4000:]

    def metric(self, name: str) -> list[tuple[str, float]]:
        return _samples(httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text, name)

    def healthy(self, worker: LiveServer) -> bool | None:
        """The router's view of ``worker`` (``vllm_router_worker_health``), None before it reports one."""
        for labels, v in self.metric("vllm_router_worker_health"):
            if f'worker="{worker.base_url}"' in labels:
                return v == 1.0
        return None

    def wait_health(self, worker: LiveServer, want: bool, timeout: float) -> float:
        """Seconds until the router reports ``worker`` healthy (``want``) or not; fails after ``timeout``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.healthy(worker) is want:
                return time.monotonic() - t0
            time.sleep(0.1)
        pytest.fail(f"the router did not mark {worker.base_url} {'healthy' if want else 'unhealthy'} within "
                    f"{timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale-out")
    with ThreadPoolExecutor(2) as pool:   # both replicas boot at once
        faults = ("--faults", f"boot_delay:ms=10000:file={tmp / SLOW_BOOTS}")
        futures = [pool.submit(start_server, tmp, *REPLICA_ARGS, *faults, timeout=120) for _ in range(2)]
        replicas = [f.result() for f in futures]
    router = None
    try:
        router = Router(tmp, replicas)
        yield router, replicas, tmp / SLOW_BOOTS
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            stop_server(r)


def _ask(client, system: str, question: str, max_tokens: int = 2):
    return client.chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}])


@pytest.mark.timeout(240)   # ~25 s on 2 idle cores, boot included; a loaded host stretches the boot
def test_router_spreads_keeps_prefixes_and_fails_over(fleet) -> None:
    router, replicas, slow_boots = fleet
    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    sent = 0

    # (a) distinct long prompts at once: none finds a useful prefix anywhere (match below --cache-threshold), so
    # each goes to the replica with the fewest requests in flight; both replicas serve
    before = [_counts(r) for r in replicas]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda k: _ask(client, _system(f"Spread {k}"), "What is in the README?",
                                               max_tokens=8), range(4)))
    sent += 4
    assert all(r.choices[0].message.content is not None and r.usage.prompt_tokens > 250 for r in replies)
    served = [_counts(r)[0] - b[0] for r, b in zip(replicas, before)]
    assert sum(served) == 4 and min(served) >= 1, served

    # (b) one long prefix, asked four times: the follow-ups land where it is cached
    hot_system = _system("Affinity")
    time.sleep(HEARTBEAT_LAG_S)
    before = [_counts(r) for r in replicas]
    first = _ask(client, hot_system, "Question 0: where are the tests?")
    sent += 1
    got = [_counts(r)[0] - b[0] for r, b in zip(replicas, before)]
    assert sorted(got) == [0, 1], got
    hot, cold = got.index(1), got.index(0)
    prompt_tokens = first.usage.prompt_tokens
    for q in range(1, 4):
        resp = _ask(client, hot_system, f"Question {q}: where are the tests?")
        sent += 1
        assert resp.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - 32, (q, resp.usage)
    time.sleep(HEARTBEAT_LAG_S)
    after = [_counts(r) for r in replicas]
    assert after[hot][0] - before[hot][0] == 4 and after[cold][0] == before[cold][0], (before, after)
    assert after[cold][1] == before[cold][1]             # the other replica found nothing cached
    assert after[hot][1] - before[hot][1] >= 3 * (prompt_tokens - 32)

    # (c) the hot replica's engine dies: its supervisor answers 503 and restarts it; the router drops the replica
    victim, other = replicas[hot], replicas[cold]
    engine_pid = httpx.get(f"{victim.base_url}/health", timeout=5).json()["engine_pid"]
    slow_boots.touch()
    os.kill(engine_pid, signal.SIGKILL)
    before_other = _counts(other)
    cached = []
    for q in range(4):   # right after the kill: the first meets the dead engine; the router retries it elsewhere
        resp = _ask(client, hot_system, f"Failover {q}: where are the tests?")
        sent += 1
        assert resp.choices[0].message.content is not None
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
    assert httpx.get(f"{victim.base_url}/health", timeout=5).status_code == 503, \
        "the victim's engine came back before the failover requests ended: this phase cannot tell who served"
    assert router.healthy(victim) is False, router.log()
    assert _counts(other)[0] - before_other[0] == 4, "the requests after the kill were not all served by the other"
    assert cached[0] < 32 and cached[-1] >= prompt_tokens - 32, cached  # the prefix moved to the other replica
    # the replica comes back (its engine restarted, /health 200) and the router takes it back
    router.wait_health(victim, True, timeout=45)

    # the router prepared every request through the render routes (its other source, POST /tokenize, is the
    # fallback for workers without them): at least one render per request (0.1.17 renders on every worker)
    inputs = dict(router.metric("vllm_router_kv_routing_inputs_total"))
    render = sum(v for labels, v in inputs.items() if 'result="render"' in labels)
    other_results = {labels: v for labels, v in inputs.items() if 'result="render"' not in labels}
    assert render >= sent and not other_results, inputs
