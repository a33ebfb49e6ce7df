"""A terminal's Ctrl-C reaches the whole process group: the engine must ignore it and let the frontend drain."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_sigint_to_process_group_drains_in_flight_request(tmp_path):
    srv = start_server(tmp_path, "--model", "smollm2-135m", "--num-tokens", "2048", "--shutdown-timeout", "60")
    result: dict = {}

    def request():
        r = httpx.post(f"{srv.base_url}/v1/completions", timeout=120,
                       json={"prompt": "Count:", "max_tokens": 24, "ignore_eos": True, "temperature": 0})
        result["status"] = r.status_code
        result["body"] = r.json()

    t = threading.Thread(target=request)
    t.start()
    time.sleep(1.0)  # the request is running
    os.killpg(srv.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does (start_new_session: pgid == pid)
    t.join(120)
    assert srv.proc.wait(90) == 0
    assert result.get("status") == 200, result
    assert result["body"]["usage"]["completion_tokens"] == 24
    assert "Traceback" not in srv.log()
