"""A boot signal that lands inside a ``__del__`` still interrupts the start-up (CI flake of session 7: the
:class:`BootInterrupted` raised inside ``regex``'s ``Group.__del__`` was printed as "Exception ignored" and
dropped)."""

from __future__ import annotations

import signal
import time

import pytest

from ferrylm.server.process.boot_signals import BootInterrupted, BootSignals


class _SignalsInFinalizer:
    def __del__(self):
        signal.raise_signal(signal.SIGTERM)


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_signal_inside_finalizer_is_redelivered_after_it(restore_signals, capsys):
    boot = BootSignals().install()
    obj = _SignalsInFinalizer()
    with pytest.raises(BootInterrupted) as e:
        del obj                      # the handler runs inside __del__: it must not raise there
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.005)        # the redelivered signal raises here, outside the finalizer
    assert e.value.sig == signal.SIGTERM
    assert boot.received == [signal.SIGTERM]   # counted once: a later signal is still the "second"
    assert "Exception ignored" not in capsys.readouterr().err


def test_signal_outside_finalizer_raises_at_once(restore_signals):
    boot = BootSignals().install()
    with pytest.raises(BootInterrupted):
        signal.raise_signal(signal.SIGTERM)
    assert boot.received == [signal.SIGTERM] and not boot.armed
