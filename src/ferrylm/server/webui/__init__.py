"""The web page at ``/`` (chat, and a live view of the memory plan, the expert cache and the engine) and its data
route ``GET /v1/live`` (:mod:`ferrylm.server.webui.live`).

The page is static files in ``static/``: plain HTML, CSS and JavaScript modules, no build step, nothing fetched
from outside the server. They are open (no secrets in them); the page sends the API key the person enters to the
protected routes it calls. ``ferry serve --no-webui`` leaves all of it out.

This package must not import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from ferrylm.server.api.openapi import ERROR_RESPONSES
from ferrylm.server.webui.live import LiveView, parse_since

#: ``handle(request, work)``: run ``work(request, request_id)`` as the app runs a route (the API key, the error
#: shape; ``server/api/app.py``)
RouteHandler = Callable[[Request, Callable[[Request, str], Awaitable[Response]]], Awaitable[Response]]

STATIC_DIR = Path(__file__).resolve().parent / "static"

__all__ = ["LiveView", "STATIC_DIR", "install_webui"]


def install_webui(app: FastAPI, handle: RouteHandler, view: LiveView) -> None:
    """Add ``GET /`` (the page), ``/webui/*`` (its files) and ``GET /v1/live`` (its data, behind the API key like
    ``/v1/memory``: ``handle`` runs it as the app runs its routes) to ``app``. ``view`` samples while the app runs
    when its :meth:`LiveView.lifespan` is the app's."""

    async def index(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html",
                            headers={"Cache-Control": "no-cache"})

    async def live(request: Request) -> Response:
        """The live view's figures: engine state, memory plan (``/v1/memory``'s body), expert cache, OOM
        recoveries, and the samples of the last minutes after ``?since=N``."""
        async def work(request: Request, rid: str) -> Response:
            since = parse_since(request.query_params.get("since"))
            return JSONResponse(view.snapshot(since))
        return await handle(request, work)

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/live", live, methods=["GET"], responses=ERROR_RESPONSES, openapi_extra={"parameters": [
        {"name": "since", "in": "query", "required": False, "description": "answer only the samples after this "
         "sequence number", "schema": {"type": "integer", "minimum": 0}}]})
    app.mount("/webui", StaticFiles(directory=STATIC_DIR), name="webui")
