"""OpenAI Responses API: ``POST /v1/responses`` and ``GET /v1/responses/{id}`` (what Codex and the ``openai``
SDK's ``client.responses`` send).

Request → :class:`~ferrylm.server.api.chat.ChatJob`: ``instructions`` is the system turn (not carried to later turns,
as OpenAI has it); ``input`` is text (one user turn) or items: messages (``input_text`` / ``output_text`` parts),
``function_call`` (an assistant tool call) and ``function_call_output`` (a tool turn); ``reasoning`` items are
skipped. ``previous_response_id`` prepends the conversation of a stored response (its input and output);
responses are kept in a bounded in-memory store (``response_store.py``: ``--responses-store-size`` entries and
256 MiB, oldest evicted first; ``store: false`` keeps none); an unknown id is a 400 naming ``previous_response_id``.
A ``function_call_output`` must answer an earlier ``function_call`` (a 400 naming its ``call_id``). Function ``tools``
and ``tool_choice`` use the shared tool machinery; ``text.format`` (``json_object`` / ``json_schema``) is
enforced by a grammar; ``max_output_tokens``, ``temperature``, ``top_p`` map as named, ``reasoning.effort`` (low |
medium | high) is the template argument ``reasoning_effort``.

Output items: ``reasoning`` (``reasoning_text`` content), ``message`` (``output_text``), ``function_call``.
Stream: ``response.created``, ``response.in_progress``, per item ``response.output_item.added``, its deltas
(``response.reasoning_text.delta``, ``response.content_part.added`` + ``response.output_text.delta`` + ``.done``,
``response.function_call_arguments.delta`` + ``.done``), ``response.output_item.done``, then
``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``); every event carries
``sequence_number``; an error after the start is an ``error`` event. Errors before it use the OpenAI shape.

This module must not import torch.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Protocol, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import InvalidRequest, NotFound
from ferrylm.server.api.assistant import TurnDelta, turn_deltas, whole_turn
from ferrylm.server.api.chat import SSE_HEADERS, off_loop
from ferrylm.server.api.generation import PING, SSE_PING, SSEResponse
from ferrylm.server.api.errors import error_payload
from ferrylm.server.api.protocol import UsageInfo, _Request, parse_request
from ferrylm.server.api.context import ChatJob, ChatRun, RouteContext
from ferrylm.server.api.request_io import read_json
from ferrylm.server.api.response_store import ResponseStore, StoredResponse
from ferrylm.server.text.reasoning import check_reasoning_effort
from ferrylm.server.text.structured import response_format_grammar, response_format_prompt
from ferrylm.server.text.tool_parsers.base import ToolCall
from ferrylm.server.text.json_limits import loads_json
from ferrylm.server.text.tools import ToolSpec, check_tool_result, check_unique, make_tool, parse_tool_choice


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    previous_response_id: Optional[str] = None
    store: Optional[bool] = True
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None


# ---------------------------------------------------------------------------------------------------------
# request → job
# ---------------------------------------------------------------------------------------------------------


def _part_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"'{param}' must be a string or a list of content parts", param=param)
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(p.get("text"), str):
            raise InvalidRequest(f"'{param}.{j}.type' {kind!r} is not supported (only text parts are)",
                                 param=f"{param}.{j}.type")
        out.append(p["text"])
    return "\n".join(out)


def convert_input(items: Any, history: list[dict] = ()) -> list[dict]:
    """``input`` (text or items) → template messages; ``history``: the conversation it continues (a stored
    response's), whose calls its ``function_call_output`` items may answer. Raises InvalidRequest naming the
    item (an output whose ``call_id`` answers no earlier ``function_call`` too)."""
    if isinstance(items, str):   # "" is no turn, as [] is (both a 400 without a previous response)
        return [{"role": "user", "content": items}] if items else []
    out: list[dict] = []
    call_ids = {c.get("id") for m in history for c in m.get("tool_calls") or ()}
    for i, it in enumerate(items):
        where = f"input.{i}"
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"'{where}.role' must be user, system, developer or assistant; got {role!r}",
                                     param=f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _part_text(it.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args = it.get("name"), it.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(it.get("call_id"), str):
                raise InvalidRequest(f"'{where}' needs 'name' and 'call_id'", param=where)
            parsed = loads_json(args, f"{where}.arguments") if isinstance(args, str) else args
            if not isinstance(parsed, dict):
                raise InvalidRequest(f"'{where}.arguments' must be a JSON object", param=f"{where}.arguments")
            call = {"id": it["call_id"], "type": "function", "function": {"name": name, "arguments": parsed}}
            call_ids.add(it["call_id"])
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise InvalidRequest(f"'{where}.call_id' is required", param=f"{where}.call_id")
            check_tool_result(it["call_id"], call_ids, f"{where}.call_id", "'function_call' item's 'call_id'")
            output = it.get("output", "")
            output = output if isinstance(output, str) else _part_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequest(f"'{where}.type' {kind!r} is not supported (message, function_call, "
                                 f"function_call_output and reasoning items are)", param=f"{where}.type")
    return out


def convert_tools(tools: Any) -> list[ToolSpec]:
    """Responses ``tools`` (``{"type": "function", "name", "description", "parameters", "strict"}``)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise InvalidRequest(f"'tools.{i}.type' {kind!r} is not supported (only function tools are)",
                                 param=f"tools.{i}.type")
        out.append(make_tool(t.get("name"), t.get("description"), t.get("parameters"), t.get("strict"),
                             f"tools.{i}"))
    check_unique(out, "tools")
    return out


def job_from_request(req: ResponsesRequest, store: ResponseStore) -> tuple[ChatJob, list[dict]]:
    """A Responses request → ``(ChatJob, conversation without instructions)``. Raises InvalidRequest."""
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise InvalidRequest(f"no stored response with id {req.previous_response_id!r} (it was never stored, "
                                 f"or was evicted)", param="previous_response_id")
        history = list(prev.conversation)
    conversation = history + convert_input(req.input, history)
    if not conversation:
        raise InvalidRequest("'input' must not be empty", param="input")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tools = convert_tools(req.tools)
    choice = parse_tool_choice(req.tool_choice, tools, parallel=req.parallel_tool_calls)
    fmt = (req.text or {}).get("format") if isinstance(req.text, dict) else None
    params = SamplingParams(temperature=1.0 if req.temperature is None else float(req.temperature),
                            top_p=1.0 if req.top_p is None else float(req.top_p), max_tokens=req.max_output_tokens)
    try:
        params.validate()
    except InvalidRequest as e:
        if e.param == "max_tokens":
            e.rename_param("max_output_tokens")
        raise
    params.grammar = response_format_grammar(fmt, "text.format", nested=False)
    effort = check_reasoning_effort((req.reasoning or {}).get("effort"), "reasoning.effort")
    reply = response_format_prompt(fmt, nested=False)
    kwargs = {**({"response_format": reply} if reply else {}), **({"reasoning_effort": effort} if effort else {})}
    job = ChatJob(messages, params, tools, choice, kwargs, grammar_param=
                  "text.format", max_param="max_output_tokens", prompt_param="input", stream=bool(req.stream),
                  unknown_fields=req.unknown_fields())
    return job, conversation


# ---------------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------------


def _ids() -> str:
    return uuid.uuid4().hex


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: ToolCall, status: str | None = None, arguments: str | None = None) -> dict:
    """A ``function_call`` item; its status by default ``completed``, ``incomplete`` for a call the output ended
    in (its ``arguments`` the JSON text generated so far)."""
    status = status or ("completed" if call.complete else "incomplete")
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if arguments is None else arguments, "status": status}


class ResponsesContext(RouteContext, Protocol):
    """What the Responses routes use of the app: the route context and the store of earlier responses
    (``previous_response_id``)."""

    responses: ResponseStore


@dataclass
class ResponseShell:
    """The parts of a response object that do not depend on the output."""

    id: str
    created_at: int
    model: str
    req: ResponsesRequest
    prompt_tokens: int = 0

    def object(self, status: str, output: list[dict], output_tokens: int = 0,
               incomplete: bool = False, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
        """The response object; ``cached_tokens``: prompt tokens served from the prefix cache;
        ``reasoning_tokens``: output tokens that were reasoning."""
        r = self.req
        fmt = (r.text or {}).get("format") if isinstance(r.text, dict) else None
        usage = None
        if status != "in_progress":
            usage = {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
                     "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                     "total_tokens": self.prompt_tokens + output_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id, "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None},
                "store": r.store is not False, "temperature": 1.0 if r.temperature is None else r.temperature,
                "text": {"format": fmt or {"type": "text"}}, "tool_choice": r.tool_choice or "auto",
                "tools": r.tools or [], "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled",
                "usage": usage, "user": r.user, "metadata": r.metadata or {}}


def output_items(blocks: list[tuple[str, Any]], incomplete: bool = False) -> list[dict]:
    """A whole turn's output items in generation order (``TurnResult.blocks``); a turn of no text and no call
    still has its (empty) message. ``incomplete``: the turn hit its token limit, so its last message is
    ``incomplete``, as OpenAI marks it."""
    items = []
    for i, (kind, x) in enumerate(blocks):
        if kind == "reasoning":
            items.append(_reasoning_item(f"rs_{_ids()}", x))
        elif kind == "text":
            last = incomplete and i == len(blocks) - 1
            items.append(_message_item(f"msg_{_ids()}", x, "incomplete" if last else "completed"))
        else:
            items.append(_call_item(x))
    if not any(it["type"] in ("message", "function_call") for it in items):
        items.append(_message_item(f"msg_{_ids()}", ""))
    return items


def conversation_of(output: list[dict]) -> list[dict]:
    """A response's output items as the assistant turn to continue from."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for it in output:
        if it["type"] == "message":
            msg["content"] += "".join(p["text"] for p in it["content"])
        elif it["type"] == "reasoning":
            msg["reasoning_content"] = "".join(p["text"] for p in it.get("content", []))
        elif it["type"] == "function_call":
            call = ToolCall(it["name"], it["arguments"], it["call_id"], complete=it["status"] != "incomplete")
            msg.setdefault("tool_calls", []).append({"id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments_object()}})
    return [msg]


@dataclass
class StreamEncoder:
    """Turns :class:`TurnDelta` s into Responses stream events; one output item open at a time."""

    shell: ResponseShell
    seq: int = 0
    output: list[dict] = field(default_factory=list)
    open: dict | None = None
    text: str = ""

    def event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        r = self.shell.object("in_progress", [])
        return [self.event("response.created", response=r), self.event("response.in_progress", response=r)]

    def _open(self, kind: str) -> list[str]:
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close()
        idx = len(self.output)
        if kind == "message":
            self.open = {"type": "message", "id": f"msg_{_ids()}", "status": "in_progress", "role": "assistant",
                         "content": []}
            out.append(self.event("response.output_item.added", output_index=idx, item=self.open))
            out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=idx,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        else:
            self.open = {"type": "reasoning", "id": f"rs_{_ids()}", "summary": [], "content": []}
            out.append(self.event("response.output_item.added", output_index=idx, item=self.open))
        self.text = ""
        return out

    def _close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        if self.open["type"] == "function_call":   # a call still open ends as far as it came
            return self._close_call(ToolCall(self.open["name"], self.text, self.open["call_id"], complete=False))
        idx = len(self.output)
        item_id = self.open["id"]
        if self.open["type"] == "message":
            item = _message_item(item_id, self.text, status)
            part = item["content"][0]
            out = [self.event("response.output_text.done", item_id=item_id, output_index=idx, content_index=0,
                              text=self.text, logprobs=[]),
                   self.event("response.content_part.done", item_id=item_id, output_index=idx, content_index=0,
                              part=part)]
        else:
            item = _reasoning_item(item_id, self.text)
            out = [self.event("response.reasoning_text.done", item_id=item_id, output_index=idx, content_index=0,
                              text=self.text)]
        out.append(self.event("response.output_item.done", output_index=idx, item=item))
        self.output.append(item)
        self.open = None
        return out

    def feed(self, d: TurnDelta) -> list[str]:
        out: list[str] = []
        if d.reasoning:
            out += self._open("reasoning")
            self.text += d.reasoning
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.output), content_index=0, delta=d.reasoning))
        if d.content:
            out += self._open("message")
            self.text += d.content
            out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.output), content_index=0, delta=d.content, logprobs=[]))
        for part in d.calls:   # a call is one function_call item: added at its first part, done at its last
            if part.first:
                out += self._close()
                self.open = _call_item(part.call, "in_progress", arguments="")
                self.text = ""
                out.append(self.event("response.output_item.added", output_index=len(self.output), item=self.open))
            if part.arguments and self.open is not None:
                self.text += part.arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=len(self.output), delta=part.arguments))
            if part.done:
                out += self._close_call(part.call)
        return out

    def _close_call(self, call: ToolCall) -> list[str]:
        """The open ``function_call`` item's last events; ``call``: the call as released."""
        idx, item_id = len(self.output), self.open["id"] if self.open is not None else ""
        item = _call_item(call)
        out = [self.event("response.function_call_arguments.done", item_id=item_id, output_index=idx,
                          arguments=call.arguments, name=call.name),
               self.event("response.output_item.done", output_index=idx, item=item)]
        self.output.append(item)
        self.open = None
        return out

    def finish(self, output_tokens: int, incomplete: bool, cached_tokens: int = 0,
               reasoning_tokens: int = 0) -> tuple[list[str], dict]:
        out = []
        if not self.output and self.open is None:   # an empty reply is one empty message
            out += self._open("message")
        out += self._close("incomplete" if incomplete else "completed")
        final = self.shell.object("incomplete" if incomplete else "completed", self.output, output_tokens,
                                  incomplete, cached_tokens, reasoning_tokens)
        out.append(self.event("response.incomplete" if incomplete else "response.completed", response=final))
        return out, final


# ---------------------------------------------------------------------------------------------------------
# routes
# ---------------------------------------------------------------------------------------------------------


async def create(ctx: ResponsesContext, request: Request, rid: str) -> Response:
    """POST /v1/responses (stream and non-stream). ``ctx``: the app's :class:`ResponsesContext` (``ctx.responses``
    is its :class:`ResponseStore`)."""
    req: ResponsesRequest = parse_request(ResponsesRequest, await read_json(request))
    model = ctx.check_model(req.model)
    job, conversation = await off_loop(job_from_request, req, ctx.responses)
    resp_id = f"resp_{_ids()}"
    run = await ctx.run_chat(request, rid, job, "responses", resp_id)
    shell = ResponseShell(resp_id, int(time.time()), model, req, len(run.prompt_ids))
    if req.stream:
        return SSEResponse(_stream(ctx, rid, run, shell, conversation), headers=SSE_HEADERS)
    (ch,) = run.gen.choices
    res = whole_turn(run.turn, ch.text.text, ch.finish_reason, ch.token_ids, ch.token_offsets)
    output = output_items(res.blocks, incomplete=res.finish_reason == "length")
    final = shell.object("incomplete" if res.finish_reason == "length" else "completed", output,
                         run.gen.completion_tokens, res.finish_reason == "length", run.gen.cached_tokens,
                         res.reasoning_tokens)
    _remember(ctx, req, final, conversation)
    ctx.log_done(rid, run.gen, _usage(run))
    return JSONResponse(final)


def _usage(run: ChatRun) -> Any:
    return UsageInfo.of(len(run.prompt_ids), run.gen.completion_tokens)


def _remember(ctx: ResponsesContext, req: ResponsesRequest, final: dict, conversation: list[dict]) -> None:
    if req.store is not False:
        ctx.responses.put(final["id"], StoredResponse(final, conversation + conversation_of(final["output"])))


async def _stream(ctx: ResponsesContext, rid: str, run: ChatRun, shell: ResponseShell,
                  conversation: list[dict]) -> AsyncIterator[str]:
    gen = run.gen
    enc = StreamEncoder(shell)
    try:
        for e in enc.start():
            yield e
        async for d in turn_deltas(gen, run.turn, ctx.ping_interval):
            if d is PING:
                yield SSE_PING
                continue
            assert isinstance(d, TurnDelta)
            for e in enc.feed(d):
                yield e
            if d.finish_reason is not None:
                events, final = enc.finish(gen.completion_tokens, d.finish_reason == "length", gen.cached_tokens,
                                           d.reasoning_tokens)
                _remember(ctx, shell.req, final, conversation)
                for e in events:
                    yield e
        ctx.log_done(rid, gen, _usage(run))
    except Exception as e:  # noqa: BLE001 - after the headers an error can only be an event
        ctx.stream_error(rid, e)
        err = error_payload(e)["error"]
        yield enc.event("error", code=err["code"], message=err["message"], param=err["param"])
    finally:
        await gen.close()


async def retrieve(ctx: ResponsesContext, request: Request, rid: str, response_id: str) -> Response:
    """GET /v1/responses/{id}: a stored response, 404 when unknown or evicted."""
    entry = ctx.responses.get(response_id)
    if entry is None:
        raise NotFound(f"no stored response with id {response_id!r} (never stored, or evicted)",
                       param="response_id", code="response_not_found")
    return JSONResponse(entry.response)
