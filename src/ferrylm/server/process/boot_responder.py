"""The port's answer while ``ferry serve`` starts: from the moment the event loop runs until uvicorn takes the
listening socket (the tokenizer and the app are still being built, the engine loads beside them), every request
gets an immediate 503 with Retry-After instead of waiting unanswered in the listen backlog. A readiness probe or a
client polling ``/health`` learns "not yet" at once, as llama-server answers 503 while it loads.

``/health`` gets the supervisor's own state (``{"status": "loading", "detail": ...}``), the Anthropic routes
``overloaded_error``, any other path the OpenAI error envelope with code ``engine_unavailable``, all with the app's
Retry-After: what the app answers while the engine loads (tests/supervision/test_boot_responder.py compares them).
This module imports no web framework.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable

from ferrylm.errors import RETRY_AFTER_S, EngineUnavailable
from ferrylm.server.process.engine_client import HealthState

HEAD_TIMEOUT_S = 2.0      # how long a connection may take to send its request line and headers
ACCEPT_RETRY_S = 1.0      # the pause in accepting after the process ran out of descriptors
RETRY_AFTER = RETRY_AFTER_S[EngineUnavailable]
_REASON = b"HTTP/1.1 503 Service Unavailable\r\n"


def starting_answer(path: str, health: Callable[[], HealthState]) -> bytes:
    """The whole HTTP response (bytes) for a request of ``path``, as the app answers while the engine loads;
    ``health()`` is the supervisor's."""
    route = path.split("?", 1)[0]
    h = health()
    status, detail = h.status, h.detail
    message = f"the engine is not ready ({status})"
    if route == "/health":
        body: dict = {"status": status, "detail": detail}
    elif route.startswith("/v1/messages"):   # the Anthropic routes' envelope (server/api/anthropic.py)
        body = {"type": "error", "error": {"type": "overloaded_error", "message": message}}
    else:                                     # the OpenAI envelope (server/api/errors.py)
        body = {"error": {"message": message, "type": "service_unavailable_error", "param": None,
                          "code": EngineUnavailable.code}}
    data = json.dumps(body).encode()
    head = (f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nRetry-After: {RETRY_AFTER}\r\n"
            "Connection: close\r\n\r\n").encode()
    return _REASON + head + data


class BootResponder:
    """Answers on a duplicate of ``sock`` (closing it leaves ``sock`` listening for uvicorn).

    It accepts in its own reader callback rather than through ``asyncio.start_server``: a server closed between
    accepting a connection and building its transport orphans that connection (asyncio's ``Server._attach``
    asserts the server is open), and the client then waits, unanswered, until the socket is garbage-collected. Here
    every connection accepted gets its answer, and :meth:`stop` leaves the rest in the backlog for uvicorn.

    Args:
        sock: the bound, listening socket. health: the supervisor's ``health``.
    """

    def __init__(self, sock: socket.socket, health: Callable[[], HealthState]):
        self._sock = sock
        self._health = health
        self._listener: socket.socket | None = None
        self._answers: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Start answering (on this event loop). Raises OSError when the socket cannot be duplicated."""
        self._listener = self._sock.dup()
        self._listener.setblocking(False)
        asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept_ready)

    async def stop(self) -> None:
        """Stop accepting (connections not yet accepted stay queued for uvicorn); the answers under way finish."""
        if self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None

    def _accept_ready(self) -> None:
        """The listening socket is readable: accept what is queued, an answer task for each."""
        loop = asyncio.get_running_loop()
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:   # the client left before the accept: the next may be there
                continue
            except OSError:   # out of descriptors or memory: accepting pauses a second, as asyncio's servers do
                loop.remove_reader(self._listener.fileno())
                loop.call_later(ACCEPT_RETRY_S, self._resume)
                return
            conn.setblocking(False)
            task = loop.create_task(self._answer(conn))
            self._answers.add(task)
            task.add_done_callback(self._answers.discard)

    def _resume(self) -> None:
        if self._listener is not None:
            asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept_ready)

    async def _answer(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except OSError:
            conn.close()
            return
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            parts = head.split(b" ", 2)
            path = parts[1].decode("latin-1") if len(parts) > 2 else "/"
            writer.write(starting_answer(path, self._health))
            await writer.drain()
            # read what the client still sends (a request body) until it closes: closing with unread bytes would
            # reset the connection, and some clients then report the reset instead of the 503
            await asyncio.wait_for(_discard(reader), HEAD_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def _discard(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass
