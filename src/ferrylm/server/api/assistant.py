"""An assistant turn as every chat-like API sees it: reasoning, text and tool calls, released as they become certain.

Shared by chat completions, Anthropic Messages and the Responses API: each turns the same :class:`TurnDelta` s into
its own wire format. :func:`turn_deltas` is the one stream loop: it drains a
:class:`~ferrylm.server.api.generation.Generation`, runs each choice's output through its :class:`AssistantTurn`
and yields a delta per event, or :data:`PING` when nothing came for ``ping_interval`` seconds (the SSE layers write
a keep-alive then). A non-stream response runs the finished output through a fresh :class:`AssistantTurn` in one
piece: the readers decide on the output only, so it equals the stream (but for a call whose streamed start went
out before ``max_tokens`` cut it after a whole call: the stream ends it, the whole turn drops it). A call is released
whole, or streamed: its head, then its arguments as they are written (:class:`CallDelta`).

The turn's :class:`OutputReader` is the served chat format's: :class:`TextReader` (the text: ``<think>`` split, then
the tool-call parser) for chat templates, :class:`~ferrylm.server.text.harmony_reader.HarmonyReader` (the tokens, by
channel) for harmony (gpt-oss).

This module must not import torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, Sequence

from ferrylm.engine.outputs import TokenLogprob
from ferrylm.server.api.generation import PING, Event, Generation, Ping
from ferrylm.server.text.reasoning import ReasoningSplitter
from ferrylm.server.text.tool_parsers import make_tool_parser
from ferrylm.server.text.tool_parsers.base import Piece, ToolCall

if TYPE_CHECKING:
    from ferrylm.server.text.harmony import HarmonyCodec


@dataclass
class CallDelta:
    """What a delta adds to one call: ``index``, its position among the choice's calls (from 0); ``call``: its id
    and name (when ``done``, the call as released: whole, or unfinished where the output ended in it);
    ``arguments``: the next text of its arguments; ``first``: the call's first part (a client opens it there);
    ``done``: its last. A call released whole is one part, first and done, with all its arguments; a streamed
    call's parts' ``arguments`` join to the released call's."""

    index: int
    call: ToolCall
    arguments: str = ""
    first: bool = False
    done: bool = False


@dataclass
class TurnDelta:
    """What one event adds to choice ``index``: ``reasoning`` text, ``content`` text, parts of ``calls`` in order,
    the token ``logprobs``, and at the end ``finish_reason`` (``tool_calls`` when the turn made its calls) with the
    turn's ``reasoning_tokens``."""

    index: int
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    reasoning_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.calls or self.finish_reason is not None)


class OutputReader(Protocol):
    """A choice's output → pieces (reasoning text, content text, calls) in generation order, released as they
    become certain; a call the output ended in may come last, unfinished (``ToolCall.complete`` False). ``feed``
    gets each output's text and token ids; ``finish(cut)`` the end (``cut``: ``max_tokens`` ended the output).
    ``reasoning_tokens``: the tokens read so far that were reasoning."""

    reasoning_tokens: int

    def feed(self, text: str, token_ids: Sequence[int]) -> list[Piece]: ...

    def finish(self, cut: bool = False) -> list[Piece]: ...


@dataclass
class TurnConfig:
    """How a request's output is read: ``reasoning`` on (template with ``</think>``), whether the prompt opened
    the block already, the tool names to parse calls for (None: no tool parsing), the call format
    (``tool_parser``: a name of :data:`ferrylm.server.text.tool_parsers.TOOL_PARSERS`) and the tools' parameter
    schemas (``name -> schema``; the XML-style formats type argument values by them). ``forced``: a grammar forces
    the output to be calls (``tool_choice`` required or named), so a block the output ended in (``max_tokens``) is
    the call it was cut in: an unfinished call (``ToolCall.complete`` False, the arguments generated so far), never
    content. Without it such a block is content (it may be the model's prose). ``harmony``: the served harmony
    codec (then the output is read by channel, and ``harmony_prime`` is the prompt's open message); the reasoning
    and call-format fields are not used then. ``max_calls``: the calls a turn may make (1 with
    ``parallel_tool_calls: false``; None: any), later ones are dropped."""

    reasoning: bool = False
    starts_in_reasoning: bool = False
    tool_names: tuple[str, ...] | None = None
    tool_parser: str = "hermes"
    tool_schemas: dict[str, dict] | None = None
    forced: bool = False
    harmony: HarmonyCodec | None = None
    harmony_prime: tuple[int, ...] = ()
    max_calls: int | None = None

    def new_turn(self) -> "AssistantTurn":
        if self.harmony is not None:
            from ferrylm.server.text.harmony_reader import HarmonyReader

            return AssistantTurn(HarmonyReader(self.harmony, self.harmony_prime, self.tool_names), self.max_calls)
        return AssistantTurn(TextReader(self), self.max_calls)


class TextReader:
    """The output text of a chat template's model: the ``<think>`` split, then the tool-call parser. A token is a
    reasoning token when its output began or ended inside the ``<think>`` block (the tags count; its text may
    still be held back)."""

    def __init__(self, cfg: TurnConfig):
        self.reasoning = ReasoningSplitter(cfg.starts_in_reasoning) if cfg.reasoning else None
        self.tools = make_tool_parser(cfg.tool_parser, cfg.tool_names, cfg.tool_schemas) \
            if cfg.tool_names is not None else None
        self.forced = cfg.forced
        self.reasoning_tokens = 0

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[Piece]:
        r, c = "", text
        if self.reasoning is not None:
            before = self.reasoning.in_reasoning
            r, c = self.reasoning.feed(text) if text else ("", "")
            if before or self.reasoning.in_reasoning:
                self.reasoning_tokens += len(token_ids)
        if not text:
            return []
        return self._pieces(r, self.tools.feed(c) if self.tools is not None else [Piece(c)])

    def finish(self, cut: bool = False) -> list[Piece]:
        r, c = self.reasoning.finish() if self.reasoning is not None else ("", "")
        if self.tools is None:
            return self._pieces(r, [Piece(c)])
        end = self.tools.finish_forced if self.forced else self.tools.finish_cut if cut else self.tools.finish
        return self._pieces(r, self.tools.feed(c) + end())

    @staticmethod
    def _pieces(reasoning: str, pieces: list[Piece]) -> list[Piece]:
        return ([Piece(reasoning, reasoning=True)] if reasoning else []) + pieces


class AssistantTurn:
    """One choice's output → reasoning / content / calls, through its :class:`OutputReader`; calls past
    ``max_calls`` (None: no bound) are dropped, and so is an unfinished call after a whole one (the output was cut
    in a further call: the turn made its calls, as vLLM answers). A streamed call has its position from its head
    on; once its head went out it is never dropped, and when it ends unfinished the turn's finish reason is the
    engine's (``length``: the client holds a call it must not run, as OpenAI answers)."""

    def __init__(self, reader: OutputReader, max_calls: int | None = None):
        self.reader = reader
        self.max_calls = max_calls
        self.num_calls = 0
        self.whole_calls = 0
        self.cut_call = False       # the client got an unfinished call: its only call, or a streamed one cut
        self.ends_in_calls = False  # nothing but calls since the last whole call
        self._streamed: tuple[ToolCall, int | None] | None = None   # the call being streamed: head, position

    def feed(self, text: str, token_ids: Sequence[int] = (), index: int = 0) -> TurnDelta:
        return self._delta(index, self.reader.feed(text, token_ids))

    def finish(self, index: int = 0, cut: bool = False) -> TurnDelta:
        """The end of the choice; ``cut``: ``max_tokens`` ended it."""
        return self._delta(index, self.reader.finish(cut))

    def _delta(self, index: int, pieces: list[Piece]) -> TurnDelta:
        d = TurnDelta(index)
        for p in pieces:
            if p.head is not None:
                k = self._position()
                self._streamed = (p.head, k)
                if k is not None:
                    d.calls.append(CallDelta(k, p.head, first=True))
            elif p.args:
                head, k = self._streamed or (None, None)
                if head is not None and k is not None:
                    _add(d, CallDelta(k, head, p.args))
            elif p.call is not None:
                self._call(d, p.call)
            elif p.text:
                self.ends_in_calls = False
                if p.reasoning:
                    d.reasoning += p.text
                else:
                    d.content += p.text
        return d

    def _call(self, d: TurnDelta, call: ToolCall) -> None:
        """A released call into ``d``: the last part of the call being streamed, else the whole call."""
        if self._streamed is not None and self._streamed[0].id == call.id:
            k = self._streamed[1]
            self._streamed = None
            if k is not None:
                self.cut_call = self.cut_call or not call.complete   # its head went out already
                self._note(call)
                _add(d, CallDelta(k, call, done=True))
            return
        k = self.count(call)
        if k is not None:
            d.calls.append(CallDelta(k, call, call.arguments, first=True, done=True))

    def count(self, call: ToolCall) -> int | None:
        """Note a released call; its position among the turn's calls (from 0), None for a dropped one (past
        ``max_calls``, or unfinished after a whole call)."""
        if not call.complete and self.whole_calls:
            return None
        k = self._position()
        if k is not None:
            self._note(call)
        return k

    def _position(self) -> int | None:
        """The next call's position, None past ``max_calls``."""
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return None
        self.num_calls += 1
        return self.num_calls - 1

    def _note(self, call: ToolCall) -> None:
        if call.complete:
            self.whole_calls += 1
            self.ends_in_calls = True
        elif not self.whole_calls:
            self.cut_call = True

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` for a turn that made whole calls (none cut) and stopped by itself, or was cut by
        ``max_tokens`` with nothing but calls after its last whole call (a further call cut short is dropped,
        unless its head was streamed already); else the engine's reason."""
        if not self.whole_calls or self.cut_call:
            return engine_reason
        if engine_reason == "stop" or (engine_reason == "length" and self.ends_in_calls):
            return "tool_calls"
        return engine_reason


def _add(d: TurnDelta, part: CallDelta) -> None:
    """``part`` into ``d``, merged with the part before it when that is the same call's, still open."""
    last = d.calls[-1] if d.calls else None
    if last is None or last.index != part.index or last.done:
        d.calls.append(part)
        return
    last.arguments += part.arguments
    if part.done:
        last.call, last.done = part.call, True


@dataclass
class TurnResult:
    """A whole choice (non-stream). ``blocks``: the same parts in generation order, adjacent text merged:
    ``("reasoning", str)``, ``("text", str)``, ``("call", ToolCall)`` (Anthropic's content blocks and the
    Responses API's output items follow it: text before a tool call only when it was generated before it).
    ``reasoning_tokens``: the output's tokens that were reasoning (``usage``)."""

    reasoning: str
    content: str
    calls: list[ToolCall]
    finish_reason: str | None
    blocks: list[tuple[str, Any]] = field(default_factory=list)
    reasoning_tokens: int = 0


def whole_turn(cfg: TurnConfig, text: str, engine_reason: str | None, token_ids: Sequence[int] = (),
               offsets: Sequence[int] | None = None) -> TurnResult:
    """Split a finished choice's output (its released ``text`` and ``token_ids``) exactly as the stream would have.
    ``offsets``: where each token's text starts in the output (``Choice.token_offsets``); with them the reader is
    fed token by token (as a stream is), which the reasoning-token count needs; without, in one piece."""
    turn = cfg.new_turn()
    blocks: list[tuple[str, Any]] = []

    def add(kind: str, x: Any) -> None:
        if kind != "call" and blocks and blocks[-1][0] == kind:
            blocks[-1] = (kind, blocks[-1][1] + x)
        else:
            blocks.append((kind, x))

    if offsets is not None and len(offsets) == len(token_ids):
        ends = [*offsets[1:], len(text)]
        pieces = [p for i, t in enumerate(token_ids)
                  for p in turn.reader.feed(text[min(offsets[i], len(text)):min(ends[i], len(text))], (t,))]
    else:
        pieces = turn.reader.feed(text, token_ids)
    for p in pieces + turn.reader.finish(engine_reason == "length"):
        if p.call is not None:
            if turn.count(p.call) is not None:
                add("call", p.call)
        elif p.text:
            turn.ends_in_calls = False
            add("reasoning" if p.reasoning else "text", p.text)
    if any(k == "call" for k, _ in blocks):   # blank text between or around calls is no block of its own
        blocks = [(k, x) for k, x in blocks if k != "text" or x.strip()]
    return TurnResult("".join(x for k, x in blocks if k == "reasoning"), "".join(x for k, x in blocks if k == "text"),
                      [x for k, x in blocks if k == "call"], turn.finish_reason(engine_reason), blocks,
                      turn.reader.reasoning_tokens)


async def turn_deltas(gen: Generation, cfg: TurnConfig, ping_interval: float | None = None, *,
                      first: Event | None = None) -> AsyncIterator[TurnDelta | Ping]:
    """The stream loop shared by every chat-like route: yields a :class:`TurnDelta` per engine event that adds
    something (its ``finish_reason`` set on the choice's last), and :data:`PING` after each ``ping_interval``
    seconds without output (None or 0: never): no event, or events whose text the turn holds back (a tool call
    being generated). ``first``: an event the caller already read from ``gen``. Raises what
    :meth:`Generation.next_event` raises."""
    turns = [cfg.new_turn() for _ in gen.choices]
    pending: dict[int, list[TokenLogprob]] = {}
    pending_ids: dict[int, list[int]] = {}
    ev = first if first is not None else await gen.next_or_ping(ping_interval)
    last_out = time.monotonic()
    while ev is not None:
        if ev is PING or (ping_interval and time.monotonic() - last_out >= ping_interval):
            yield PING
            last_out = time.monotonic()
        if ev is PING:
            ev = await gen.next_or_ping(ping_interval)
            continue
        assert isinstance(ev, Event)
        turn = turns[ev.index]
        lps = pending.setdefault(ev.index, [])
        lps.extend(ev.logprobs or ())
        ids = pending_ids.setdefault(ev.index, [])
        ids.extend(ev.token_ids)
        d = turn.feed(ev.text, ev.token_ids, ev.index) if ev.text or ev.token_ids else TurnDelta(ev.index)
        if ev.finish_reason is not None:
            end = turn.finish(ev.index, cut=ev.finish_reason == "length")
            d.reasoning += end.reasoning
            d.content += end.content
            d.calls += end.calls
            d.finish_reason = turn.finish_reason(ev.finish_reason)
            d.reasoning_tokens = turn.reader.reasoning_tokens
        if not d.empty or (ev.text and lps):
            d.logprobs, pending[ev.index] = lps, []
            d.token_ids, pending_ids[ev.index] = ids, []
            yield d
            last_out = time.monotonic()
        ev = await gen.next_or_ping(ping_interval)
