"""The OpenAI-compatible HTTP app: routes, request lifecycle, streaming.

Lifecycle of a completion request (chat or legacy):

1. request id (``x-request-id`` echoed, else generated) → API key → JSON (NaN/Infinity rejected) → pydantic model
   → model name → :func:`chat_protocol.to_sampling_params` (validated).
2. tokenize (chat template or prompt) → context check (``ContextLengthExceeded``, 400) → default ``max_tokens``.
3. engine health pre-check (503) → the engine client's admission check per choice (503 / 500 quarantined) →
   one engine request per choice (``{id}-{i}`` when there are several). Every refusal so far is an HTTP status.
4. a stream's 200 headers and first byte go out at once, keep-alives every ``--sse-ping-interval`` seconds
   without an event (a long prefill), a later failure is an error event (``_Server._start``); a non-stream
   request waits for every choice.
5. stream SSE chunks / collect the full response. A stop string, a client disconnect, or leaving early for any
   reason aborts the engine request(s).

This module must not import torch.
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import json
import logging
import math
import time
import uuid
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import ferrylm
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import EngineUnavailable, FerryError, InvalidRequest, ModelNotFound
from ferrylm.server.process.engine_client import EngineClient
from ferrylm.server.api.errors import (Unauthorized, error_payload, error_response, install_exception_handlers,
                                   request_id_of)
from ferrylm.server.api import anthropic, chat, prepare, render, responses
from ferrylm.server.api import chat_protocol as cp
from ferrylm.server.api import protocol as pr
from ferrylm.server.api.chat import check_continue, render_prompt, template_messages
from ferrylm.server.api.chat import off_loop as _off_loop
from ferrylm.server.api.completions import CompletionRoutes
from ferrylm.server.api.context import DEFAULT_SSE_PING_INTERVAL, ChatJob, ChatRun, PreparedChat
from ferrylm.server.api.chat_protocol import DetokenizeRequest, TokenizeRequest
from ferrylm.server.api.protocol import ModelCard, ModelList, UsageInfo, parse_request
from ferrylm.server.api.chat_format import ChatFormat
from ferrylm.server.api.prepare import check_token_ids
from ferrylm.server.text.harmony import open_message
from ferrylm.server.text.tools import ToolChoice, parse_openai_tools
from ferrylm.server.api.generation import ClientGone, Generation, race_disconnect, sse_event
from ferrylm.server.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ferrylm.server.api.metrics import Metrics
from ferrylm.server.api.health import install_health
from ferrylm.server.api.openapi import ANTHROPIC_ERROR_RESPONSES, ERROR_RESPONSES, install_openapi, route_doc
from ferrylm.server.api.request_io import (ARRIVAL_KEY, DEFAULT_MAX_REQUEST_BYTES, CountOpenRequests,
                                      HeadAsGetMiddleware, OpenRequests, RequestIdMiddleware, read_json)
from ferrylm.server.text.tokenizer import TextCodec, client_template_kwargs
from ferrylm.server.webui import LiveView, install_webui

logger = logging.getLogger("ferrylm.server")

def _version() -> str:
    if getattr(ferrylm, "__version__", None):
        return str(ferrylm.__version__)
    try:
        from importlib.metadata import version

        return version("ferrylm")
    except Exception:  # noqa: BLE001 - not installed (running from a source tree)
        return "unknown"


__version__ = _version()



@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    """CORS as vLLM's flags set it: ``origins`` (``--allowed-origins``, ``*`` any), ``methods``
    (``--allowed-methods``), ``headers`` (``--allowed-headers``; ``*`` any), ``credentials``
    (``--allow-credentials``: cookies and auth headers may be sent)."""

    origins: Sequence[str]
    methods: Sequence[str] = ("*",)
    headers: Sequence[str] = ("*",)
    credentials: bool = False


def create_app(engine: EngineClient, codec: TextCodec, served_model_name: str | Sequence[str], *,
               api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               cors: "CorsPolicy | None" = None,
               sse_ping_interval: float | None = DEFAULT_SSE_PING_INTERVAL,
               responses_store_size: int = 1024, request_timeout: float | None = None,
               tool_call_parser: str = "auto", architecture: str | None = None,
               model_type: str | None = None, webui: bool = True) -> FastAPI:
    """Build the FastAPI app serving ``engine`` under the name(s) ``served_model_name``.

    Args:
        engine: the :class:`EngineClient` (supervisor in production, a fake in tests).
        codec: tokenizer/chat template/detokenizer for the served model.
        served_model_name: the model id clients send, or several (``--served-model-name a b``: each is accepted
            in ``model`` and listed by ``/v1/models``; responses report the first). A missing ``model`` field is
            accepted too.
        api_key: when set, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need ``Authorization: Bearer KEY`` or
            ``x-api-key: KEY``; ``/health``, ``/metrics`` and ``/version`` stay open.
        max_request_bytes: larger request bodies are refused with 413 (``request_too_large``, OpenAI shape).
        cors: who browsers on other origins may call as (``--allowed-origins`` and its flags); None = no CORS
            headers at all.
        sse_ping_interval: seconds without an event after which a stream gets a keep-alive, and whether it
            gets one with its headers (``--sse-ping-interval``; 0 or None: never). See ``_Server._start``.
        responses_store_size: responses kept for ``previous_response_id`` (oldest evicted first).
        request_timeout: seconds from arrival after which the engine ends a request with 408 ``request_timeout``
            (``--request-timeout``; a request's ``x-request-timeout`` header overrides it); None = no deadline.
        tool_call_parser: the tool-call format (``--tool-call-parser``: ``auto`` or a name of
            :data:`ferrylm.server.text.tool_parsers.TOOL_PARSERS`; auto: from the chat template, then
            ``model_type``, then ``architecture``, see :func:`ferrylm.server.text.tool_parsers.choose_tool_parser`).
        architecture: the served model's ``architectures[0]``, for the ``auto`` choice.
        model_type: its config's ``model_type`` (Kimi-K2 is ``kimi_k2`` on a DeepSeek-V3 architecture), for
            the ``auto`` choice.
        webui: serve the web page at ``/`` and its data at ``/v1/live`` (server/webui/; ``--no-webui``: off).

    Raises:
        ValueError: an unknown ``tool_call_parser``.
    """
    server = _Server(engine, codec, served_model_name, api_key, max_request_bytes, request_timeout,
                     tool_call_parser=tool_call_parser, architecture=architecture, model_type=model_type)
    server.ping_interval = sse_ping_interval or None
    server.responses = responses.ResponseStore(responses_store_size)
    live = LiveView(server) if webui else None
    app = FastAPI(title="ferrylm", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", lifespan=live.lifespan if live else None)
    app.state.server = server
    app.state.metrics = server.metrics
    app.state.live_view = live
    install_exception_handlers(app)
    _add_middleware(app, cors)
    _add_routes(app, server)
    install_health(app, engine, codec)
    if live is not None:
        install_webui(app, server._handle, live)
    install_openapi(app)
    return app


def _add_middleware(app: FastAPI, cors: "CorsPolicy | None") -> None:
    """CORS (when configured: it answers preflight OPTIONS itself, before auth and routing), request ids, HEAD as
    GET, and the count of open requests an exiting server waits for (server/process/launch.py)."""
    if cors is not None:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors.origins), allow_methods=list(cors.methods),
                           allow_headers=list(cors.headers), allow_credentials=cors.credentials,
                           expose_headers=["x-request-id"])
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(HeadAsGetMiddleware)
    app.state.open_requests = OpenRequests()
    app.add_middleware(CountOpenRequests, open_requests=app.state.open_requests)


def _add_routes(app: FastAPI, server: "_Server") -> None:
    """The OpenAI, Anthropic and Responses routes, memory, metrics, version and the tokenizer's."""
    doc = route_doc
    v1 = {"responses": ERROR_RESPONSES}
    av1 = {"responses": ANTHROPIC_ERROR_RESPONSES}
    app.add_api_route("/v1/models", server.list_models, methods=["GET"], openapi_extra=doc(None, pr.ModelList),
                      **v1)
    app.add_api_route("/v1/models/{model_id:path}", server.get_model, methods=["GET"],
                      openapi_extra=doc(None, pr.ModelCard), **v1)
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"],
                      openapi_extra=doc(cp.ChatCompletionRequest, cp.ChatCompletionResponse, stream=True), **v1)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"],
                      openapi_extra=doc(cp.CompletionRequest, cp.CompletionResponse, stream=True), **v1)
    app.add_api_route("/v1/chat/completions/render", server.render_chat, methods=["POST"],
                      openapi_extra=doc(cp.ChatCompletionRequest, render.RenderedPrompt), **v1)
    app.add_api_route("/v1/completions/render", server.render_completions, methods=["POST"],
                      openapi_extra=doc(cp.CompletionRequest, render.RenderedPrompt, many=True), **v1)
    app.add_api_route("/v1/messages", server.messages, methods=["POST"],
                      openapi_extra=doc(anthropic.MessagesRequest, None, stream=True), **av1)
    app.add_api_route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"],
                      openapi_extra=doc(anthropic.CountTokensRequest, None), **av1)
    app.add_api_route("/v1/responses", server.create_response, methods=["POST"],
                      openapi_extra=doc(responses.ResponsesRequest, None, stream=True), **v1)
    app.add_api_route("/v1/responses/render", server.render_responses, methods=["POST"],
                      openapi_extra=doc(responses.ResponsesRequest, render.RenderedPrompt), **v1)
    app.add_api_route("/v1/responses/{response_id}", server.get_response, methods=["GET"], **v1)
    app.add_api_route("/v1/memory", server.memory, methods=["GET"], **v1)
    app.add_api_route("/metrics", server.metrics_route, methods=["GET"], response_class=PlainTextResponse)
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"], openapi_extra=doc(cp.TokenizeRequest, None),
                      **v1)
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"],
                      openapi_extra=doc(cp.DetokenizeRequest, None), **v1)


# ---------------------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------------------


class _Server(CompletionRoutes):
    """Route handlers and the state they share."""

    def __init__(self, engine: EngineClient, codec: TextCodec, served_model_name: str | Sequence[str],
                 api_key: str | None,
                 max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, request_timeout: float | None = None,
                 tool_call_parser: str = "auto", architecture: str | None = None, model_type: str | None = None):
        self.engine = engine
        self.request_timeout = request_timeout or None
        self.codec = codec
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        self.served_model_names = tuple(dict.fromkeys(names))   # in order, once each
        self.served_model_name = self.served_model_names[0]    # what responses report
        self.api_key = api_key or None
        self.max_request_bytes = max_request_bytes or None
        self.created = int(time.time())
        self.metrics = Metrics(engine, self.served_model_name)
        self.ping_interval: float | None = DEFAULT_SSE_PING_INTERVAL
        self.responses = responses.ResponseStore(1024)   # previous_response_id (server/api/responses.py)
        self.chat_format = ChatFormat.choose(codec, tool_call_parser, architecture, model_type)

    # ---- helpers -----------------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return int(self.engine.model_info.max_model_len)

    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        want = self.api_key.encode()
        candidates = []
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            candidates.append(auth[7:].strip())
        if "x-api-key" in request.headers:
            candidates.append(request.headers["x-api-key"].strip())
        if not any(hmac.compare_digest(c.encode(), want) for c in candidates if c):
            raise Unauthorized("invalid or missing API key; send 'Authorization: Bearer <key>' or 'x-api-key'")

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names:
            return self.served_model_name
        info_name = getattr(self.engine.model_info, "name", "")
        if info_name and name == info_name:
            return self.served_model_name
        raise ModelNotFound(f"The model '{name}' does not exist; this server serves "
                            f"{' / '.join(repr(n) for n in self.served_model_names)}",
                            param="model")

    def _check_ready(self) -> None:
        try:
            h = self.engine.health()
        except Exception as e:  # noqa: BLE001
            raise EngineUnavailable(f"engine health unknown: {e}") from e
        if not h.ready:
            raise EngineUnavailable(f"engine is {h.status}" + (f": {h.detail}" if h.detail else ""))

    def _timeout(self, request: Request) -> float | None:
        """The request's server-side deadline in seconds from arrival: the ``x-request-timeout`` header, else
        ``--request-timeout`` (None: none). Raises InvalidRequest naming the header for a value that is not a
        positive number of seconds."""
        raw = request.headers.get("x-request-timeout")
        if raw is None:
            return self.request_timeout
        try:
            v = float(raw)
        except ValueError:
            v = float("nan")
        if not math.isfinite(v) or v <= 0:
            raise InvalidRequest(f"x-request-timeout must be a positive number of seconds, got {raw!r}",
                                 param="x-request-timeout")
        return v

    async def _start(self, request: Request, rid: str, gen: Generation, stream: bool) -> None:
        """Start the engine requests; for a non-stream request wait for all of them (client disconnect →
        ClientGone). On any failure the generation is closed.

        The rule for streams: a refusal at admission (everything checked before this, and the engine client's
        ``check_admission``: not ready, shutting down, quarantined) is an HTTP status; once admitted, the 200
        headers go out at once with a first byte (the route's opening event or the keep-alive comment), a
        keep-alive follows every ``ping_interval`` seconds without an event (a queue wait, a long prefill), and
        any later failure (insufficient memory, queue timeout, engine death) is the route's error event."""
        try:
            gen.start()
            if not stream:
                await race_disconnect(request, gen.drain())
        except BaseException:
            await gen.close()
            raise

    async def _handle(self, request: Request, work: Any, errors: Any = error_response) -> Response:
        """Run ``work(request, rid)``; every exception leaves as an error response built by ``errors(exc, rid)``
        (the OpenAI shape unless the route speaks another API)."""
        rid = request_id_of(request) or uuid.uuid4().hex
        t0 = time.monotonic()
        try:
            self._check_auth(request)
            return await work(request, rid)
        except ClientGone:
            logger.info("[%s] client disconnected after %.3f s; engine request aborted", rid,
                        time.monotonic() - t0)
            self.metrics.errors.labels("client_disconnected").inc()
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - every error leaves in the route's error shape
            resp = errors(e, rid)
            code = self._count_error(e)
            logger.info("[%s] done error=%s status=%d after %.3f s", rid, code, resp.status_code,
                        time.monotonic() - t0)
            return resp

    def _count_error(self, e: BaseException) -> str:
        code = str(error_payload(e)["error"].get("code") or "unknown")
        self.metrics.errors.labels(code).inc()
        return code

    async def metrics_route(self, request: Request) -> Response:
        """GET /metrics: Prometheus text format (open, like /health)."""
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def _log_request(self, rid: str, kind: str, prompts: list[list[int]], max_tokens: list[int],
                     params: SamplingParams, stream: bool, unknown: list[str]) -> None:
        if unknown:
            logger.debug("[%s] ignoring unknown fields: %s", rid, unknown)
        logger.info("[%s] %s prompt_tokens=%s max_tokens=%s n=%d stream=%s%s", rid, kind,
                    [len(p) for p in prompts], max_tokens, params.n, stream,
                    " constrained" if params.grammar else "")

    # ---- routes ------------------------------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        async def work(request: Request, rid: str) -> Response:
            return JSONResponse(ModelList(data=[self._model_card(n) for n in self.served_model_names]).model_dump())
        return await self._handle(request, work)

    async def get_model(self, request: Request, model_id: str) -> Response:
        async def work(request: Request, rid: str) -> Response:
            name = model_id if model_id in self.served_model_names else self.check_model(model_id)
            return JSONResponse(self._model_card(name).model_dump())
        return await self._handle(request, work)

    def _model_card(self, name: str) -> ModelCard:
        info = self.engine.model_info
        return ModelCard(id=name, created=self.created, root=info.path or None, max_model_len=int(info.max_model_len))

    async def memory(self, request: Request) -> Response:
        """GET /v1/memory: the engine's memory plan (bytes, pages, tokens, slots) and live figures (free memory
        now, expert slots now, OOM recoveries so far). 503 before the engine reported its plan."""
        async def work(request: Request, rid: str) -> Response:
            info = self.memory_info()
            if info is None:
                raise EngineUnavailable("the engine has not reported its memory plan yet")
            return JSONResponse(info)
        return await self._handle(request, work)

    def memory_info(self) -> dict | None:
        """The body of ``GET /v1/memory`` (the engine client's ``memory()``), None before the engine reported its
        plan or for an engine client without one."""
        get = getattr(self.engine, "memory", None)
        return get() if callable(get) else None

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def tokenize(self, request: Request) -> Response:
        async def work(request: Request, rid: str) -> Response:
            req = parse_request(TokenizeRequest, await read_json(request))
            self.check_model(req.model)
            if req.messages is not None:
                messages = template_messages(req.messages)
                cont = bool(req.continue_final_message)
                add_gen = check_continue(messages, cont, req.add_generation_prompt
                                         if "add_generation_prompt" in req.model_fields_set else None)
                tools = parse_openai_tools(req.tools)
                job = ChatJob(messages, SamplingParams(), tools, ToolChoice("auto" if tools else "none"),
                              client_template_kwargs(req.chat_template_kwargs), add_gen, cont)
                fmt = self.chat_format
                _, ids = await _off_loop(render_prompt, self.codec, job, native_tools=fmt.native_tools,
                                         tool_format=fmt.tool_parser)
            elif req.prompt is not None:
                ids = await _off_loop(self.codec.encode, req.prompt,
                                      add_special_tokens=req.add_special_tokens is not False)
            else:
                raise InvalidRequest("either 'prompt' or 'messages' is required", param="prompt")
            body: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}
            if (req.model_extra or {}).get("return_token_strs") is True:   # vLLM
                body["token_strs"] = [self.codec.token_text(t) for t in ids]
            return JSONResponse(body)
        return await self._handle(request, work)

    async def detokenize(self, request: Request) -> Response:
        async def work(request: Request, rid: str) -> Response:
            req = parse_request(DetokenizeRequest, await read_json(request))
            self.check_model(req.model)
            check_token_ids(self.codec, req.tokens, "tokens")
            return JSONResponse({"prompt": self.codec.decode(req.tokens, skip_special_tokens=False)})
        return await self._handle(request, work)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions (stream and non-stream): server/api/chat.py."""
        return await self._handle(request, functools.partial(chat.chat_completions, self))

    async def messages(self, request: Request) -> Response:
        """POST /v1/messages (Anthropic): server/api/anthropic.py."""
        return await self._handle(request, functools.partial(anthropic.messages, self), anthropic.error_response)

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens (Anthropic): server/api/anthropic.py."""
        return await self._handle(request, functools.partial(anthropic.count_tokens, self),
                                  anthropic.error_response)

    async def create_response(self, request: Request) -> Response:
        """POST /v1/responses (OpenAI Responses API): server/api/responses.py."""
        return await self._handle(request, functools.partial(responses.create, self))

    async def get_response(self, request: Request, response_id: str) -> Response:
        """GET /v1/responses/{response_id}: a stored response."""
        return await self._handle(request, functools.partial(responses.retrieve, self,
                                                             response_id=response_id))

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions (stream and non-stream)."""
        return await self._handle(request, self._completion)

    async def render_chat(self, request: Request) -> Response:
        """POST /v1/chat/completions/render: the prompt's token ids, nothing run (server/api/render.py)."""
        return await self._handle(request, functools.partial(render.chat, self))

    async def render_completions(self, request: Request) -> Response:
        """POST /v1/completions/render: each prompt's token ids, nothing run (server/api/render.py)."""
        return await self._handle(request, functools.partial(render.completions, self))

    async def render_responses(self, request: Request) -> Response:
        """POST /v1/responses/render: the prompt's token ids, nothing run (server/api/render.py)."""
        return await self._handle(request, functools.partial(render.responses, self))

    # ---- chat-like requests (chat completions, Anthropic Messages, Responses) ----------------------------
    async def prepare_chat(self, job: ChatJob) -> PreparedChat:
        """Render and check ``job`` without starting it (:func:`ferrylm.server.api.prepare.prepare_chat`)."""
        return await prepare.prepare_chat(self.chat_format, self.codec, self.engine.model_info, job)

    async def run_chat(self, request: Request, rid: str, job: ChatJob, kind: str, base_id: str) -> ChatRun:
        """Render, admit and start ``job`` (engine request ids ``base_id`` or ``{base_id}-{i}``): see
        :meth:`prepare_chat`, then one engine request per choice, started by :meth:`_start` (a stream's
        headers go out once it is admitted, a non-stream request's whole output is awaited).

        Raises:
            InvalidRequest / ContextLengthExceeded: bad messages, template errors, too long (400).
            EngineUnavailable etc.: the engine cannot take it now (503).
        """
        prep = await self.prepare_chat(job)
        prompt_ids, max_tokens, params = prep.prompt_ids, prep.max_tokens, job.params
        self._log_request(rid, kind, [prompt_ids], [max_tokens], params, job.stream, job.unknown_fields)
        self._check_ready()
        harmony = self.chat_format.harmony
        prime = tuple(open_message(prompt_ids)) if harmony is not None else None
        choices = prepare.make_choices(self.codec, self.engine.model_info, harmony, base_id, [prompt_ids],
                                       [max_tokens], params, prime)
        gen = Generation(self.engine, rid, choices, metrics=self.metrics, arrival=request.scope.get(ARRIVAL_KEY),
                         timeout_s=self._timeout(request))
        turn = prepare.turn_config(self.chat_format, job, prep.text, prime)
        await self._start(request, rid, gen, job.stream)
        return ChatRun(gen, prompt_ids, turn)

    # ---- shared ------------------------------------------------------------------------------------------
    def stream_error(self, rid: str, e: Exception) -> str:
        code = self._count_error(e)
        logger.info("[%s] done error=%s (after the stream started)", rid, code)
        if isinstance(e, FerryError):
            logger.warning("[%s] error after the stream started: %s: %s", rid, type(e).__name__, e)
        else:
            logger.error("[%s] unexpected error after the stream started: %r", rid, e, exc_info=e)
        return sse_event(json.dumps(error_payload(e)))

    def log_done(self, rid: str, gen: Generation, usage: UsageInfo) -> None:
        """The one line per finished request (and its end-to-end latency)."""
        now = time.monotonic()
        e2e = now - gen.arrival
        self.metrics.e2e.observe(e2e)
        ttft = gen.ttft
        first = min((ch.first_token_time for ch in gen.choices if ch.first_token_time is not None), default=None)
        last = gen.last_token_time
        decode_s = (last - first) if first is not None and last is not None else 0.0
        n = usage.completion_tokens
        tps = (n - len(gen.choices)) / decode_s if decode_s > 0 and n > len(gen.choices) else 0.0
        logger.info("[%s] done finish=%s prompt_tokens=%d completion_tokens=%d ttft=%s e2e=%.3fs tok/s=%.1f",
                    rid, ",".join(str(ch.finish_reason) for ch in gen.choices), usage.prompt_tokens, n,
                    "-" if ttft is None else f"{ttft:.3f}s", e2e, tps)
