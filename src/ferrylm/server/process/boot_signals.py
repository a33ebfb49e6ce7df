"""Signals while ``ferry serve`` starts, from the CLI module's first line until the event loop takes them over
(``server/process/launch.py``). Standard library only: it is imported before anything slow.

A signal within ``SIGNAL_REPEAT_WINDOW_S`` of the first is the same one relayed (``make``, ``timeout`` and service
managers signal the whole process group, then the parent passes it on to its child): it is ignored.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

REDELIVER_S = 0.01  # seconds before a signal that arrived inside a finalizer is delivered again
SIGNAL_REPEAT_WINDOW_S = 1.0  # a second signal sooner than this after the first is the same one, relayed


def is_relay(first_at: float) -> bool:
    """True when a signal now is the first one (received at monotonic ``first_at``) relayed again."""
    return time.monotonic() - first_at < SIGNAL_REPEAT_WINDOW_S


class BootInterrupted(BaseException):
    """SIGTERM/SIGINT arrived while ``ferry serve`` was starting, before the event loop handled signals.

    A BaseException (like KeyboardInterrupt) so that no ``except Exception`` on the way swallows it. ``sig``: the
    signal number."""

    def __init__(self, sig: int):
        super().__init__(sig)
        self.sig = sig


class BootSignals:
    """SIGTERM/SIGINT handling from the first line of ``ferry serve`` until the event loop installs its own.

    While *armed*, the first signal raises :class:`BootInterrupted` in the main thread (the start-up unwinds; no
    child exists yet); a second signal (not within ``SIGNAL_REPEAT_WINDOW_S`` of the first) exits ``128+N`` at once. Disarmed, a signal is only recorded in
    ``received`` (the event loop is about to take over and replays it). The default action of SIGTERM (die with
    status -15) never applies once :meth:`install` ran.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.armed = False
        self._first_at = 0.0

    def install(self, *, armed: bool = True) -> "BootSignals":
        """Take SIGINT / SIGTERM over (``armed``: the first one raises :class:`BootInterrupted`; else recorded)."""
        self.armed = armed
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, sig: int, frame) -> None:
        if self.armed and not self.received and _in_finalizer(frame):
            # An exception raised inside a ``__del__`` is printed ("Exception ignored in ...") and dropped, so
            # the start-up would go on: deliver the signal again once the finalizer has returned.
            timer = threading.Timer(REDELIVER_S, _thread.interrupt_main, args=(sig,))
            timer.daemon = True
            timer.start()
            return
        if self.received and is_relay(self._first_at):
            return   # the same signal relayed by a parent of the process group
        if not self.received:
            self._first_at = time.monotonic()
        self.received.append(sig)
        if len(self.received) > 1:
            os._exit(128 + sig)
        if self.armed:
            self.armed = False
            raise BootInterrupted(sig)




def _in_finalizer(frame, depth: int = 64) -> bool:
    """True when ``frame`` or one of its ``depth`` callers is a ``__del__``: Python swallows what a finalizer
    raises, so a :class:`BootInterrupted` raised there would be lost."""
    while frame is not None and depth > 0:
        if frame.f_code.co_name == "__del__":
            return True
        frame, depth = frame.f_back, depth - 1
    return False
