"""The OpenAPI description of the HTTP app: the routes parse their bodies themselves (400 in the OpenAI shape,
never FastAPI's 422), so their request / response schemas are declared here and added as components.

This module must not import torch.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": what, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for code, what in ((400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
                       (413, "request body too large"), (415, "body not JSON, or a Content-Encoding not served"),
                       (503, "engine unavailable / overloaded"))}


# Anthropic's routes answer errors in Anthropic's shape (server/api/anthropic.py)
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": what, "content": {"application/json": {"schema": _ANTHROPIC_ERROR}}}
    for code, what in ((400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
                       (413, "request body too large"), (415, "body not JSON, or a Content-Encoding not served"),
                       (503, "engine unavailable / overloaded"))}


_HEALTH_BODY = {"type": "object", "required": ["status"], "additionalProperties": True,
                "properties": {"status": {"type": "string"}, "detail": {"type": "string"}}}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "ready", "content": {"application/json": {"schema": _HEALTH_BODY}}},
    503: {"description": "not ready: loading, restarting, stalled, dead, draining (Retry-After)",
          "content": {"application/json": {"schema": _HEALTH_BODY}}}}


def route_doc(req: type | None, resp: type | None, *, stream: bool = False, many: bool = False) -> dict:
    """``openapi_extra`` for a route that parses its body itself: the request body and 200 schemas (as references to
    the components :func:`install_openapi` adds); ``stream``: the 200 may also be ``text/event-stream``; ``many``:
    the 200 is a JSON array of ``resp``."""
    extra: dict[str, Any] = {}
    if req is not None:
        extra["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{req.__name__}"}}}}
    if resp is not None:
        one = {"$ref": f"#/components/schemas/{resp.__name__}"}
        content: dict[str, Any] = {"application/json": {"schema": {"type": "array", "items": one} if many else one}}
        extra["responses"] = {"200": {"description": "OK", "content": content}}
    if stream:   # OpenAPI < 3.2: `schema` describes one event
        content = extra.setdefault("responses", {"200": {"description": "OK", "content": {
            "application/json": {"schema": {"type": "object"}}}}})["200"]["content"]
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"], "properties": {
                "data": {"type": "string", "description": "one event as JSON (a chat.completion.chunk, a "
                         "text_completion, an Anthropic or Responses stream event), an error object, or the "
                         "final [DONE] (chat and completions)"},
                "event": {"type": "string", "description": "the event type (Anthropic and Responses)"}}}}
    return extra


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` add the protocol models as components and drop FastAPI's 422 responses (this server
    answers validation errors with 400 in the OpenAI shape, ``server/api/errors.py``)."""
    from ferrylm.server.api import chat_protocol as cp
    from ferrylm.server.api import protocol as pr

    def openapi() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi
            from pydantic.json_schema import models_json_schema

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            from ferrylm.server.api.anthropic import CountTokensRequest, MessagesRequest
            from ferrylm.server.api.render import RenderedPrompt
            from ferrylm.server.api.responses import ResponsesRequest

            models = [(m, "validation") for m in (cp.ChatCompletionRequest, cp.CompletionRequest,
                                                  cp.TokenizeRequest, cp.DetokenizeRequest, MessagesRequest,
                                                  CountTokensRequest, ResponsesRequest)]
            models += [(m, "serialization") for m in (cp.ChatCompletionResponse, cp.CompletionResponse,
                                                      pr.ModelCard, pr.ModelList, pr.ErrorResponse,
                                                      RenderedPrompt)]
            _, top = models_json_schema(models, ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(top.get("$defs", {}))
            # FastAPI documents a 422 for every route with parameters; this server answers validation errors
            # with 400 in the OpenAI shape (server/api/errors.py) and never with 422.
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema["components"]["schemas"].pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
