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

    Args:
        sock: the bound, listening socket. health: the supervisor's ``health``.
    """

    def __init__(self, sock: socket.socket, health: Callable[[], HealthState]):
        self._sock = sock
        self._health = health
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Start answering (on this event loop). Raises OSError when the socket cannot be duplicated."""
        self._server = await asyncio.start_server(self._answer, sock=self._sock.dup())

    async def stop(self) -> None:
        """Stop accepting (connections not yet accepted stay queued for uvicorn); the answers under way finish."""
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
