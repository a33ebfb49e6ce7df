"""What a request brings, read safely: its id (``x-request-id``), its arrival time, its body as JSON (size limit,
also after decompressing a ``Content-Encoding: gzip`` / ``deflate`` body; NaN / Infinity, lone surrogates and
nesting deeper than :data:`~ferrylm.server.text.json_limits.MAX_JSON_DEPTH` refused).

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import uuid
import zlib
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from ferrylm.errors import InvalidRequest
from ferrylm.server.api.errors import REQUEST_ID_KEY, RequestTooLarge, UnsupportedMediaType
from ferrylm.server.api.generation import ClientGone
from ferrylm.server.text.json_limits import MAX_JSON_DEPTH, too_deep

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


class OpenRequests:
    """How many HTTP exchanges are still open (:class:`CountOpenRequests` counts them): an exchange ends when
    the app has sent the last byte of its answer, a stream's terminal event included. :meth:`wait_idle` lets an
    exiting server answer everything first."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no exchange is open, at most ``timeout_s`` seconds; True when none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


class CountOpenRequests:
    """Pure-ASGI middleware: every HTTP exchange is counted in ``open_requests`` while the app handles it."""

    def __init__(self, app: Any, open_requests: OpenRequests):
        self.app = app
        self.open = open_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.open.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.open.leave()


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


DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # --max-request-bytes: larger bodies get 413 in the OpenAI error shape


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"the request body exceeds the server's limit of {limit} bytes (--max-request-bytes)")


async def read_body(request: Request, limit: int | None) -> bytes:
    """The body, refused (RequestTooLarge, 413) as soon as it is known to exceed ``limit`` bytes: by its
    Content-Length before reading, or while reading a chunked body."""
    if not limit:
        try:
            return await request.body()
        except ClientDisconnect:
            raise ClientGone() from None
    cl = request.headers.get("content-length")
    if cl is not None and cl.strip().isdigit() and int(cl) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None  # the client left while sending its body: an abort, not a server error
    return b"".join(chunks)


async def read_json(request: Request) -> Any:
    """The request body as JSON. Raises InvalidRequest for an empty body, bad JSON, NaN or Infinity, nesting
    deeper than ``MAX_JSON_DEPTH`` (naming the field it is in); RequestTooLarge (413) past ``--max-request-bytes``
    (before and after decompressing); UnsupportedMediaType (415) for a Content-Type that is not JSON or a
    Content-Encoding other than gzip / deflate / identity."""
    check_json_content_type(request.headers.get("content-type"))
    encoding = content_encoding(request.headers.get("content-encoding"))
    server = getattr(request.app.state, "server", None)
    limit = getattr(server, "max_request_bytes", None)
    body = decompress(await read_body(request, limit), encoding, limit or DEFAULT_MAX_REQUEST_BYTES)
    if not body.strip():
        raise InvalidRequest("request body is empty; expected a JSON object")

    def reject(name: str) -> Any:
        raise InvalidRequest(f"invalid JSON: {name} is not a valid JSON number")

    try:
        data = json.loads(body, parse_constant=reject)
    except RecursionError:
        raise InvalidRequest(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels (objects and "
                             f"arrays inside each other), the most this server reads") from None
    except ValueError as e:
        if "integer string conversion" in str(e):   # Python's own message advises about its interpreter
            raise InvalidRequest(f"invalid JSON: an integer of more than {sys.get_int_max_str_digits()} digits, "
                                 f"more than this server reads") from None
        raise InvalidRequest(f"invalid JSON body: {e}") from None
    check_body_depth(data)
    reject_lone_surrogates(data)
    return data


#: fields whose value is the client's own JSON (schemas, call arguments, template arguments), as path patterns
#: (``*``: a list index): a body nested too deeply inside one of them is reported as that field
JSON_VALUED_FIELDS = ("tools.*.function.parameters", "tools.*.parameters", "tools.*.input_schema",
                      "messages.*.tool_calls.*.function.arguments", "messages.*.content.*.input",
                      "input.*.arguments", "response_format.json_schema.schema", "text.format.schema",
                      "structured_outputs.json", "guided_json", "json_schema", "chat_template_kwargs", "metadata")


def check_body_depth(data: Any) -> None:
    """Raise InvalidRequest when ``data`` nests deeper than ``MAX_JSON_DEPTH``: ``param`` is the field of
    :data:`JSON_VALUED_FIELDS` the deep part is in, else the top-level field and its index or key
    (``messages.3``)."""
    path = too_deep(data)
    if path is None:
        return
    param = ".".join(str(k) for k in path[:2])
    for pattern in JSON_VALUED_FIELDS:
        parts = pattern.split(".")
        if len(path) >= len(parts) and all(isinstance(k, int) if p == "*" else p == k for p, k in zip(parts, path)):
            param = ".".join(str(k) for k in path[:len(parts)])
            break
    raise InvalidRequest(f"'{param}' nests JSON deeper than {MAX_JSON_DEPTH} levels (objects and arrays inside "
                         f"each other, counted from the request body), the most this server reads", param=param)


def check_json_content_type(content_type: str | None) -> None:
    """A body declared as something other than JSON is a 415, as vLLM answers ("Only 'application/json' is
    allowed"): ``application/json`` and ``application/<x>+json`` (any parameters, e.g. ``charset``) pass; no
    Content-Type at all passes too (raw clients, ``curl --data-binary`` without ``-H``) and is read as JSON."""
    if content_type is None or not content_type.strip():
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise UnsupportedMediaType(f"Unsupported Media Type: Content-Type {media!r}; only 'application/json' is "
                               f"allowed", param="Content-Type")


#: Content-Encoding -> zlib's ``wbits`` for it (None: the body as it is)
_ENCODINGS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
              "deflate": zlib.MAX_WBITS}


def content_encoding(header: str | None) -> str:
    """The one coding a body came in (``identity`` without the header). Raises UnsupportedMediaType (415) naming
    Content-Encoding for another one or several."""
    coding = (header or "identity").strip().lower() or "identity"
    if coding not in _ENCODINGS:
        raise UnsupportedMediaType(f"Content-Encoding {coding!r} is not supported; send the body as it is, or "
                                   f"gzip / deflate it", param="Content-Encoding")
    return coding


def decompress(body: bytes, coding: str, limit: int) -> bytes:
    """``body`` decoded from ``coding`` (:func:`content_encoding`), at most ``limit`` bytes of it: a larger
    result (a zip bomb included) is refused as soon as it passes the limit, without inflating the rest.
    Raises RequestTooLarge (413) past ``limit``, InvalidRequest for a body that is not valid in its coding."""
    wbits = _ENCODINGS[coding]
    if wbits is None:
        return body
    out, data = bytearray(), body
    try:
        while data:   # gzip allows several members one after another
            d = zlib.decompressobj(wbits)
            out += d.decompress(data, limit + 1 - len(out))
            if len(out) > limit or d.unconsumed_tail:
                raise RequestTooLarge(f"the request body decompresses to more than the server's limit of {limit} "
                                      f"bytes (--max-request-bytes)")
            if not d.eof:
                raise zlib.error("the compressed body ends early")
            data = d.unused_data
    except zlib.error as e:
        raise InvalidRequest(f"the request body is not valid {coding} data (Content-Encoding): {e}",
                             param="Content-Encoding") from None
    return bytes(out)


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
