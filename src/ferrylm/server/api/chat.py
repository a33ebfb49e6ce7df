"""POST /v1/chat/completions, and the turning of its request into the chat job every chat-like surface (chat
completions, Anthropic Messages, the Responses API) is run as.

:class:`~ferrylm.server.api.context.ChatJob` is a request in the server's own terms: template messages, tools and
``tool_choice``, sampling parameters (``grammar`` set for structured output or a forced tool call), template
switches. The surface modules build one from their request shape; ``RouteContext.run_chat`` (server/api/context.py,
implemented by server/api/app.py) renders, admits and starts it; the surface encodes the
:class:`~ferrylm.server.api.assistant.TurnDelta` s of the shared loop in its own wire format.

This module must not import torch.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ferrylm.errors import InvalidRequest
from ferrylm.server.api.assistant import TurnDelta, turn_deltas, whole_turn
from ferrylm.server.api.generation import PING, SSE_PING, SSEResponse
from ferrylm.server.api.chat_protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionChunk,
                                              ChatCompletionRequest, ChatCompletionResponse,
                                              ChatCompletionStreamChoice, ChatMessage, ChatResponseMessage,
                                              DeltaMessage, FunctionCall, ToolCallOut, chat_logprobs,
                                              to_sampling_params)
from ferrylm.server.api.protocol import UsageInfo, chunk_json, parse_request
from ferrylm.server.api.context import ChatJob, ChatRun, RouteContext
from ferrylm.server.api.request_io import read_json
from ferrylm.server.text.reasoning import check_reasoning_effort
from ferrylm.server.text.structured import request_grammar, response_format_prompt
from ferrylm.server.text.tool_parsers.base import ToolCall
from ferrylm.server.text.json_limits import loads_json
from ferrylm.server.text.tools import check_tool_result, fallback_messages, parse_openai_tools, parse_tool_choice
from ferrylm.server.text.tokenizer import TextCodec, client_template_kwargs


async def off_loop(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a worker thread (templates, tokenization, grammar compilation: a large
    prompt or schema must not stall the event loop). Exceptions propagate unchanged."""
    import functools

    import anyio

    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def check_continue(messages: list[dict], continue_final: bool, add_generation_prompt: bool | None,
                   param: str = "continue_final_message") -> bool:
    """Validate vLLM's ``continue_final_message``; return the effective ``add_generation_prompt``.

    Raises InvalidRequest: both switches on, or the last message is not the assistant's."""
    if not continue_final:
        return add_generation_prompt is not False
    if add_generation_prompt:
        raise InvalidRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                             param=param)
    if not messages or messages[-1].get("role") != "assistant":
        raise InvalidRequest("'continue_final_message' needs the last message to be the assistant's", param=param)
    return False


def render_prompt(codec: TextCodec, job: ChatJob, *, native_tools: bool,
                  tool_format: str = "hermes") -> tuple[str, list[int]]:
    """The prompt text and ids of ``job``: tools through the template when it renders them, else (when tools are
    offered) the fallback of :func:`ferrylm.server.text.tools.fallback_messages` in the served call format
    ``tool_format``; without tools the messages reach the template as they are. Raises InvalidRequest for
    template errors."""
    messages, tools = job.messages, None
    offered = job.tools if job.tool_choice.mode != "none" else []
    if native_tools:
        tools = [t.openai() for t in offered] or None
    elif offered:
        messages = fallback_messages(messages, offered, tool_format)
    kw = dict(continue_final_message=job.continue_final_message, **job.template_kwargs)
    text = codec.render_chat(messages, job.add_generation_prompt, tools, **kw)
    # the ids: the template's markup as special tokens, special-token strings in client text as text
    return text, codec.apply_chat_template(messages, job.add_generation_prompt, tools, **kw)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template wants them: content parts joined into one string, ``developer`` →
    ``system``. Raises InvalidRequest for non-text content parts and for a system / user message without content
    (an assistant message may have none: tool calls)."""
    out, call_ids = [], set()
    for i, m in enumerate(messages):
        d: dict[str, Any] = dict(m.model_extra or {})
        d["role"] = "system" if m.role == "developer" else m.role
        content = m.content
        if content is None and m.role in ("system", "developer", "user"):
            raise InvalidRequest(f"'messages.{i}.content' is required for a {m.role} message (a string or a list of "
                                 f"text parts)", param=f"messages.{i}.content")
        if isinstance(content, list) and not content and not (m.role == "assistant" and m.tool_calls):
            raise InvalidRequest(f"'messages.{i}.content' is an empty list; give at least one content part or a "
                                 f"string", param=f"messages.{i}.content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type not in ("text", "input_text"):
                    raise InvalidRequest(f"content part type {part.type!r} is not supported; only text parts are",
                                         param=f"messages.{i}.content.{j}")
                if part.text is None:
                    raise InvalidRequest(f"content part of type {part.type!r} has no 'text'",
                                         param=f"messages.{i}.content.{j}.text")
                texts.append(part.text)
            content = "\n".join(texts)
        d["content"] = content if content is not None else ""
        for k in ("name", "tool_call_id", "tool_calls", "reasoning_content"):
            v = getattr(m, k)
            if v is not None:
                d[k] = v
        if m.tool_calls is not None:
            d["tool_calls"] = [_history_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)]
            call_ids.update(c["id"] for c in d["tool_calls"] if isinstance(c.get("id"), str))
        if m.role == "tool" and isinstance(m.tool_call_id, str):
            check_tool_result(m.tool_call_id, call_ids, f"messages.{i}.tool_call_id",
                              "assistant tool call ('messages.N.tool_calls.M.id')")
        out.append(d)
    return out


def _history_call(call: dict, param: str) -> dict:
    """An earlier assistant tool call, checked: ``{"id", "type": "function", "function": {"name", "arguments"}}``
    with ``arguments`` a JSON object (text or object). Templates get the arguments as an object."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"'{param}.function.name' is required", param=f"{param}.function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        args = loads_json(args, f"{param}.function.arguments") if args.strip() else {}
    if not isinstance(args, dict):
        raise InvalidRequest(f"'{param}.function.arguments' must be a JSON object",
                             param=f"{param}.function.arguments")
    return {**call, "type": "function", "function": {**fn, "arguments": args}}


def job_from_chat(req: ChatCompletionRequest) -> ChatJob:
    """A chat completions request → ChatJob (validates tools, tool_choice, output constraints).
    Raises InvalidRequest naming the field."""
    params = to_sampling_params(req)
    grammar, gparam = request_grammar(req)
    params.grammar = grammar
    tools = parse_openai_tools(req.tools)
    choice = parse_tool_choice(req.tool_choice, tools, parallel=req.parallel_tool_calls)
    messages = template_messages(req.messages)
    add_gen = check_continue(messages, bool(req.continue_final_message), req.add_generation_prompt
                             if "add_generation_prompt" in req.model_fields_set else None)
    kwargs = client_template_kwargs(req.chat_template_kwargs)
    effort = check_reasoning_effort(req.reasoning_effort, "reasoning_effort")
    if effort is not None:   # the template argument harmony's system message (and gpt-oss templates) read
        kwargs["reasoning_effort"] = effort
    reply = response_format_prompt(req.response_format)
    if reply is not None:   # the reply's schema, for the formats that show it in the prompt
        kwargs = {"response_format": reply, **kwargs}
    job = ChatJob(messages, params, tools, choice, kwargs, add_gen, bool(req.continue_final_message), gparam,
                  "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                  stream=bool(req.stream), unknown_fields=req.unknown_fields())
    return job


def out_calls(calls: list[ToolCall]) -> list[ToolCallOut] | None:
    return [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None


async def chat_completions(ctx: RouteContext, request: Request, rid: str) -> Response:
    """POST /v1/chat/completions (stream and non-stream). ``ctx``: the app's :class:`RouteContext`."""
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await read_json(request))
    model = ctx.check_model(req.model)
    job = await off_loop(job_from_chat, req)   # schemas and grammars compile off the event loop
    base_id = f"chatcmpl-{uuid.uuid4().hex}"
    run = await ctx.run_chat(request, rid, job, "chat", base_id)
    created = int(time.time())
    if req.stream:
        return SSEResponse(_stream(ctx, rid, run, base_id, created, model, req), headers=SSE_HEADERS)
    choices = []
    reasoning_tokens = 0
    for ch in run.gen.choices:
        res = whole_turn(run.turn, ch.text.text, ch.finish_reason, ch.token_ids, ch.token_offsets)
        reasoning_tokens += res.reasoning_tokens
        lp = None
        if ch.params.logprobs is not None:
            lp = ChatChoiceLogprobs(content=chat_logprobs(ch.logprobs, ctx.codec))
        # null when a tool call holds the reply, or was forced and cut before its name (nothing for the client)
        msg = ChatResponseMessage(content=res.content or (None if res.calls or run.turn.forced else ""),
                                  reasoning_content=res.reasoning or None, tool_calls=out_calls(res.calls))
        choices.append(ChatCompletionChoice(index=ch.index, message=msg, logprobs=lp, finish_reason=res.finish_reason,
                                            token_ids=list(ch.token_ids) if req.return_token_ids else None))
    usage = UsageInfo.of(len(run.prompt_ids), run.gen.completion_tokens, run.gen.cached_tokens, reasoning_tokens)
    ctx.log_done(rid, run.gen, usage)
    resp = ChatCompletionResponse(id=base_id, created=created, model=model, choices=choices, usage=usage,
                                  prompt_token_ids=list(run.prompt_ids) if req.return_token_ids else None)
    return Response(resp.model_dump_json(), media_type="application/json")


async def _stream(ctx: RouteContext, rid: str, run: ChatRun, base_id: str, created: int, model: str,
                  req: ChatCompletionRequest) -> AsyncIterator[str]:
    gen = run.gen
    include_usage, continuous = req.include_usage, req.continuous_usage
    want_ids = bool(req.return_token_ids)
    reasoning_tokens = 0   # the finished choices' (the count comes with a choice's last delta)

    def usage_now() -> UsageInfo:
        return UsageInfo.of(len(run.prompt_ids), gen.completion_tokens, gen.cached_tokens, reasoning_tokens)

    def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
        if usage is None and continuous and choices:
            usage = usage_now()
        c = ChatCompletionChunk(id=base_id, created=created, model=model, choices=choices, usage=usage)
        return f"data: {chunk_json(c, include_usage=include_usage or continuous)}\n\n"

    try:
        for ch in gen.choices:
            yield chunk([ChatCompletionStreamChoice(index=ch.index, delta=DeltaMessage(role="assistant", content=""))])
        async for d in turn_deltas(gen, run.turn, ctx.ping_interval):
            if d is PING:
                yield SSE_PING
                continue
            assert isinstance(d, TurnDelta)
            reasoning_tokens += d.reasoning_tokens
            for c in _delta_chunks(ctx, gen, d, want_ids):
                yield chunk([c])
        usage = usage_now()
        if include_usage:
            yield chunk([], usage)
        ctx.log_done(rid, gen, usage)
        yield DONE
    except Exception as e:  # noqa: BLE001 - after the headers an error can only be an event
        yield ctx.stream_error(rid, e)
        yield DONE
    finally:
        await gen.close()


def _delta_chunks(ctx: RouteContext, gen: Any, d: TurnDelta, want_ids: bool) -> list[ChatCompletionStreamChoice]:
    """A delta as stream choices: text / reasoning first, then per call part a header where the call begins (id,
    type, name, empty arguments) and its new arguments text, keyed by the call's ``index``; ``finish_reason`` on a
    last chunk of its own with an empty delta (unless the delta brings nothing else)."""
    logprobs = None
    if gen.choices[d.index].params.logprobs is not None:
        logprobs = ChatChoiceLogprobs(content=chat_logprobs(d.logprobs, ctx.codec))
    ids = list(d.token_ids) if want_ids else None
    out = []
    carried = any(p.first or p.arguments for p in d.calls)   # a call chunk carries the logprobs and ids
    if d.content or d.reasoning or logprobs is not None and d.logprobs or not d.calls or (ids and not carried):
        out.append(ChatCompletionStreamChoice(index=d.index, delta=DeltaMessage(
            content=d.content or None, reasoning_content=d.reasoning or None), logprobs=logprobs, token_ids=ids))
        logprobs, ids = None, None
    for part in d.calls:
        k, call = part.index, part.call
        if part.first:
            out.append(ChatCompletionStreamChoice(index=d.index, delta=DeltaMessage(tool_calls=[
                {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]),
                logprobs=logprobs, token_ids=ids))
            logprobs, ids = None, None
        if part.arguments:
            out.append(ChatCompletionStreamChoice(index=d.index, delta=DeltaMessage(tool_calls=[
                {"index": k, "function": {"arguments": part.arguments}}]), logprobs=logprobs, token_ids=ids))
            logprobs, ids = None, None
    if d.finish_reason is not None:   # the finishing chunk carries no text (as OpenAI's and llama.cpp's)
        last = out[-1] if out else None
        if (last is not None and last.delta == DeltaMessage() and last.logprobs is None
                and last.token_ids is None):
            last.finish_reason = d.finish_reason
        else:
            out.append(ChatCompletionStreamChoice(index=d.index, delta=DeltaMessage(),
                                                  finish_reason=d.finish_reason))
    return out
