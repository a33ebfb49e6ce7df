"""Starting and stopping the engine's processes: rank 0 and its tensor-parallel followers.

Both are started with multiprocessing "spawn" and watch their parent. ``stop_engine`` is the orderly way down
(Shutdown message, a wait, then SIGKILL), ``kill_processes`` the last resort of a second signal; ``ask_for_stacks``
makes a stalled engine write its Python stacks to the log before it is killed. The supervisor (``supervisor.py``)
decides when; these functions only act on the processes they are handed.

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import asdict
from typing import Callable, Sequence

from ferrylm.engine.worker import STACK_DUMP_SIGNAL, TERMINAL_SIGNALS, EngineSpec, engine_main

log = logging.getLogger("ferrylm.supervisor")

FOLLOWER_EXIT_WAIT_S = 2.0    # tensor-parallel followers get this long to follow rank 0's shutdown


@contextlib.contextmanager
def terminal_signals_blocked():
    """Block SIGINT / SIGTERM in this thread while a rank process starts. The child inherits the blocked mask
    through fork and exec, so a Ctrl-C to the process group during its imports stays pending until it ignores
    them (``engine.worker.ignore_terminal_signals``) instead of killing it half-started (and the supervisor
    restarting it under a shutdown); here such a signal still arrives (through another thread, or when the mask is
    restored)."""
    # NOTE: multiprocessing starts its resource tracker on the first spawn and unblocks these signals after it;
    # started first, it is left alone
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def spawn_engine(spec: EngineSpec) -> mp.process.BaseProcess:
    """Start rank 0, the engine process (``engine_main``), as a daemon; returns once it is started, not ready."""
    proc = mp.get_context("spawn").Process(target=engine_main, args=(asdict(spec),), name="ferrylm-engine",
                                           daemon=True)
    with terminal_signals_blocked():
        proc.start()
    return proc


def spawn_follower(spec: EngineSpec, rank: int, size: int, leader_pid: int) -> mp.process.BaseProcess:
    """Start tensor-parallel rank ``rank`` of ``size`` (``engine/parallel/follower.py``) for the engine of ``spec``,
    whose process is ``leader_pid``, as a daemon."""
    from ferrylm.engine.parallel.follower import FollowerSpec, follower_main

    fspec = FollowerSpec(spec.model_path, spec.engine_config, rank, size, spec.tp_rendezvous, spec.parent_pid,
                         leader_pid, spec.log_level)
    f = mp.get_context("spawn").Process(target=follower_main, args=(asdict(fspec),),
                                        name=f"ferrylm-engine-tp{rank}", daemon=True)
    with terminal_signals_blocked():
        f.start()
    return f


def describe_exit(code: int | None) -> str:
    """``exit code 1`` / ``killed by SIGKILL`` / ``exit code unknown``."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP / tracing stop): it cannot run a signal handler."""
    try:
        import psutil

        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except Exception:  # noqa: BLE001 - gone, or no psutil: assume it can run
        return False


def kill_followers(followers: Sequence) -> None:
    """SIGKILL and reap ``followers`` (their rank 0 is gone or going: none may outlive it). Their sentinels are
    no longer watched: their exit is ours, not a failure to report."""
    for f in followers:
        try:
            asyncio.get_running_loop().remove_reader(f.sentinel)
        except (RuntimeError, ValueError, OSError):   # no running loop (kill_now), or a closed sentinel
            pass
        try:
            if f.exitcode is None:
                f.kill()
            f.join(timeout=2)
        except Exception as e:  # noqa: BLE001 - best effort; PR_SET_PDEATHSIG is the backstop
            log.warning("could not stop tensor-parallel process %s: %r", f.pid, e)


async def stop_engine(proc, followers: Sequence, send_shutdown: Callable[[], None], *, state: str,
                      timeout_s: float) -> None:
    """Stop rank 0 ``proc`` (None: none running) and its ``followers``: an engine in ``state`` "ready" is sent
    Shutdown (``send_shutdown``) and given ``timeout_s`` seconds, one in any other state is killed at once; the
    followers get FOLLOWER_EXIT_WAIT_S to follow, then are killed."""
    if proc is not None and proc.is_alive() and state != "ready":
        # NOTE: an engine that is still loading reads no messages: waiting for it to obey Shutdown only
        # delays the exit (a SIGTERM during boot must be quick)
        log.info("stopping engine process %d, which is not ready (%s)", proc.pid, state)
        proc.kill()
    if proc is not None and proc.is_alive():
        send_shutdown()
        deadline = time.monotonic() + timeout_s
        while proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.is_alive():
            log.warning("engine process %d did not stop within %.0f s; killing it", proc.pid, timeout_s)
            proc.kill()
        proc.join(timeout=5)
    if followers:   # they exit on rank 0's SHUTDOWN header, or with rank 0
        deadline = time.monotonic() + FOLLOWER_EXIT_WAIT_S
        while any(f.exitcode is None for f in followers) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        kill_followers(followers)


def kill_if_alive(proc, gen: int, why: str) -> None:
    """SIGKILL engine process ``proc`` of generation ``gen`` unless it has exited already, logging ``why``."""
    if proc.exitcode is None and proc.is_alive():
        log.error("killing engine process %d (generation %d): %s", proc.pid, gen, why)
        proc.kill()


def kill_processes(procs: Sequence) -> None:
    """SIGKILL and reap each of ``procs`` (None entries and unstarted processes are skipped); never raises."""
    for proc in procs:
        if proc is None or proc.pid is None:
            continue
        try:
            proc.kill()
            proc.join(timeout=2)
        except Exception:  # noqa: BLE001 - we are exiting anyway
            pass


def ask_for_stacks(proc, followers: Sequence) -> bool:
    """Signal a stalled engine (rank 0 ``proc``) and its ``followers`` to dump their Python stacks to the log
    (STACK_DUMP_SIGNAL → faulthandler). A follower stuck in a collective is the usual cause of a tensor-parallel
    stall, so its stacks are asked for too. Returns False when rank 0 is gone already."""
    for f in followers:
        try:
            os.kill(f.pid, STACK_DUMP_SIGNAL)
        except (ProcessLookupError, TypeError):
            pass
    try:
        os.kill(proc.pid, STACK_DUMP_SIGNAL)
    except ProcessLookupError:
        return False
    log.error("asked engine process %d to dump its Python stacks (%s) to the log", proc.pid,
              signal.Signals(STACK_DUMP_SIGNAL).name)
    return True
