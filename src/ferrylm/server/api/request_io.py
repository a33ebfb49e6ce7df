"""What a request brings, read safely: its id (``x-request-id``), its arrival time, its body as JSON (size limit,
NaN / Infinity and lone surrogates refused).

This module must not import torch.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from ferrylm.errors import InvalidRequest
from ferrylm.server.api.errors import REQUEST_ID_KEY
from ferrylm.server.api.generation import ClientGone

ARRIVAL_KEY = "ferrylm.arrival"  # scope key: time.monotonic() when the request reached the app


class HeadAsGetMiddleware:
    """Pure-ASGI middleware: a ``HEAD`` request is answered as ``GET`` without a body (same status and headers,
    ``Content-Length`` included), for every route (FastAPI registers ``GET`` routes without ``HEAD``)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_headers_only)


class RequestTooLarge(InvalidRequest):
    """The request body is larger than ``--max-request-bytes``. HTTP 413 (OpenAI error shape)."""

    code = "request_too_large"


class RequestIdMiddleware:
    """Pure-ASGI middleware: puts the request id in ``scope[REQUEST_ID_KEY]`` and on every response's
    ``x-request-id`` header. A client-supplied ``x-request-id`` (printable ASCII, <= 200 chars) is reused."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = ""
        for k, v in scope.get("headers", ()):
            if k == b"x-request-id":
                rid = v.decode("latin-1").strip()
                break
        if not (0 < len(rid) <= 200 and rid.isascii() and rid.isprintable()):
            rid = uuid.uuid4().hex
        scope[REQUEST_ID_KEY] = rid
        scope.setdefault(ARRIVAL_KEY, time.monotonic())
        raw = rid.encode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"x-request-id"]
                headers.append((b"x-request-id", raw))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def read_body(request: Request, limit: int | None) -> bytes:
    """The body, refused (RequestTooLarge, 413) as soon as it is known to exceed ``limit`` bytes: by its
    Content-Length before reading, or while reading a chunked body."""
    if not limit:
        try:
            return await request.body()
        except ClientDisconnect:
            raise ClientGone() from None
    too_large = RequestTooLarge(f"the request body exceeds the server's limit of {limit} bytes "
                                f"(--max-request-bytes)")
    cl = request.headers.get("content-length")
    if cl is not None and cl.strip().isdigit() and int(cl) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None  # the client left while sending its body: an abort, not a server error
    return b"".join(chunks)


async def read_json(request: Request) -> Any:
    """The request body as JSON. Raises InvalidRequest for an empty body, bad JSON, NaN or Infinity, and
    RequestTooLarge (413) past ``--max-request-bytes``."""
    check_json_content_type(request.headers.get("content-type"))
    server = getattr(request.app.state, "server", None)
    body = await read_body(request, getattr(server, "max_request_bytes", None))
    if not body.strip():
        raise InvalidRequest("request body is empty; expected a JSON object")

    def reject(name: str) -> Any:
        raise InvalidRequest(f"invalid JSON: {name} is not a valid JSON number")

    try:
        data = json.loads(body, parse_constant=reject)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"invalid JSON body: {e}") from None
    reject_lone_surrogates(data)
    return data


def check_json_content_type(content_type: str | None) -> None:
    """A body declared as something other than JSON is a 400, as vLLM answers ("Only 'application/json' is
    allowed"): ``application/json`` and ``application/<x>+json`` (any parameters, e.g. ``charset``) pass; no
    Content-Type at all passes too (raw clients, ``curl --data-binary`` without ``-H``) and is read as JSON."""
    if content_type is None or not content_type.strip():
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise InvalidRequest(f"Unsupported Media Type: Content-Type {media!r}; only 'application/json' is allowed",
                         param="Content-Type")


_SURROGATE = re.compile("[\ud800-\udfff]")


def reject_lone_surrogates(data: Any) -> None:
    """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``); Python keeps it in the string, and no tokenizer
    or UTF-8 encoder can take it. Raises InvalidRequest (400) naming the first one found, in keys or values."""
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            m = None if x.isascii() else _SURROGATE.search(x)
            if m is not None:
                raise InvalidRequest(f"invalid JSON body: a string holds a lone UTF-16 surrogate (an unpaired "
                                     f"\\u{ord(m.group()):04x} escape), which is not valid Unicode")
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
