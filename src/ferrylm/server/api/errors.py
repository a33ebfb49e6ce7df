"""The HTTP edge of ferrylm's typed errors: status codes, OpenAI error JSON, exception handlers.

Body shape everywhere: ``{"error": {"message", "type", "param", "code"}}``.

=====================================================  ======  ==========================
error                                                  status  extra
=====================================================  ======  ==========================
InvalidRequest, ContextLengthExceeded                  400
RequestTooLarge (this module; --max-request-bytes)     413
UnsupportedMediaType (this module)                     415     ``param``: the header
Unauthorized (this module)                             401
ModelNotFound, NotFound, unknown route                 404
EngineUnavailable, QueueTimeout, InsufficientMemory    503     ``Retry-After`` (seconds)
EngineStalled (an EngineUnavailable; watchdog)         503     ``Retry-After`` (seconds)
DeviceError (an EngineUnavailable; sticky CUDA error)  503     ``Retry-After`` (seconds)
RequestQuarantined (failed the engine twice)           500
anything else                                          500     logged with the request id
=====================================================  ======  ==========================

FastAPI's request validation errors and malformed JSON become 400, never 422.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferrylm.errors import (RETRY_AFTER_S, EngineStalled, EngineUnavailable, FerryError, InsufficientMemory,
                            InvalidRequest, ModelNotFound, NotFound, QueueTimeout, RequestQuarantined, RequestTimeout)

logger = logging.getLogger("ferrylm.server")

REQUEST_ID_KEY = "ferrylm.request_id"  # where the request-id middleware puts the id in the ASGI scope


class Unauthorized(FerryError):
    """Missing or wrong API key. HTTP 401."""

    code = "invalid_api_key"


class RequestTooLarge(InvalidRequest):
    """The request body (decompressed, when it came compressed) is larger than ``--max-request-bytes``. HTTP
    413."""

    code = "request_too_large"


class UnsupportedMediaType(InvalidRequest):
    """The body's ``Content-Type`` is not JSON, or its ``Content-Encoding`` is not one the server decodes. HTTP
    415, ``param`` the header."""

    code = "unsupported_media_type"


class RouteNotFound(FerryError):
    """No such route (HTTP 404)."""

    code = "not_found"


class MethodNotAllowed(FerryError):
    """The route exists, not for this method (HTTP 405)."""

    code = "method_not_allowed"


_STATUS: list[tuple[type, int]] = [   # first match wins: subclasses before their bases
    (RequestTooLarge, 413),
    (UnsupportedMediaType, 415),
    (InvalidRequest, 400),  # includes ContextLengthExceeded
    (Unauthorized, 401),
    (ModelNotFound, 404),
    (NotFound, 404),
    (RouteNotFound, 404),
    (MethodNotAllowed, 405),
    (EngineStalled, 503),
    (EngineUnavailable, 503),
    (QueueTimeout, 503),
    (InsufficientMemory, 503),
    (RequestTimeout, 408),
    (RequestQuarantined, 500),
]

_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error", 408: "timeout_error",
         405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         503: "service_unavailable_error", 500: "server_error"}


def status_for(exc: BaseException) -> int:
    """HTTP status for an exception (500 for anything that is not a known FerryError)."""
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def retry_after_for(exc: BaseException) -> int | None:
    """Retry-After seconds for a 503 error, else None."""
    if status_for(exc) != 503:
        return None
    explicit = getattr(exc, "retry_after", None)
    if explicit is not None:
        return max(1, int(explicit))
    for cls, secs in RETRY_AFTER_S.items():
        if isinstance(exc, cls):
            return secs
    return 1


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` as a dict."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The OpenAI error dict for ``exc`` (used for HTTP bodies and for SSE error events)."""
    status = status_for(exc)
    if isinstance(exc, FerryError):
        return error_body(exc.message, _TYPE.get(status, "server_error"), exc.param, exc.code)
    return error_body("internal server error", "server_error", None, "internal_error")


def error_response(exc: BaseException, request_id: str | None = None) -> JSONResponse:
    """A JSONResponse for ``exc`` with the right status, Retry-After and x-request-id headers.

    Unexpected exceptions (status 500) are logged with a traceback.
    """
    status = status_for(exc)
    if status >= 500 and not isinstance(exc, FerryError):
        logger.error("[%s] unexpected error: %r", request_id or "-", exc, exc_info=exc)
    elif status >= 500:
        logger.warning("[%s] %s: %s", request_id or "-", type(exc).__name__, exc)
    else:
        logger.info("[%s] %d %s: %s", request_id or "-", status, type(exc).__name__, exc)
    headers = {}
    ra = retry_after_for(exc)
    if ra is not None:
        headers["Retry-After"] = str(ra)
    if request_id:
        headers["x-request-id"] = request_id
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_payload(exc), status_code=status, headers=headers)


def request_id_of(request: Request) -> str | None:
    """The id the request-id middleware stored in the scope (None outside the app)."""
    return request.scope.get(REQUEST_ID_KEY)


def install_exception_handlers(app: FastAPI) -> None:
    """Register handlers so that every error leaves the app in the OpenAI shape.

    FerryError → its status; RequestValidationError → 400; Starlette HTTPException (unknown route 404, wrong
    method 405, ...) → same status; any other exception → 500 (logged with the request id).
    """
    from ferrylm.server.api.protocol import invalid_from_errors

    async def on_ferry(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc, request_id_of(request))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(invalid_from_errors(list(exc.errors())), request_id_of(request))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            err: FerryError = RouteNotFound(f"no route for {request.method} {request.url.path}")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}")
        elif exc.status_code < 500:
            err = InvalidRequest(str(exc.detail))
        else:
            err = FerryError(str(exc.detail))
        resp = error_response(err, request_id_of(request))
        resp.status_code = exc.status_code
        for k, v in (exc.headers or {}).items():   # e.g. the 405's Allow (RFC 9110 requires it)
            resp.headers[k] = v
        return resp

    async def on_any(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc, request_id_of(request))

    app.add_exception_handler(FerryError, on_ferry)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_any)
