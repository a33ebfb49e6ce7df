"""Anthropic Messages: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (what Claude Code and the
``anthropic`` SDK send).

Request → :class:`~ferrylm.server.api.chat.ChatJob`: ``system`` (text or text blocks) becomes the system turn (without
Claude Code's per-request ``x-anthropic-billing-header`` line at its top: ``server/text/prompt_hygiene.py``); user
``text`` blocks the user turn and ``tool_result`` blocks ``tool`` turns (in order; each must answer an earlier
``tool_use``, else a 400 naming its ``tool_use_id``, as Anthropic's API answers); assistant ``text``,
``thinking`` and ``tool_use`` blocks its content, ``reasoning_content`` and ``tool_calls``; a final assistant
message is continued (Anthropic's prefill). ``tools`` (``name``, ``description``, ``input_schema``) and
``tool_choice`` (``auto`` | ``any`` | ``tool`` | ``none``, ``disable_parallel_tool_use``) map onto the shared tool
machinery (``any`` and ``tool`` are enforced by a grammar). ``thinking: {"type": "enabled"|"disabled"}`` sets the
template's ``enable_thinking``, and its ``budget_tokens`` the ``reasoning_effort`` (:func:`thinking_kwargs`).

Reply: content blocks ``thinking`` / ``text`` / ``tool_use`` (no empty ``text`` block: nothing generated is
``content: []``), ``stop_reason`` ``end_turn`` | ``max_tokens`` |
``stop_sequence`` (with ``stop_sequence``) | ``tool_use``, ``usage`` in tokens. Stream: the Anthropic event
sequence ``message_start``, per block ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``thinking_delta``, ``input_json_delta``) / ``content_block_stop``, ``message_delta`` (stop reason, output
tokens), ``message_stop``; ``ping`` events while nothing else comes (SSE comments before ``message_start``, which
waits for the engine's first output: its usage carries the prompt's cache figures); an error after the start is an
``error`` event. Errors use Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``.

This module must not import torch.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import InvalidRequest
from ferrylm.server.api.assistant import TurnDelta, turn_deltas, whole_turn
from ferrylm.server.api.chat import SSE_HEADERS, off_loop, render_prompt
from ferrylm.server.api.generation import PING, SSE_PING, SSEResponse
from ferrylm.server.api.errors import error_payload, error_response as openai_error_response, status_for
from ferrylm.server.text.prompt_hygiene import strip_billing_header
from ferrylm.server.api.protocol import UsageInfo, _Request, parse_request
from ferrylm.server.api.context import ChatJob, ChatRun, RouteContext
from ferrylm.server.api.request_io import read_json
from ferrylm.server.text.tool_parsers.base import ToolCall
from ferrylm.server.text.tools import ToolChoice, ToolSpec, check_tool_result, check_unique, make_tool

# ---------------------------------------------------------------------------------------------------------
# request
# ---------------------------------------------------------------------------------------------------------


class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: Union[Annotated[str, Field(min_length=1)], Annotated[list[dict[str, Any]], Field(min_length=1)]]


class MessagesRequest(_Request):
    """POST /v1/messages (``max_tokens`` is required, as Anthropic's API has it)."""

    model: Optional[str] = None
    max_tokens: int
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without ``max_tokens``."""

    max_tokens: Optional[int] = None  # type: ignore[assignment]


def _text_of(content: Any, param: str) -> str:
    """Text of a string or a list of ``text`` blocks (tool_result content, system)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise InvalidRequest(f"'{param}' must be a string or a list of text blocks", param=param)
    out = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise InvalidRequest(f"'{param}.{j}': only text blocks are supported here, got {kind!r}",
                                 param=f"{param}.{j}")
        out.append(b["text"])
    return "\n".join(out)


def convert_messages(req: MessagesRequest) -> list[dict]:
    """Anthropic ``system`` + ``messages`` → template messages (OpenAI chat shape). Raises InvalidRequest naming
    the block for unsupported block types (images, documents) and malformed tool blocks."""
    out: list[dict] = []
    if req.system is not None:
        system = strip_billing_header(_text_of(req.system, "system"))   # per-request: would break the prefix
        if system:
            out.append({"role": "system", "content": system})
    tool_use_ids: set[str] = set()
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        results = 0
        calls: list[dict] = []
        thinking: list[str] = []
        for j, b in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise InvalidRequest(f"'{where}.tool_use_id' is required", param=f"{where}.tool_use_id")
                check_tool_result(b["tool_use_id"], tool_use_ids, f"{where}.tool_use_id", "'tool_use' block's 'id'")
                result = _text_of(b.get("content"), f"{where}.content")
                if b.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
                results += 1
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise InvalidRequest(f"'{where}' needs a 'name' and an object 'input'", param=where)
                calls.append({"id": str(b.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"), "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
                tool_use_ids.add(calls[-1]["id"])
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                if isinstance(b.get("thinking"), str):
                    thinking.append(b["thinking"])
            else:
                raise InvalidRequest(f"'{where}.type' {kind!r} is not supported in a {m.role} message (text, "
                                     f"tool_use, tool_result and thinking blocks are)", param=f"{where}.type")
        if m.role == "user":
            if texts or not results:
                out.append({"role": "user", "content": "\n".join(texts)})
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            out.append(msg)
    return out


def convert_tools(tools: Any, choice: Any) -> tuple[list[ToolSpec], ToolChoice]:
    """Anthropic ``tools`` / ``tool_choice`` → the shared ToolSpecs and ToolChoice. Raises InvalidRequest."""
    specs: list[ToolSpec] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest("'tools' must be a list", param="tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise InvalidRequest(f"'tools.{i}.type' {kind!r} is not supported (only custom tools with an "
                                     f"input_schema are)", param=f"tools.{i}.type")
            if "input_schema" not in t:
                raise InvalidRequest(f"'tools.{i}.input_schema' is required", param=f"tools.{i}.input_schema")
            specs.append(make_tool(t.get("name"), t.get("description"), t.get("input_schema"), None, f"tools.{i}",
                                   "input_schema"))
        check_unique(specs, "tools")
    if choice is None:
        return specs, ToolChoice("auto" if specs else "none")
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind == "none":
        return specs, ToolChoice("none")
    if kind not in ("auto", "any", "tool"):
        raise InvalidRequest(f"'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'; got {kind!r}",
                             param="tool_choice.type")
    if not specs:
        raise InvalidRequest(f"'tool_choice' {kind!r} needs 'tools'", param="tool_choice")
    if kind == "auto":
        return specs, ToolChoice("auto", parallel=parallel)
    if kind == "any":
        return specs, ToolChoice("required", parallel=parallel)
    name = choice.get("name")
    if name not in {t.name for t in specs}:
        raise InvalidRequest(f"'tool_choice.name' {name!r} is not among 'tools'", param="tool_choice.name")
    return specs, ToolChoice("named", name, parallel=False)


#: ``thinking.budget_tokens`` below these many tokens asks for low, then medium reasoning effort; high above
EFFORT_BUDGETS = ((8192, "low"), (24576, "medium"))
MIN_THINKING_BUDGET = 1024   # Anthropic's own minimum


def thinking_kwargs(thinking: Any) -> dict[str, Any]:
    """``thinking`` → template arguments: ``enable_thinking`` (off for ``disabled``) and ``reasoning_effort`` from
    ``budget_tokens`` (:data:`EFFORT_BUDGETS`; ``disabled`` asks for low: harmony always reasons, least then;
    ``adaptive`` leaves the default). Raises InvalidRequest naming the field."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False, "reasoning_effort": "low"}
    if kind == "adaptive":
        return {"enable_thinking": True}
    if kind != "enabled":
        raise InvalidRequest(f"'thinking.type' must be 'enabled', 'disabled' or 'adaptive'; got {kind!r}",
                             param="thinking.type")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
        raise InvalidRequest(f"'thinking.budget_tokens' must be an integer of at least {MIN_THINKING_BUDGET}; got "
                             f"{budget!r}", param="thinking.budget_tokens")
    effort = next((e for limit, e in EFFORT_BUDGETS if budget < limit), "high")
    return {"enable_thinking": True, "reasoning_effort": effort}


def job_from_messages(req: MessagesRequest) -> ChatJob:
    """A Messages request → ChatJob. Raises InvalidRequest naming the field."""
    messages = convert_messages(req)
    tools, choice = convert_tools(req.tools, req.tool_choice)
    kwargs = thinking_kwargs(req.thinking)
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p), top_k=-1 if req.top_k is None else int(req.top_k),
        max_tokens=req.max_tokens, stop=list(req.stop_sequences or []))
    if req.temperature is not None and not 0 <= req.temperature <= 1:
        raise InvalidRequest(f"'temperature' must be in [0, 1], got {req.temperature}", param="temperature")
    params.validate()
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    job = ChatJob(messages, params, tools, choice, kwargs, add_generation_prompt=not prefill,
                  continue_final_message=prefill, stream=bool(req.stream), unknown_fields=req.unknown_fields())
    return job


# ---------------------------------------------------------------------------------------------------------
# response
# ---------------------------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: BaseException, status: int | None = None) -> dict:
    """Anthropic's error object for ``exc``."""
    status = status or status_for(exc)
    message = error_payload(exc)["error"]["message"]
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(exc: BaseException, rid: str | None = None) -> Response:
    """An Anthropic-shaped error response (status, Retry-After and x-request-id as for OpenAI routes; a body over
    the size limit is ``request_too_large``, 413)."""
    base = openai_error_response(exc, rid)   # logs, status, headers
    status = base.status_code
    headers = {k: v for k, v in base.headers.items() if k.lower() in ("retry-after", "x-request-id",
                                                                      "www-authenticate")}
    return JSONResponse(error_body(exc, status), status_code=status, headers=headers)


def _tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def stop_reason(finish: str | None, matched: str | None) -> tuple[str, str | None]:
    """Engine/turn finish reason → Anthropic ``(stop_reason, stop_sequence)``."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if matched is not None:
        return "stop_sequence", matched
    return "end_turn", None


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens`` those
    served from the prefix cache (their sum is the prompt), no cache writes are billed apart."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class StreamEncoder:
    """Turns :class:`TurnDelta` s into Anthropic stream events (one open content block at a time)."""

    message: dict
    index: int = -1
    open: str | None = None
    events: list[str] = field(default_factory=list)

    def start(self) -> str:
        return _event("message_start", {"type": "message_start", "message": self.message})

    def _block(self, kind: str, block: dict) -> None:
        if self.open == kind and kind != "tool_use":
            return
        self._close()
        self.index += 1
        self.open = kind
        self.events.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                          "content_block": block}))

    def _close(self) -> None:
        if self.open is not None:
            self.events.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None

    def _delta(self, delta: dict) -> None:
        self.events.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                          "delta": delta}))

    def feed(self, d: TurnDelta) -> list[str]:
        if d.reasoning:
            self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._delta({"type": "thinking_delta", "thinking": d.reasoning})
        if d.content:
            self._block("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": d.content})
        for part in d.calls:   # a call is one tool_use block: opened by its first part, closed by its last
            if part.first:
                call = part.call
                self._block("tool_use", {"type": "tool_use", "id": _tool_id(call), "name": call.name, "input": {}})
            if part.arguments:
                self._delta({"type": "input_json_delta", "partial_json": part.arguments})
            if part.done:
                self._close()
        out, self.events = self.events, []
        return out

    def finish(self, reason: str, sequence: str | None, output_tokens: int,
               usage: dict | None = None) -> list[str]:
        """The closing events; ``usage``: the whole usage (input and cache figures known by now) for the
        ``message_delta``, else only ``output_tokens``."""
        self._close()   # an empty reply has no block: an empty text block is refused when sent back
        self.events.append(_event("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": reason, "stop_sequence": sequence},
            "usage": usage if usage is not None else {"output_tokens": output_tokens}}))
        self.events.append(_event("message_stop", {"type": "message_stop"}))
        out, self.events = self.events, []
        return out


# ---------------------------------------------------------------------------------------------------------
# routes
# ---------------------------------------------------------------------------------------------------------


async def messages(ctx: RouteContext, request: Request, rid: str) -> Response:
    """POST /v1/messages (stream and non-stream). ``ctx``: the app's :class:`RouteContext`."""
    req: MessagesRequest = parse_request(MessagesRequest, await read_json(request))
    model = ctx.check_model(req.model)
    job = await off_loop(job_from_messages, req)   # grammars compile off the event loop
    msg_id = f"msg_{uuid.uuid4().hex}"
    run = await ctx.run_chat(request, rid, job, "messages", msg_id)
    base = {"id": msg_id, "type": "message", "role": "assistant", "model": model}
    if req.stream:
        return SSEResponse(_stream(ctx, rid, run, base), headers=SSE_HEADERS)
    (ch,) = run.gen.choices
    res = whole_turn(run.turn, ch.text.text, ch.finish_reason, ch.token_ids, ch.token_offsets)
    content: list[dict] = []
    for kind, x in res.blocks:   # in generation order
        if kind == "reasoning":
            content.append({"type": "thinking", "thinking": x, "signature": ""})
        elif kind == "text":
            content.append({"type": "text", "text": x})
        else:
            content.append({"type": "tool_use", "id": _tool_id(x), "name": x.name, "input": x.arguments_object()})
    reason, seq = stop_reason(res.finish_reason, ch.text.stops.matched)
    ctx.log_done(rid, run.gen, _openai_usage(run))
    return JSONResponse({**base, "content": content, "stop_reason": reason, "stop_sequence": seq,
                         "usage": _usage(len(run.prompt_ids), run.gen.completion_tokens, run.gen.cached_tokens)})


def _openai_usage(run: ChatRun) -> Any:
    return UsageInfo.of(len(run.prompt_ids), run.gen.completion_tokens, run.gen.cached_tokens)


async def _stream(ctx: RouteContext, rid: str, run: ChatRun, base: dict) -> AsyncIterator[str]:
    """The event sequence. ``message_start`` carries the prompt's cache figures, which come with the engine's
    first output: until it arrives (a long prefill, a busy engine) the stream sends SSE comments only, the first
    one with the headers; ``ping`` events after ``message_start``."""
    gen = run.gen
    try:
        if ctx.ping_interval:
            yield SSE_PING
        first = await gen.next_or_ping(ctx.ping_interval)
        while first is PING:
            yield SSE_PING
            first = await gen.next_or_ping(ctx.ping_interval)
        enc = StreamEncoder({**base, "content": [], "stop_reason": None, "stop_sequence": None,
                             "usage": _usage(len(run.prompt_ids), 0, gen.cached_tokens)})
        yield enc.start()
        async for d in turn_deltas(gen, run.turn, ctx.ping_interval, first=first):
            if d is PING:
                yield _event("ping", {"type": "ping"})
                continue
            assert isinstance(d, TurnDelta)
            for e in enc.feed(d):
                yield e
            if d.finish_reason is not None:
                reason, seq = stop_reason(d.finish_reason, gen.choices[0].text.stops.matched)
                for e in enc.finish(reason, seq, gen.completion_tokens,
                                    _usage(len(run.prompt_ids), gen.completion_tokens, gen.cached_tokens)):
                    yield e
        ctx.log_done(rid, gen, _openai_usage(run))
    except Exception as e:  # noqa: BLE001 - after the headers an error can only be an event
        ctx.stream_error(rid, e)   # logs and counts it
        yield _event("error", error_body(e))
    finally:
        await gen.close()


async def count_tokens(ctx: RouteContext, request: Request, rid: str) -> Response:
    """POST /v1/messages/count_tokens: ``{"input_tokens": N}`` for the prompt the request would render."""
    req: CountTokensRequest = parse_request(CountTokensRequest, await read_json(request))
    ctx.check_model(req.model)
    if req.max_tokens is None:
        req = req.model_copy(update={"max_tokens": 1})
    job = await off_loop(job_from_messages, req)
    _, ids = await off_loop(render_prompt, ctx.codec, job, native_tools=ctx.chat_format.native_tools,
                            tool_format=ctx.chat_format.tool_parser)
    return JSONResponse({"input_tokens": len(ids)})
