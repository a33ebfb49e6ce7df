"""The port's 503 while ``ferry serve`` starts (``server/process/boot_responder.py``): a real HTTP client gets an
immediate 503 with Retry-After (``/health`` the supervisor's state, any other path the error envelope), a client
that never sends its request is let go, and after the responder stops the same socket still accepts (uvicorn's)."""

from __future__ import annotations

import asyncio
import contextlib
import errno

import httpx
import pytest

from ferrylm.server.process import boot_responder
from ferrylm.server.process.engine_client import HealthState
from ferrylm.server.process.launch import bind_socket


async def _answer_on(sock) -> None:
    async def hello(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(hello, sock=sock)


@pytest.mark.timeout(30)
def test_boot_responder_answers_503_then_hands_the_socket_over(monkeypatch):
    monkeypatch.setattr(boot_responder, "HEAD_TIMEOUT_S", 0.2)
    sock = bind_socket("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    states = iter([HealthState("loading", "engine starting"), HealthState("loading", "engine warming up")]
                  + [HealthState("loading")] * 8)

    async def scenario():
        responder = boot_responder.BootResponder(sock, lambda: next(states))
        await responder.start()
        async with httpx.AsyncClient(timeout=5) as client:
            first = await client.get(base + "/health")
            second = await client.get(base + "/health?x=1")
            chat = await client.post(base + "/v1/chat/completions", json={"model": "m", "messages": []})
            big = await client.post(base + "/v1/completions", content=b"x" * (8 << 20))   # a body it never reads
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        silent = await asyncio.wait_for(reader.read(), 5)   # sends nothing: closed after HEAD_TIMEOUT_S, no answer
        writer.close()
        await responder.stop()
        server = await _answer_on(sock)
        async with httpx.AsyncClient(timeout=5) as client:
            after = await client.get(base + "/health")
        server.close()
        return first, second, chat, big, silent, after

    first, second, chat, big, silent, after = asyncio.run(scenario())
    assert first.status_code == 503 and first.headers["retry-after"] == "5"
    assert first.json() == {"status": "loading", "detail": "engine starting"}
    assert second.json() == {"status": "loading", "detail": "engine warming up"}
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "engine_unavailable"
    assert big.status_code == 503
    assert silent == b""
    assert after.status_code == 200 and after.text == "ok"


@pytest.mark.timeout(30)
def test_a_stop_in_the_loop_turn_of_an_accept_still_answers_it():
    """The responder stops in the same event-loop turn in which it accepted a connection (the turn in which the
    socket became readable): that client still gets its answer, or the next server's."""
    sock = bind_socket("127.0.0.1", 0)
    addr = sock.getsockname()

    async def scenario():
        responder = boot_responder.BootResponder(sock, lambda: HealthState("loading"))
        loop = asyncio.get_running_loop()
        watch = sock.dup()   # readable in the same turn as the responder's socket (one listening socket)
        stopped = asyncio.Event()

        def stop_now() -> None:
            loop.remove_reader(watch.fileno())
            coro = responder.stop()   # it awaits nothing: run to its end here, inside this turn
            with contextlib.suppress(StopIteration):
                coro.send(None)
            stopped.set()

        # registered first, so woken after the responder's reader (Linux wakes the newest waiter of a socket first)
        loop.add_reader(watch.fileno(), stop_now)
        await responder.start()
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await stopped.wait()
        server = await _answer_on(sock.dup())
        try:
            return (await asyncio.wait_for(reader.readline(), 5)).rstrip()
        finally:
            writer.close()
            server.close()
            watch.close()

    assert asyncio.run(scenario()) in (b"HTTP/1.1 503 Service Unavailable", b"HTTP/1.1 200 OK")


@pytest.mark.timeout(30)
def test_out_of_descriptors_pauses_accepting_then_answers(monkeypatch):
    """An accept that fails for want of descriptors (EMFILE) does not spin the loop on the readable socket: the
    responder stops watching it for ``ACCEPT_RETRY_S``, then answers the waiting client."""
    monkeypatch.setattr(boot_responder, "ACCEPT_RETRY_S", 0.3)
    sock = bind_socket("127.0.0.1", 0)
    addr = sock.getsockname()

    class OutOfFds:
        """The listener, whose first accept fails as a process out of descriptors does."""

        def __init__(self, real):
            self.real, self.accepts = real, 0

        def accept(self):
            self.accepts += 1
            if self.accepts == 1:
                raise OSError(errno.EMFILE, "Too many open files")
            return self.real.accept()

        def __getattr__(self, name):
            return getattr(self.real, name)

    async def scenario():
        responder = boot_responder.BootResponder(sock, lambda: HealthState("loading"))
        await responder.start()
        listener = responder._listener = OutOfFds(responder._listener)
        t0 = asyncio.get_running_loop().time()
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        line = await asyncio.wait_for(reader.readline(), 5)
        waited = asyncio.get_running_loop().time() - t0
        writer.close()
        await responder.stop()
        return line.rstrip(), waited, listener.accepts

    line, waited, accepts = asyncio.run(scenario())
    assert line == b"HTTP/1.1 503 Service Unavailable"
    assert 0.25 <= waited < 3 and accepts == 3   # failed, (a pause), accepted, nothing more queued
