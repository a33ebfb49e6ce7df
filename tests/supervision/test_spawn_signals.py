"""A rank process is spawned with SIGINT / SIGTERM blocked (server/process/processes.py): it starts with them
pending rather than delivered and drops them once it ignores them (engine/worker.py); the frontend still gets a
signal sent while it spawns."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

from ferrylm.engine.worker import TERMINAL_SIGNALS
from ferrylm.server.process.processes import terminal_signals_blocked


def _child(report) -> None:
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    os.kill(os.getpid(), signal.SIGINT)   # a Ctrl-C during the imports: pending, not delivered
    from ferrylm.engine.worker import ignore_terminal_signals

    ignore_terminal_signals()
    report.send((sorted(int(s) for s in blocked), sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))))


def test_a_rank_process_starts_with_the_terminal_signals_blocked_and_drops_them():
    got = []
    previous = signal.signal(signal.SIGINT, lambda sig, frame: got.append(sig))
    try:
        ours, theirs = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(target=_child, args=(theirs,))
        with terminal_signals_blocked():
            proc.start()
            os.kill(os.getpid(), signal.SIGINT)   # arrives while the frontend spawns
        signal.pthread_sigmask(signal.SIG_BLOCK, [])   # a point where Python runs pending handlers
        assert got == [signal.SIGINT]             # not lost (another thread, or this one once the mask is back)
        assert ours.poll(60)
        at_start, after = ours.recv()
        proc.join(30)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert proc.exitcode == 0                     # the pending SIGINT did not kill it
    assert {int(s) for s in TERMINAL_SIGNALS} <= set(at_start)
    assert not {int(s) for s in TERMINAL_SIGNALS} & set(after)
    assert not TERMINAL_SIGNALS & signal.pthread_sigmask(signal.SIG_BLOCK, [])
