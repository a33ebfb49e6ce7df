"""The soak, run by hand (not collected by pytest): ``ferry serve`` on 127.0.0.1 under the chaos suite's client mix
(streams, non-stream chat and completions, disconnects mid-prefill and mid-stream, fuzzed bad inputs) for a fixed
time, with a short idle pause every few minutes; every ``--sample-s`` it records the frontend's and the engine's
RSS and open file descriptors, the KV pages in use and the requests in flight. At the end it prints a summary
(first vs last samples, drift, KV pages at each idle pause) and writes every sample as JSON.

    PYTHONPATH=src python -m tests.chaos.soak --seconds 1800 --out /tmp/soak.json

Bounded: it stops after ``--seconds`` (plus the last requests' deadline) and always stops its server; it only
talks to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from tests.chaos.test_chaos import CLIENTS, DEADLINE_S, Load, Server
from tests.e2e.conftest import free_port


def start(tmp: Path, model: str) -> Server:
    port = free_port()
    log = tmp / "soak-serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ferrylm.cli", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--num-tokens", "8192", "--max-running-requests", "8", "--max-model-len", "2048"]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(proc, port, log, tmp / "unused")
    srv.wait_ready(300)
    return srv


def sample(srv: Server, t0: float) -> dict:
    code, h = srv.health()
    front = psutil.Process(srv.proc.pid)
    row = {"t_s": round(time.monotonic() - t0, 1), "health": code, "in_flight": h.get("in_flight"),
           "kv_pages_used": (h.get("engine") or {}).get("kv_pages_used"),
           "frontend_rss_mib": round(front.memory_info().rss / 2**20, 1), "frontend_fds": front.num_fds()}
    try:
        eng = psutil.Process(int(h["engine_pid"]))
        row.update(engine_rss_mib=round(eng.memory_info().rss / 2**20, 1), engine_fds=eng.num_fds())
    except (KeyError, TypeError, psutil.Error):
        pass
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1800)
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--pause-every-s", type=float, default=300, help="an idle pause every this many seconds")
    ap.add_argument("--pause-s", type=float, default=20)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ferrylm-soak-"))
    srv = start(tmp, a.model)
    t0 = time.monotonic()
    rows: list[dict] = []
    idle: list[dict] = []
    calls = 0
    try:
        end = t0 + a.seconds
        while time.monotonic() < end:
            load = Load(srv, seed=int(time.monotonic()))
            threads = [threading.Thread(target=load.run_client, args=(i,), daemon=True) for i in range(CLIENTS)]
            for t in threads:
                t.start()
            until = min(end, time.monotonic() + a.pause_every_s)
            while time.monotonic() < until:
                rows.append(sample(srv, t0))
                time.sleep(a.sample_s)
            load.stop.set()
            for t in threads:
                t.join(DEADLINE_S + 10)
            calls += len(load.calls)
            bad = [c.outcome for c in load.calls if c.outcome.startswith("bad") or c.outcome == "none"]
            if bad:
                print(f"[soak] wrong or missing answers: {bad[:10]}", flush=True)
            pause_end = time.monotonic() + a.pause_s
            while time.monotonic() < pause_end:
                time.sleep(1)
            r = sample(srv, t0)
            r["idle"] = True
            r["calls_so_far"] = calls
            r["wrong_or_missing"] = len(bad)
            rows.append(r)
            idle.append(r)
            print(f"[soak] idle at {r['t_s']:.0f} s: {r}", flush=True)
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            rc = srv.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(srv.proc.pid, signal.SIGKILL)
            rc = None
    busy = [r for r in rows if not r.get("idle") and r.get("frontend_rss_mib")]

    def span(key: str, rs: list[dict]) -> str:
        vals = [r[key] for r in rs if r.get(key) is not None]
        if not vals:
            return "-"
        return f"first {vals[0]}, last {vals[-1]}, min {min(vals)}, max {max(vals)}, median {statistics.median(vals)}"

    summary = {"seconds": round(time.monotonic() - t0), "requests": calls, "server exit code": rc,
               "idle KV pages": [r["kv_pages_used"] for r in idle],
               "wrong or missing answers": sum(r["wrong_or_missing"] for r in idle)}
    for key in ("frontend_rss_mib", "engine_rss_mib", "frontend_fds", "engine_fds"):
        summary[f"{key} (idle samples)"] = span(key, idle)
        summary[f"{key} (all samples)"] = span(key, busy)
    for k, v in summary.items():
        print(f"[soak] {k}: {v}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "samples": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
