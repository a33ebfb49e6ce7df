"""The render routes: a generation request's prompt as token ids, without running it (vLLM's shapes).

``POST /v1/chat/completions/render``, ``POST /v1/completions/render`` and ``POST /v1/responses/render`` take the
body of their generation route and answer what that route would hand the engine: the same validation, chat template,
tools, output grammar and context check (``RouteContext.prepare_chat`` / ``prepare_completion``, implemented in
server/api/app.py, shared with the generation routes), then nothing is admitted or generated, so the engine need not
be ready. ``vllm-router`` calls them on a worker before it routes a request (cache-aware routing by prompt token
ids; docs/SCALE-OUT.md); when they answer 404 it falls back to ``POST /tokenize``, one more round trip.

Reply (vLLM's ``GenerateRequest``; a list of them, one per prompt, for completions)::

    {"request_id": str,            # the request id (``x-request-id`` when given)
     "token_ids": [int, ...],      # the prompt the engine would get
     "features": null,             # multimodal features: never (text only)
     "sampling_params": {...},     # vLLM's names: temperature, top_p, top_k, min_p, seed, n, max_tokens (the
                                   # value the context leaves when the request gave none), min_tokens, stop,
                                   # stop_token_ids, ignore_eos, penalties, logprobs, prompt_logprobs,
                                   # skip_special_tokens, include_stop_str_in_output, logit_bias {id: bias} | null
     "model": str, "stream": bool, "stream_options": {...} | null,
     "cache_salt": null, "priority": 0, "kv_transfer_params": null}

An output constraint (grammar, forced tool call) is checked but not part of ``sampling_params``. Errors are the
generation route's: 400 naming the field (``messages.0.content``, ``prompt``, ``previous_response_id`` ...), 400
``context_length_exceeded``, 401 without the key (``--api-key``), 404 for another model.

This module must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.server.api.chat import job_from_chat, off_loop
from ferrylm.server.api.chat_protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from ferrylm.server.api.protocol import parse_request
from ferrylm.server.api.request_io import read_json
from ferrylm.server.api.responses import ResponsesContext, ResponsesRequest, job_from_request

if TYPE_CHECKING:
    from ferrylm.server.api.completions import PreparedCompletion

# SamplingParams fields that vLLM's SamplingParams has under the same name and meaning (logit_bias is reshaped)
VLLM_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
                        "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                        "repetition_penalty", "logprobs", "prompt_logprobs", "skip_special_tokens",
                        "include_stop_str_in_output")


class RenderedPrompt(BaseModel):
    """One rendered prompt, vLLM's ``GenerateRequest`` (the module docstring gives the fields)."""

    request_id: str
    token_ids: list[int]
    features: None = None
    sampling_params: dict[str, Any]
    model: str
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    cache_salt: Optional[str] = None
    priority: int = 0
    kv_transfer_params: Optional[dict[str, Any]] = None


def vllm_sampling_params(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """``params`` under vLLM's names, with ``max_tokens`` the value the request will run with; ``logit_bias``
    as vLLM's ``{token id: bias}`` (None when empty)."""
    out: dict[str, Any] = {k: getattr(params, k) for k in VLLM_SAMPLING_FIELDS}
    out["max_tokens"] = max_tokens
    out["stop"], out["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    out["logit_bias"] = {int(t): float(b) for t, b in params.logit_bias} or None
    return out


def rendered(rid: str, token_ids: list[int], params: SamplingParams, max_tokens: int, model: str, *,
             stream: bool = False, stream_options: StreamOptions | None = None) -> dict[str, Any]:
    """The JSON object of one rendered prompt."""
    opts = stream_options.model_dump(exclude_none=True) if stream_options is not None else None
    return RenderedPrompt(request_id=rid, token_ids=list(token_ids), model=model, stream=stream,
                          stream_options=opts,
                          sampling_params=vllm_sampling_params(params, max_tokens)).model_dump()


class RenderContext(ResponsesContext, Protocol):
    """What the render routes use of the app: the Responses routes' context and the completions route's
    preparation."""

    async def prepare_completion(self, req: CompletionRequest) -> PreparedCompletion:
        """Render and check a completions request without starting it."""


async def chat(ctx: RenderContext, request: Request, rid: str) -> Response:
    """POST /v1/chat/completions/render (``ctx``: the app's :class:`RenderContext`). Raises the chat route's
    errors."""
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await read_json(request))
    model = ctx.check_model(req.model)
    job = await off_loop(job_from_chat, req)
    prep = await ctx.prepare_chat(job)
    return JSONResponse(rendered(rid, prep.prompt_ids, job.params, prep.max_tokens, model,
                                 stream=bool(req.stream), stream_options=req.stream_options))


async def completions(ctx: RenderContext, request: Request, rid: str) -> Response:
    """POST /v1/completions/render: one object per prompt (``n`` copies are not listed). Raises the completions
    route's errors."""
    req: CompletionRequest = parse_request(CompletionRequest, await read_json(request))
    model = ctx.check_model(req.model)
    prep = await ctx.prepare_completion(req)
    return JSONResponse([rendered(rid if len(prep.prompts) == 1 else f"{rid}-{i}", ids, prep.params, mt, model,
                                  stream=bool(req.stream), stream_options=req.stream_options)
                         for i, (ids, mt) in enumerate(zip(prep.prompts, prep.max_tokens))])


async def responses(ctx: RenderContext, request: Request, rid: str) -> Response:
    """POST /v1/responses/render. ``previous_response_id`` is read from this replica's store (an id another
    replica stored is a 400 naming it). Raises the Responses route's errors."""
    req: ResponsesRequest = parse_request(ResponsesRequest, await read_json(request))
    model = ctx.check_model(req.model)
    job, _ = await off_loop(job_from_request, req, ctx.responses)
    prep = await ctx.prepare_chat(job)
    return JSONResponse(rendered(rid, prep.prompt_ids, job.params, prep.max_tokens, model,
                                 stream=bool(req.stream)))
