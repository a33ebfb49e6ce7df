"""The health routes: ``GET /health`` (the engine's state, at once) and ``GET /health/generate`` (a readiness
probe that proves a token can be produced).

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import EngineUnavailable, FerryError, InvalidRequest
from ferrylm.server.api.errors import error_response, request_id_of, retry_after_for
from ferrylm.server.api.generation import cleanup
from ferrylm.server.api.openapi import ERROR_RESPONSES, HEALTH_RESPONSES
from ferrylm.server.process.engine_client import EngineClient
from ferrylm.server.text.tokenizer import TextCodec

logger = logging.getLogger("ferrylm.server")

HEALTH_GENERATE_TIMEOUT_S = 5.0  # default bound on GET /health/generate (``?timeout=`` overrides, up to 60 s)


def install_health(app: FastAPI, engine: EngineClient, codec: TextCodec) -> None:
    """Add ``/health`` and ``/health/generate`` for ``engine`` (open: no API key)."""

    async def health(request: Request) -> Response:
        """200 ``{"status": "ready"}``; else 503 ``{"status": <state>, "detail": ...}`` with Retry-After."""
        try:
            h = engine.health()
        except Exception as e:  # noqa: BLE001
            return JSONResponse({"status": "unknown", "detail": repr(e)}, status_code=503,
                                headers={"Retry-After": "5"})
        extra = dict(h.extra or {})  # engine_pid, restarts, heartbeat_age_s ... (supervisor)
        if h.ready:
            return JSONResponse({"status": "ready", **extra})
        return JSONResponse({"status": h.status, "detail": h.detail, **extra}, status_code=503,
                            headers={"Retry-After": str(retry_after_for(EngineUnavailable("")) or 5)})

    async def health_generate(request: Request) -> Response:
        return await generate_probe(engine, codec, request)

    app.add_api_route("/health", health, methods=["GET"], responses=HEALTH_RESPONSES)
    app.add_api_route("/health/generate", health_generate, methods=["GET"],
                      responses={**HEALTH_RESPONSES, 400: ERROR_RESPONSES[400]}, openapi_extra={"parameters": [
                          {"name": "timeout", "in": "query", "required": False, "description":
                           "seconds to wait for the token (default 5; clamped to 0.1 .. 60)",
                           "schema": {"type": "number"}}]})


async def generate_probe(engine: EngineClient, codec: TextCodec, request: Request) -> Response:
    """One greedy token through the engine within ``?timeout=`` seconds (default 5). 200 ``{"status": "ok",
    "latency_s", ...}``; otherwise 503 with the engine's status, ``timeout`` or the error code; 400 for a timeout
    that is not a number."""
    raw = request.query_params.get("timeout")
    try:
        timeout = HEALTH_GENERATE_TIMEOUT_S if raw is None else float(raw)
    except ValueError:
        timeout = math.nan
    if not math.isfinite(timeout):   # NaN would pass min/max and reach the event loop's timer heap
        return error_response(InvalidRequest(f"'timeout' must be a number of seconds, got {raw!r}",
                                             param="timeout"), request_id_of(request))
    timeout = min(max(timeout, 0.1), 60.0)
    unavailable = {"Retry-After": str(retry_after_for(EngineUnavailable("")) or 5)}
    h = engine.health()
    if not h.ready:
        return JSONResponse({"status": h.status, "detail": h.detail}, status_code=503, headers=unavailable)
    rid = f"health-{uuid.uuid4().hex}"
    prompt = codec.encode("ping") or [0]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.monotonic()
    agen = engine.generate(rid, prompt, params)

    async def one_token() -> int:
        n = 0
        async for out in agen:
            n += len(out.new_token_ids)
            if out.finished:
                break
        return n

    try:
        n = await asyncio.wait_for(one_token(), timeout)
    except asyncio.TimeoutError:
        logger.warning("[%s] /health/generate: no token within %g s", rid, timeout)
        return JSONResponse({"status": "timeout", "detail": f"no token within {timeout:g} s"},
                            status_code=503, headers=unavailable)
    except FerryError as e:
        return JSONResponse({"status": "error", "code": e.code, "detail": e.message}, status_code=503,
                            headers=unavailable)
    finally:
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            await cleanup(aclose(), "closing the probe", rid)
    return JSONResponse({"status": "ok", "tokens": n, "latency_s": round(time.monotonic() - t0, 4)},
                        status_code=200 if n >= 1 else 503)
