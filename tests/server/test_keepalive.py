"""Keep-alive while a prompt prefills, over real HTTP (uvicorn on a local port, the scripted engine with a slow
first output) and through the real ``openai`` and ``anthropic`` SDKs, on every streaming route.

The rule (``_Server._start``): a refusal at admission is an HTTP status; an admitted stream gets its 200 headers
and a first byte at once, a keep-alive at least every ``--sse-ping-interval`` seconds until its first token (an
SSE comment; Anthropic's ``ping`` event after ``message_start``), and a later failure as the route's error event.
Non-stream replies are unchanged.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import httpx
import pytest

from ferrylm.errors import InsufficientMemory
from ferrylm.server.api.app import create_app
from ferrylm.server.api.assistant import TurnConfig, turn_deltas
from ferrylm.server.api.generation import PING, Event

from .conftest import SERVED, FakeEngine

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
uvicorn = pytest.importorskip("uvicorn")

PING_S = 0.2       # the keep-alive interval under test
PREFILL_S = 1.5    # the scripted engine's time to its first output
SLACK_S = 0.45     # scheduling noise allowed on a loaded 2-core host (a whole interval is missed only past it)
MSGS = [{"role": "user", "content": "hi"}]
TEXT = "Hello world! done."


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a free local port from a background thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def engine(codec, **kw: Any) -> FakeEngine:
    eng = FakeEngine(codec, **kw)
    eng.script = lambda rid, ids, p: codec.encode(TEXT, add_special_tokens=False) + [eng.eos]
    return eng


@dataclass
class Route:
    """A streaming route: its path and body, the blocks it opens with before any token, how its SDK streams
    it (``sdk(base_url, body)`` -> the SDK's events, normalised so two runs compare equal) and reads its text."""

    path: str
    body: dict
    opening: Callable[[str], bool]
    sdk: Callable[[str, dict], list]
    text: Callable[[list], str]


def _oai(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


def _anth(url: str) -> Any:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=30)


def _chat_sdk(url: str, body: dict) -> list:
    return [[(c.index, c.delta.role, c.delta.content, c.finish_reason) for c in chunk.choices]
            for chunk in _oai(url).chat.completions.create(**body)]


def _completions_sdk(url: str, body: dict) -> list:
    return [[(c.index, c.text, c.finish_reason) for c in chunk.choices]
            for chunk in _oai(url).completions.create(**body)]


def _messages_sdk(url: str, body: dict) -> list:
    out = []
    for ev in _anth(url).messages.create(**body):
        d = ev.model_dump()
        if ev.type == "message_start":
            d["message"].pop("id")
        out.append(d)
    return out


def _responses_sdk(url: str, body: dict) -> list:
    return [(ev.type, getattr(ev, "delta", None)) for ev in _oai(url).responses.create(**body)]


ROUTES = {
    "chat": Route("/v1/chat/completions", {"model": SERVED, "messages": MSGS, "stream": True},
                  lambda b: '"delta":{"role":"assistant","content":""}' in b, _chat_sdk,
                  lambda evs: "".join(c[2] or "" for chunk in evs for c in chunk)),
    "completions": Route("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 64, "stream": True},
                         lambda b: False, _completions_sdk,
                         lambda evs: "".join(c[1] for chunk in evs for c in chunk)),
    "messages": Route("/v1/messages", {"model": SERVED, "messages": MSGS, "max_tokens": 64, "stream": True},
                      lambda b: False, _messages_sdk,
                      lambda evs: "".join(e["delta"].get("text", "") for e in evs
                                          if e["type"] == "content_block_delta")),
    "responses": Route("/v1/responses", {"model": SERVED, "input": "hi", "stream": True},
                       lambda b: b.startswith(("event: response.created", "event: response.in_progress")),
                       _responses_sdk,
                       lambda evs: "".join(d for t, d in evs if t == "response.output_text.delta")),
}


def timed_blocks(url: str, path: str, body: dict) -> tuple[float, list[tuple[float, str]]]:
    """POST ``body`` and read the raw body as it arrives: (seconds to the headers, [(seconds to the chunk that
    completed it, SSE block)])."""
    t0 = time.monotonic()
    blocks, buf = [], ""
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        t_headers = time.monotonic() - t0
        assert r.status_code == 200
        for chunk in r.iter_raw():
            t = time.monotonic() - t0
            buf += chunk.decode()
            *done, buf = buf.split("\n\n")
            blocks += [(t, b) for b in done]
    assert buf == ""
    return t_headers, blocks


def is_keepalive(block: str) -> bool:
    return block == ": ping" or block.startswith("event: ping\n")


@pytest.mark.parametrize("name", list(ROUTES))
def test_stream_gets_its_first_byte_at_once_and_keepalives_until_its_first_token(codec, name: str) -> None:
    route = ROUTES[name]
    app = create_app(engine(codec, prefill_delay=PREFILL_S), codec, SERVED, sse_ping_interval=PING_S, webui=False)
    with serving(app) as url:
        t_headers, blocks = timed_blocks(url, route.path, route.body)
        events = route.sdk(url, route.body)          # the same slow stream through the SDK
        whole = httpx.post(url + route.path, json={**route.body, "stream": False}, timeout=30)
    first = next(i for i, (_, b) in enumerate(blocks) if not is_keepalive(b) and not route.opening(b))
    t_token, before = blocks[first][0], blocks[:first]
    assert t_token >= PREFILL_S - 0.1, blocks[:first + 1]          # the prefill held the first token back
    assert t_headers < SLACK_S and before and before[0][0] < SLACK_S, (t_headers, before[:1])
    times = [0.0] + [t for t, _ in before] + [t_token]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < PING_S + SLACK_S, gaps                      # never silent for a whole interval more
    pings = [b for _, b in before if is_keepalive(b)]
    assert len(pings) >= 3, gaps
    assert set(pings) == {": ping"}   # before message_start, Anthropic's keep-alive is a comment too
    # the SDK sees exactly the events of a stream without any keep-alive; the non-stream reply is plain JSON
    quiet = create_app(engine(codec), codec, SERVED, sse_ping_interval=0, webui=False)
    with serving(quiet) as url:
        reference = route.sdk(url, route.body)
        reference_raw = httpx.post(url + route.path, json=route.body, timeout=30).text
    assert ": ping" not in reference_raw and "event: ping" not in reference_raw
    assert events == reference and route.text(events) == TEXT
    assert whole.status_code == 200 and whole.headers["content-type"] == "application/json"
    assert "ping" not in whole.text and whole.json()


@pytest.mark.parametrize("name", list(ROUTES))
def test_failure_after_admission_is_the_routes_error_event_through_its_sdk(codec, name: str) -> None:
    """Admitted, keep-alives sent, then an OOM before the first token: 200 and the route's error event, which
    each SDK reports; the same failure without a stream is a 503."""
    route = ROUTES[name]
    exc = InsufficientMemory("out of memory in the prefill")
    app = create_app(engine(codec, prefill_delay=0.5, start_exc=exc), codec, SERVED, sse_ping_interval=PING_S,
                     webui=False)
    with serving(app) as url:
        raw = httpx.post(url + route.path, json=route.body, timeout=30)
        whole = httpx.post(url + route.path, json={**route.body, "stream": False}, timeout=30)
        if name == "responses":   # the openai SDK yields the Responses API's error event
            events = route.sdk(url, route.body)
            assert events[-1][0] == "error"
            err = None
        else:
            with pytest.raises((openai.APIError, anthropic.APIError)) as err:
                route.sdk(url, route.body)
    opening = raw.text.split("\n\n")[0]
    assert raw.status_code == 200 and (is_keepalive(opening) or route.opening(opening)), raw.text[:300]
    assert "insufficient_memory" in raw.text or "overloaded_error" in raw.text, raw.text[-300:]
    assert whole.status_code == 503 and whole.headers["retry-after"] == "2"
    if err is not None:
        assert "out of memory in the prefill" in str(err.value)


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
QWEN3_CODER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
                    "celsius\n</parameter>\n</function>\n</tool_call>")


class _SlowToolCall:
    """A stand-in :class:`~ferrylm.server.api.generation.Generation`: one choice whose output is a tool call
    (``text``) arriving a few characters per event, ``gap`` seconds apart (a slow host generating the call)."""

    def __init__(self, gap: float, text: str) -> None:
        self.choices = [0]
        self.gap = gap
        self.events = [Event(0, text=text[i:i + 6]) for i in range(0, len(text), 6)]
        self.events[-1].finish_reason = "stop"

    async def next_or_ping(self, ping_interval: float | None):
        if not self.events:
            return None
        await asyncio.sleep(self.gap)
        return self.events.pop(0)


def _run(gen: _SlowToolCall, cfg: TurnConfig) -> list:
    async def run() -> list:
        return [(time.monotonic(), d) async for d in turn_deltas(gen, cfg, ping_interval=0.1)]

    return asyncio.run(run())


def test_a_tool_call_being_generated_gets_keepalives() -> None:
    """Tokens arrive but the turn holds them back (a qwen3_coder call is not released until whole): the stream still
    gets a keep-alive at least every interval (plus one event), then the whole call."""
    gen = _SlowToolCall(0.03, QWEN3_CODER_CALL)
    n = len(gen.events)
    t0 = time.monotonic()
    out = _run(gen, TurnConfig(tool_names=("get_weather",), tool_parser="qwen3_coder"))
    pings = [t for t, d in out if d is PING]
    deltas = [d for _, d in out if d is not PING]
    assert len(deltas) == 1 and [(p.call.name, p.first, p.done) for p in deltas[0].calls] == [
        ("get_weather", True, True)]
    assert deltas[0].finish_reason == "tool_calls"
    gaps = [b - a for a, b in zip([t0] + pings, pings + [out[-1][0]])]
    assert len(pings) >= (n * 0.03) // 0.1 - 1 and max(gaps) < 0.1 + 0.03 + SLACK_S


def test_a_hermes_call_streams_its_arguments_as_they_come() -> None:
    """A hermes call's head goes out once its name and ``"arguments": {`` are written, then its arguments piece by
    piece: several deltas, which join to the released call's arguments."""
    gen = _SlowToolCall(0.01, HERMES_CALL)
    n = len(gen.events)
    deltas = [d for _, d in _run(gen, TurnConfig(tool_names=("get_weather",))) if d is not PING]
    parts = [p for d in deltas for p in d.calls]
    assert len(deltas) >= n // 2 and parts[0].first and parts[0].call.name == "get_weather"
    assert sum(1 for p in parts if p.arguments) >= 5 and parts[-1].done and parts[-1].call.complete
    assert "".join(p.arguments for p in parts) == parts[-1].call.arguments == '{"city": "Paris", "unit": "celsius"}'
    assert deltas[-1].finish_reason == "tool_calls"
