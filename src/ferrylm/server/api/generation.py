"""One HTTP request's generation: its choices run as engine requests, their outputs merged into events, and the
SSE plumbing that streams them (disconnect watching, always closing the body iterator so engine requests are
aborted promptly).

:class:`Generation` runs each choice (:class:`Choice`) in its own task and merges their :class:`Event` s;
:func:`race_disconnect` races work against the client going away (:class:`ClientGone`); :func:`cleanup` awaits an
abort / close shielded and bounded (``CLEANUP_TIMEOUT_S``); engine error codes become typed errors through
:func:`ferrylm.errors.error_from_code`, as in the supervisor.

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ferrylm.engine.outputs import EngineOutput, TokenLogprob
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import EngineUnavailable, FerryError, InsufficientMemory, RequestTimeout, error_from_code
from ferrylm.server.process.engine_client import EngineClient
from ferrylm.server.api.errors import REQUEST_ID_KEY
from ferrylm.server.api.metrics import Metrics
from ferrylm.server.text.text_stream import TextPipeline

logger = logging.getLogger("ferrylm.server")

T = TypeVar("T")

CLEANUP_TIMEOUT_S = 5.0  # bound on aclose()/abort() during cleanup


class ClientGone(Exception):
    """The HTTP client disconnected before the response was complete."""


@dataclass
class Choice:
    """One choice (``n`` > 1: one of several) of a request: its engine request, detokenizer and what it produced
    so far. ``offsets``: character offset of each emitted token's text in the choice's text (completions
    logprobs); times are ``time.monotonic()`` seconds."""

    index: int
    engine_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: TextPipeline
    text_skip_ids: frozenset[int]   # EOS / stop token ids whose text is not emitted when they end the output
    num_tokens: int = 0
    finish_reason: str | None = None
    engine_done: bool = False       # the engine reported this request finished (no abort needed)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    # logprobs (with offsets) of tokens whose text is not released yet (a possible stop string's start): they go
    # out with their text, and are dropped when a stop string cuts them off
    held_logprobs: list[tuple[TokenLogprob, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)   # every generated token id, in order
    token_offsets: list[int] = field(default_factory=list)   # where each token's text starts in ``text``
    prompt_logprobs: list | None = None    # the engine's prompt logprobs, when asked (first output)
    num_cached_tokens: int = 0              # prompt tokens served from the prefix cache (the engine's first output)
    first_token_time: float | None = None   # time.monotonic() of the first output with tokens
    last_token_time: float | None = None


@dataclass
class Event:
    """What one engine output of choice ``index`` adds: new ``text`` (with its ``logprobs`` / character
    ``offsets`` when asked), the new ``token_ids``, a ``finish_reason``, or an ``error`` that ends the choice."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    offsets: list[int] | None = None
    finish_reason: str | None = None
    error: BaseException | None = None
    token_ids: list[int] = field(default_factory=list)


async def cleanup(aw: Awaitable[Any], what: str, rid: str) -> None:
    """Await ``aw`` shielded from cancellation and bounded in time; log (never raise) its failure."""
    with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True) as scope:
        try:
            await aw
        except Exception as e:  # noqa: BLE001 - cleanup must not mask the original outcome
            logger.warning("[%s] %s failed: %r", rid, what, e)
    if scope.cancelled_caught:
        logger.warning("[%s] %s timed out after %.0f s", rid, what, CLEANUP_TIMEOUT_S)


class Ping:
    """The type of :data:`PING`."""

    def __repr__(self) -> str:
        return "PING"


PING = Ping()             # what a stream loop gets after ``ping_interval`` seconds without an event
SSE_PING = ": ping\n\n"   # the keep-alive as an SSE comment, which every SSE parser (the SDKs' too) skips


class Generation:
    """Runs the choices of one HTTP request on the engine, each in its own task, and merges their events.

    ``next_event()`` returns events in arrival order, raises the first error, and returns None once every
    choice has finished. ``close()`` cancels what is still running; each choice's task then closes its engine
    iterator and calls ``engine.abort`` unless the engine reported the request finished.
    """

    def __init__(self, engine: EngineClient, rid: str, choices: list[Choice], *, metrics: Metrics | None = None,
                 arrival: float | None = None, timeout_s: float | None = None):
        self.engine = engine
        self.rid = rid
        self.choices = choices
        self.metrics = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        # the server-side deadline (seconds from arrival): the engine ends each choice past it (request_timeout)
        self.deadline = None if timeout_s is None else self.arrival + timeout_s
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._open = len(choices)
        self._read: asyncio.Future | None = None

    def start(self) -> None:
        """Check every choice's admission with the engine client (its refusal is raised here and nothing runs),
        then run each choice in its own task."""
        for ch in self.choices:
            self.engine.check_admission(ch.engine_id, ch.prompt_ids, ch.params)
        self._tasks = [asyncio.create_task(self._run(ch), name=f"ferrylm-{ch.engine_id}") for ch in self.choices]

    async def next_event(self) -> Event | None:
        """The next event; None once every choice finished. Raises a choice's error, and RequestTimeout when the
        request's deadline passes first: the answer goes out at the deadline, whatever the engine is computing
        (its requests are aborted when the generation closes)."""
        if self._open == 0:
            return None
        if self.deadline is None or not self._queue.empty():
            ev = await self._queue.get()
        else:
            try:
                ev = await asyncio.wait_for(self._queue.get(), max(0.0, self.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise self._timed_out() from None
        if ev.error is not None:
            raise ev.error
        if ev.finish_reason is not None:
            self._open -= 1
        return ev

    def _timed_out(self) -> RequestTimeout:
        now = time.monotonic()
        return RequestTimeout(f"the request ran past its deadline ({now - self.arrival:.1f} s after it arrived, "
                              f"{self.completion_tokens} tokens generated; --request-timeout or the "
                              f"x-request-timeout header sets it)")

    async def drain(self) -> None:
        while await self.next_event() is not None:
            pass

    async def next_or_ping(self, ping_interval: float | None) -> Event | Ping | None:
        """:meth:`next_event`, or :data:`PING` when none came within ``ping_interval`` seconds (None or 0: wait
        for it). A wait that ends in PING is not cancelled: the next call continues the same read, so no event is
        lost. Raises what :meth:`next_event` raises."""
        if self._read is None:
            if not ping_interval:
                return await self.next_event()
            self._read = asyncio.ensure_future(self.next_event())
        done, _ = await asyncio.wait({self._read}, timeout=ping_interval or None)
        if not done:
            return PING
        read, self._read = self._read, None
        return read.result()

    async def close(self) -> None:
        if self._read is not None and not self._read.done():
            self._read.cancel()
        for t in self._tasks:
            if not t.done():
                t.cancel()
        if self._tasks:
            await cleanup(asyncio.gather(*self._tasks, return_exceptions=True), "closing choices", self.rid)

    @property
    def completion_tokens(self) -> int:
        return sum(ch.num_tokens for ch in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the engine's prefix cache, counted once per prompt (the choices of one prompt
        share its token list; the first choice's figure counts, as the prompt's tokens count once in usage)."""
        seen: set[int] = set()
        total = 0
        for ch in self.choices:
            if id(ch.prompt_ids) not in seen:
                seen.add(id(ch.prompt_ids))
                total += ch.num_cached_tokens
        return total

    @property
    def ttft(self) -> float | None:
        """Seconds from the request's arrival to the first token of any choice (None before one)."""
        times = [ch.first_token_time for ch in self.choices if ch.first_token_time is not None]
        return min(times) - self.arrival if times else None

    @property
    def last_token_time(self) -> float | None:
        times = [ch.last_token_time for ch in self.choices if ch.last_token_time is not None]
        return max(times) if times else None

    def _observe(self, ch: Choice, n: int) -> None:
        now = time.monotonic()
        m = self.metrics
        if ch.first_token_time is None:
            ch.first_token_time = now
            if m is not None:
                m.ttft.observe(now - self.arrival)
                m.prompt_tokens.inc(len(ch.prompt_ids))
        elif m is not None and ch.last_token_time is not None:
            m.itl.observe(now - ch.last_token_time)
        ch.last_token_time = now
        if m is not None:
            m.generation_tokens.inc(n)

    async def _run(self, ch: Choice) -> None:
        agen: Any = None
        try:
            params = ch.params if self.deadline is None else dataclasses.replace(ch.params, deadline=self.deadline)
            agen = self.engine.generate(ch.engine_id, ch.prompt_ids, params)  # may raise before iterating
            async for out in agen:
                ev = self._on_output(ch, out)
                if ev is not None:
                    self._queue.put_nowait(ev)
                if ch.finish_reason is not None:
                    break
            if ch.finish_reason is None:
                raise EngineUnavailable("the engine ended the request without finishing it")
        except asyncio.CancelledError:
            raise
        except MemoryError as e:  # a frontend allocation (detokenizer ...) failed: this request only, 503
            logger.error("[%s] choice %d: out of host memory in the frontend: %s", self.rid, ch.index, e)
            self._queue.put_nowait(Event(ch.index, error=InsufficientMemory(
                f"out of memory in the server while producing the text of this request ({e}); retry later")))
        except Exception as e:  # noqa: BLE001 - reported to the consumer, which maps it to HTTP
            if not isinstance(e, FerryError):
                logger.error("[%s] choice %d failed: %r", self.rid, ch.index, e, exc_info=e)
            self._queue.put_nowait(Event(ch.index, error=e))
        finally:
            aclose = getattr(agen, "aclose", None) if agen is not None else None
            if aclose is not None:
                await cleanup(aclose(), f"closing {ch.engine_id}", self.rid)
            if not ch.engine_done:
                logger.debug("[%s] aborting %s", self.rid, ch.engine_id)
                await cleanup(self.engine.abort(ch.engine_id), f"abort {ch.engine_id}", self.rid)

    def _on_output(self, ch: Choice, out: EngineOutput) -> Event | None:
        if out.queue_time is not None and self.metrics is not None:
            self.metrics.queue_time.observe(out.queue_time)  # >= 0: Request.take_queue_time
        if getattr(out, "num_cached_tokens", None) is not None:
            ch.num_cached_tokens = int(out.num_cached_tokens)
        if out.error_code:
            ch.engine_done = True
            raise error_from_code(out.error_code, out.error_message)
        if out.finish_reason == "abort":
            ch.engine_done = True
            raise EngineUnavailable("the engine aborted the request")
        ids = list(out.new_token_ids)
        ch.num_tokens += len(ids)
        ch.token_ids.extend(ids)
        if getattr(out, "prompt_logprobs", None) is not None:
            ch.prompt_logprobs = out.prompt_logprobs
        if ids:
            self._observe(ch, len(ids))
        text_ids = ids
        if (out.finish_reason == "stop" and ids and ids[-1] in ch.text_skip_ids
                and not ch.params.include_stop_str_in_output):
            text_ids = ids[:-1]   # the EOS / stop token counts as generated, its text is not emitted
        delta, offsets = ch.text.add(text_ids)
        offsets += [len(ch.text.detok.text)] * (len(ids) - len(text_ids))
        ch.token_offsets.extend(offsets)
        finish = None
        if ch.text.stopped:
            finish = "stop"
        elif out.finish_reason is not None:
            delta += ch.text.finish()
            finish = "stop" if ch.text.stopped else out.finish_reason
        if out.finish_reason is not None:
            ch.engine_done = True
        ch.finish_reason = finish
        if finish is not None and self.metrics is not None:
            self.metrics.success.labels(finish).inc()
        lps = None
        if ch.params.logprobs is not None:
            lps, offsets = _release_logprobs(ch, list(out.logprobs or ()), offsets, finish is not None)
        if lps:
            ch.logprobs.extend(lps)
            ch.offsets.extend(offsets)
        if not delta and finish is None and not lps and not ids:
            return None
        return Event(ch.index, delta, lps, offsets if lps else None, finish, token_ids=ids)


def _release_logprobs(ch: Choice, lps: list[TokenLogprob], offsets: list[int],
                      finished: bool) -> tuple[list[TokenLogprob], list[int]]:
    """The logprobs to send with this output: those of tokens whose text starts inside the text released so far
    (the rest wait with the held text). At the end: every held one, except after a stop string, where tokens
    starting at or past the cut are dropped (logprobs never go past a stop string)."""
    held = ch.held_logprobs
    held.extend(zip(lps, offsets))
    if not held:
        return [], []
    cut = len(ch.text.text)
    if finished and not ch.text.stopped:
        out, ch.held_logprobs = held, []
    else:
        out = [h for h in held if h[1] < cut]
        ch.held_logprobs = [] if finished else [h for h in held if h[1] >= cut]
    return [lp for lp, _ in out], [o for _, o in out]


async def wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``; raise :class:`ClientGone` (cancelling ``aw``) if the client disconnects first."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and watch.exception() is not None:  # receive() failed: just wait for the work
            await asyncio.wait({work})
        if work.done():
            return work.result()
        raise ClientGone()
    finally:
        for t in (work, watch):
            if not t.done():
                t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(work, watch, return_exceptions=True)


def count_client_gone(scope: Scope) -> None:
    """Count one ``request_errors_total{code="client_disconnected"}`` for the request of ``scope`` (the app's
    metrics, ``app.state.metrics``; nothing when the app has none)."""
    app = scope.get("app")
    metrics = getattr(getattr(app, "state", None), "metrics", None)
    if isinstance(metrics, Metrics):
        metrics.errors.labels("client_disconnected").inc()


class SSEResponse(StreamingResponse):
    """A streaming response that always watches for the client going away and always closes its body
    iterator (so the generator's cleanup, which aborts engine requests, runs promptly). A client that leaves
    before the stream ended is counted as ``client_disconnected`` here, once, whichever route streamed."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.body_iterator
        gone = False
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    nonlocal gone
                    try:
                        await self.stream_response(send)
                    except OSError:  # the server could not write: the client is gone
                        gone = True
                        logger.info("[%s] client went away during the stream", scope.get(REQUEST_ID_KEY))
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                if not tg.cancel_scope.cancel_called:
                    gone = True
                    logger.info("[%s] client disconnected during the stream; engine request aborted",
                                scope.get(REQUEST_ID_KEY))
                tg.cancel_scope.cancel()
        finally:
            if gone:
                count_client_gone(scope)
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def sse_event(data: str) -> str:
    return f"data: {data}\n\n"
