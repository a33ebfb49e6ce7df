"""The requests in flight between the frontend and the engine, and their answers when the engine goes away.

Each request sent to the engine has a queue its outputs (or its one terminal error) arrive on, its quarantine
fingerprint and whether it was sent isolated. When an engine generation fails (it died, stalled or reported a
failed step), the requests of its failing step get a quarantine strike (``quarantine.py``): one struck a second time
is answered RequestQuarantined, every other request in flight the failure's error. On shutdown every request left
gets its answer too, so no client waits forever.

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import zmq

from ferrylm.engine.outputs import EngineOutput
from ferrylm.errors import EngineUnavailable, FerryError, error_from_code
from ferrylm.server.process.quarantine import Quarantine

log = logging.getLogger("ferrylm.supervisor")


def error_from_output(out: EngineOutput) -> FerryError:
    """Map an engine error output to the typed error the HTTP edge understands (:func:`error_from_code`)."""
    return error_from_code(out.error_code, out.error_message)


@dataclass
class InFlightRequest:
    """One request sent to the engine: its quarantine ``fp`` (fingerprint), whether it was sent ``isolate``, and
    the ``queue`` its EngineOutputs (or a FerryError, its end) arrive on."""

    fp: str
    isolate: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class InFlight:
    """The requests in flight, by request id; answers them when the engine fails or the server stops."""

    def __init__(self, quarantine: Quarantine):
        self.quarantine = quarantine
        self._requests: dict[str, InFlightRequest] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, fp: str, isolate: bool) -> asyncio.Queue:
        """Register ``request_id`` (before it is sent: an immediate answer must find its queue); return its queue."""
        req = InFlightRequest(fp, isolate)
        self._requests[request_id] = req
        return req.queue

    def remove(self, request_id: str) -> None:
        """Forget ``request_id`` (its stream ended); unknown ids are ignored."""
        self._requests.pop(request_id, None)

    def deliver(self, outputs: list[EngineOutput]) -> None:
        """Queue each output for its request; outputs of requests no longer in flight are dropped."""
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is not None:
                req.queue.put_nowait(out)

    def fail_all(self, err: FerryError, special: dict[str, FerryError] | None = None) -> None:
        """Answer every request in flight with (a copy of) ``err``, or with its own error in ``special``."""
        for rid, req in self._requests.items():
            e = (special or {}).get(rid) or err
            req.queue.put_nowait(type(e)(e.message, code=e.code))

    def fail_engine(self, why: str, err: FerryError, struck_ids: list[str]) -> None:
        """The engine failed (``why``) while ``struck_ids`` ran: strike each of them once per fingerprint (however
        many copies run); answer the ones quarantined now with RequestQuarantined and every other request with
        ``err``."""
        special: dict[str, FerryError] = {}
        struck: dict[str, bool] = {}   # fingerprint -> quarantined now (one strike per failure, however many copies)
        for rid in struck_ids:
            req = self._requests.get(rid)
            if req is None:
                continue
            if req.fp not in struck:
                struck[req.fp] = self.quarantine.strike(req.fp, why)
                if struck[req.fp]:
                    log.error("[%s] quarantined: the engine failed twice while it ran (%s)%s", rid, why,
                              " alone" if req.isolate else "")
                else:
                    log.warning("[%s] suspect: the engine failed while it ran (%s); a resend runs isolated", rid,
                                why)
            q = self.quarantine.error_for(req.fp) if struck[req.fp] else None
            if q is not None:
                special[rid] = q
        self.fail_all(err, special)

    async def run(self, request_id: str, fp: str, isolate: bool, send: Callable[[], Awaitable[None]],
                  abort: Callable[[list[str]], None]) -> AsyncIterator[EngineOutput]:
        """Register ``request_id``, ``send`` it to the engine and yield its outputs until it finishes. Raises the
        FerryError it is answered with (an engine error output mapped by :func:`error_from_output`), or
        EngineUnavailable when ``send`` raises zmq.ZMQError (it never reached the engine). Leaving early
        ``abort``-s it in the engine. An isolated request that finishes clears its fingerprint's strike."""
        # NOTE: registered before the send: the send may yield to the event loop, and an answer that arrives
        # then (an immediate rejection) must find its queue
        q = self.add(request_id, fp, isolate)
        finished = False
        try:
            try:
                await send()
            except zmq.ZMQError as e:   # also a pipe torn down meanwhile (its generation failed)
                finished = True   # never reached the engine: nothing to abort
                raise EngineUnavailable(f"the engine is not accepting requests ({e})") from None
            while True:
                item = await q.get()
                if isinstance(item, FerryError):
                    finished = True
                    raise item
                if item.error_code:
                    finished = True
                    raise error_from_output(item)
                if item.finished:
                    finished = True
                    if isolate and item.finish_reason != "abort":
                        self.quarantine.cleared(fp)   # it ran alone and the engine survived: innocent
                yield item
                if finished:
                    return
        finally:
            self.remove(request_id)
            if not finished:
                abort([request_id])

    async def drain(self, timeout_s: float) -> int:
        """Wait until no request is in flight or ``timeout_s`` passed; return how many are still in flight."""
        deadline = time.monotonic() + timeout_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self._requests)
