"""Quarantine: a request that keeps taking the engine down is isolated, then refused, never retried into the
restart limit.

When the engine dies, stalls or reports a failed step, the supervisor knows which requests the failing step held
(the heartbeat's ``step_request_ids``, or the ``Fatal`` message's). Each of them gets a *strike*, keyed by a
fingerprint of what the request computes (prompt token ids + sampling parameters), so a client's resend of the
same request is recognised although it carries a new request id.

- A request with one strike is a *suspect*: it is sent to the engine with ``isolate`` (it runs in steps of its
  own, ``engine/scheduler.py``), so a second failure is its own and not a batch mate's, and so innocent batch
  mates of the first failure are not struck again. A suspect that finishes is cleared.
- A second strike within ``window_s`` quarantines the fingerprint for ``window_s``: the request that was running
  gets :class:`~ferrylm.errors.RequestQuarantined` instead of the generic restart error, and every resend is
  refused at once (HTTP 500 ``request_quarantined``) without reaching the engine.

With the default restart limit (3 in 10 minutes) one request can cause at most two restarts, so valid requests
never take the server down (issue 18: four sends of one long prompt did). Bounded: at most ``max_entries``
fingerprints are remembered (the oldest are forgotten first).

This module must not import torch.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack

from ferrylm.errors import RequestQuarantined

log = logging.getLogger("ferrylm.supervisor")

STRIKES_TO_QUARANTINE = 2


@dataclass
class Suspect:
    """A fingerprint's record: ``strikes`` within the window, the last one's time and reason, and the time until
    which it is quarantined (0.0: not quarantined). Times are the quarantine's clock (seconds)."""

    strikes: int = 0
    last_strike: float = 0.0
    why: str = ""
    quarantined_until: float = 0.0


# per-request bookkeeping, not what the request computes: the same request sent again must have the same fingerprint
NOT_FINGERPRINTED = frozenset({"deadline"})


def fingerprint(prompt_token_ids: Sequence[int], params: dict) -> str:
    """A short stable digest of what a request computes: its prompt token ids and its sampling parameters (the
    ``SamplingParams.to_dict()`` form, less :data:`NOT_FINGERPRINTED`: the deadline differs on every resend).
    Raises nothing for well-formed input; blake2b, 16 bytes, hex."""
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<I", len(prompt_token_ids)))
    h.update(msgpack.packb(list(prompt_token_ids)))
    h.update(msgpack.packb(sorted((k, v) for k, v in params.items() if k not in NOT_FINGERPRINTED), default=str))
    return h.hexdigest()


class Quarantine:
    """Strikes, suspects and quarantined fingerprints (see the module docstring).

    Args:
        strikes_to_quarantine: strikes within ``window_s`` that quarantine a fingerprint.
        window_s: how long a strike counts and a quarantine lasts (seconds).
        max_entries: fingerprints remembered at most.
        clock: ``() -> seconds`` (default ``time.monotonic``).
    """

    def __init__(self, *, strikes_to_quarantine: int = STRIKES_TO_QUARANTINE, window_s: float = 600.0,
                 max_entries: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.strikes_to_quarantine = strikes_to_quarantine
        self.window_s = window_s
        self.max_entries = max_entries
        self._clock = clock
        self._table: OrderedDict[str, Suspect] = OrderedDict()
        self.num_quarantined = 0    # fingerprints quarantined so far
        self.num_refused = 0        # requests refused because of a quarantine

    def _get(self, fp: str) -> Suspect | None:
        s = self._table.get(fp)
        if s is not None and self._clock() - s.last_strike > self.window_s and \
                s.quarantined_until <= self._clock():
            del self._table[fp]   # its strikes and quarantine are over
            return None
        return s

    def error_for(self, fp: str) -> RequestQuarantined | None:
        """The error for ``fp`` when it is quarantined now, else None."""
        s = self._get(fp)
        if s is None or s.quarantined_until <= self._clock():
            return None
        return RequestQuarantined(
            f"this request was running when the engine failed {s.strikes} times ({s.why}); it is refused for "
            f"{s.quarantined_until - self._clock():.0f} s more so that it cannot take the server down. Retrying "
            f"does not help; change the request or report it to the server's operator.")

    def check(self, fp: str) -> None:
        """Raise :class:`RequestQuarantined` when ``fp`` is quarantined now (counted as refused)."""
        err = self.error_for(fp)
        if err is not None:
            self.num_refused += 1
            raise err

    def is_suspect(self, fp: str) -> bool:
        """True when ``fp`` has a strike (and is not quarantined): it must run isolated."""
        s = self._get(fp)
        return s is not None and s.strikes > 0

    def strike(self, fp: str, why: str) -> bool:
        """Count a strike against ``fp`` (it was in the step when the engine failed: ``why``). Returns True when
        this strike quarantines it."""
        now = self._clock()
        s = self._get(fp) or Suspect()
        s.strikes += 1
        s.last_strike = now
        s.why = why
        self._table[fp] = s
        self._table.move_to_end(fp)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)
        if s.strikes >= self.strikes_to_quarantine and s.quarantined_until <= now:
            s.quarantined_until = now + self.window_s
            self.num_quarantined += 1
            return True
        return False

    def cleared(self, fp: str) -> None:
        """A suspect finished normally: it was innocent; forget its strikes (not a quarantine)."""
        s = self._table.get(fp)
        if s is not None and s.quarantined_until <= self._clock():
            del self._table[fp]

    def stats(self) -> dict:
        """``suspects`` (with a strike now), ``quarantined`` (now), ``quarantined_total``, ``refused_total``."""
        now = self._clock()
        live = [s for s in self._table.values() if now - s.last_strike <= self.window_s or s.quarantined_until > now]
        return {"suspects": sum(1 for s in live if s.quarantined_until <= now and s.strikes > 0),
                "quarantined": sum(1 for s in live if s.quarantined_until > now),
                "quarantined_total": self.num_quarantined, "refused_total": self.num_refused}
