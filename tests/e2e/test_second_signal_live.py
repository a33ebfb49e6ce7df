"""A second Ctrl-C while ``ferry serve`` drains (issue 43): the streams still open get their terminal event (chat
and completions an error event and ``[DONE]``, the Responses API and Anthropic Messages their ``error`` event)
before the process exits 130, within a few seconds; nothing is cut mid-stream. A live server (the built-in
smollm2-135m, every step slowed so the streams run long) and one stream per route."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

MSGS = [{"role": "user", "content": "Count to a thousand."}]
LONG = 4000
ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": LONG, "ignore_eos": True}),
    "completions": ("/v1/completions", {"prompt": "Count:", "max_tokens": LONG, "ignore_eos": True}),
    "messages": ("/v1/messages", {"messages": MSGS, "max_tokens": LONG}),
    "responses": ("/v1/responses", {"input": MSGS[0]["content"], "max_output_tokens": LONG}),
}


def read_stream(base_url: str, path: str, body: dict, started: threading.Event, out: dict) -> None:
    """Stream ``body`` to ``path``; ``out["text"]``: everything received, ``out["error"]`` a transport error."""
    chunks: list[str] = []
    try:
        with httpx.stream("POST", base_url + path, json={**body, "stream": True, "temperature": 0}, timeout=120) as r:
            out["status"] = r.status_code
            for chunk in r.iter_text():
                chunks.append(chunk)
                if '"delta"' in chunk or "output_text.delta" in chunk or '"text"' in chunk:
                    started.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    out["text"] = "".join(chunks)
    started.set()


def last_events(text: str) -> list[str]:
    return [b for b in text.strip().split("\n\n") if b and not b.startswith(":")][-2:]


def test_a_second_sigint_ends_every_open_stream_with_its_terminal_event(tmp_path):
    srv = start_server(tmp_path, "--model", "smollm2-135m", "--shutdown-timeout", "300", "--sse-ping-interval", "0",
                       "--faults", "step_delay:ms=10", "--no-enable-prefix-caching")
    try:
        outs = {name: {} for name in ROUTES}
        started = {name: threading.Event() for name in ROUTES}
        threads = [threading.Thread(target=read_stream, args=(srv.base_url, path, body, started[name], outs[name]))
                   for name, (path, body) in ROUTES.items()]
        for t in threads:
            t.start()
        for name, ev in started.items():
            assert ev.wait(180), f"{name}: no token within 180 s"
        os.kill(srv.proc.pid, signal.SIGINT)   # the first: drain (the streams go on, --shutdown-timeout 300)
        time.sleep(2.0)                         # past the window in which a signal is taken as the same one relayed
        assert srv.proc.poll() is None and all(t.is_alive() for t in threads), srv.log()[-2000:]
        t0 = time.monotonic()
        os.kill(srv.proc.pid, signal.SIGINT)   # the second: cut them, exit
        assert srv.proc.wait(30) == 128 + signal.SIGINT
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        stop_server(srv)
    assert took < 10.0, took
    for name, out in outs.items():
        assert out.get("status") == 200 and "error" not in out, (name, out.get("error"), srv.log()[-2000:])
        tail = last_events(out["text"])
        if name in ("chat", "completions"):
            assert tail[-1] == "data: [DONE]", (name, tail)
            assert json.loads(tail[0].removeprefix("data: "))["error"]["code"] == "engine_unavailable", (name, tail)
        else:
            assert tail[-1].startswith("event: error"), (name, tail)
            assert "second signal" in tail[-1], (name, tail)
    assert "Traceback" not in srv.log()
