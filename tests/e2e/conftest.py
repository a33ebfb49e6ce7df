"""Live-server fixtures: ``ferry serve`` as a subprocess on a free port, and the real ``openai`` client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    port: int
    log_path: str
    health_codes: list[int] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def start_server(tmp_path, *args: str, timeout: float = 240.0) -> LiveServer:
    """Start ``ferry serve`` and wait for /health 200 (recording every status seen). Fails with the log."""
    port = free_port()
    log_path = str(tmp_path / f"serve-{port}.log")
    cmd = [sys.executable, "-m", "ferrylm.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    srv = LiveServer(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{srv.log()[-3000:]}")
        try:
            code = httpx.get(f"{srv.base_url}/health", timeout=2).status_code
            srv.health_codes.append(code)
            if code == 200:
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(srv)
    pytest.fail(f"server not ready within {timeout} s:\n{srv.log()[-3000:]}")


def stop_server(srv: LiveServer, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    if srv.proc.poll() is None:
        srv.proc.send_signal(sig)
        try:
            srv.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait()
    return srv.proc.returncode


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """One server with the default built-in model (smollm2-moe) for the whole session."""
    srv = start_server(tmp_path_factory.mktemp("serve"))
    yield srv
    stop_server(srv)
