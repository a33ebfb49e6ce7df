"""The Supervisor: owns the engine process's life and implements EngineClient for the HTTP layer.

- start: private IPC dir (named with the pid; stale dirs of dead servers are swept) → bind zmq pipes → spawn
  ``engine_main`` ("spawn" context).
- readiness: state ``loading`` until the engine's Ready message; ``ready`` after. /health is ready only while
  the engine's heartbeat (every ~0.5 s, busy or idle) is fresh; a stale heartbeat reads ``stalled``.
- death: the process sentinel is watched by the event loop (``add_reader``, event-driven, no polling); every
  in-flight request is answered at once with EngineUnavailable, then the engine restarts with backoff, at most
  ``max_restarts`` times per ``restart_window_s``; past that the state is ``dead`` and ``on_fatal`` is called so
  the server exits non-zero.
- stall: the progress watchdog (a tick every 0.25 s) kills an engine that has requests running but made no
  progress, or sent no heartbeat, for its deadline: its requests get EngineStalled at once, its Python
  stacks are dumped to the log (SIGUSR1 → faulthandler; impossible when the process is stopped, which is logged),
  then SIGKILL and the ordinary death path (restart with backoff) follow. Progress is a changed tick counter in
  the heartbeat (the engine ticks per layer and per step, ``engine/progress.py``) or an output; the deadline is
  ``max(watchdog_timeout, STALL_MARGIN x the expected time between ticks of the running step)``, so a step that
  is long by nature (a 2048-token prefill chunk on a CPU) is not a hang, and a hang inside a short one is found at
  ``watchdog_timeout``.
- failed step: a ``Fatal`` from a ready engine (a sticky device error, an unexpected step error) turns /health red
  at once, answers every request in flight (503 ``device_error`` / ``engine_unavailable``), and the engine is
  restarted when it exits (SIGKILLed if it has not within ``FATAL_EXIT_WAIT_S``).
- quarantine (``server/process/quarantine.py``): the requests of the step that was running when the engine died, stalled
  or failed get a strike; a request with a strike is sent again isolated (alone in its steps), a second strike
  quarantines it (refused with 500 ``request_quarantined``), so no request can be retried into the restart limit.
- drain: ``begin_drain`` refuses new requests (``draining``); ``drain`` waits for the running ones; an engine that
  dies while the server drains is not restarted.
- each engine generation gets fresh IPC endpoints, so nothing queued for a dead engine reaches its successor.
- tensor parallel (``--tensor-parallel-size N > 1``): a generation is a group of N rank processes started together
  (rank 0 = the engine above; ranks 1..N-1 = followers, ``engine/parallel/follower.py``, meeting rank 0 at a file
  store in the IPC dir). Every rank's sentinel is watched: a follower's death fails the in-flight requests like
  the engine's and kills rank 0, whose exit restarts the whole group; rank 0's exit kills the followers. Heartbeats
  and the watchdog stay rank 0's: a follower stuck in a collective stalls rank 0.
- one guard per boundary: the reader task survives any message it cannot decode or handle (logged), the watchdog
  survives its own errors.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import AsyncIterator, Callable

import zmq
import zmq.asyncio

from ferrylm.engine import ipc
from ferrylm.engine.outputs import EngineOutput
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.worker import STACK_DUMP_SIGNAL, EngineSpec, engine_main
from ferrylm.errors import (DeviceError, EngineStalled, EngineUnavailable, FerryError, InvalidRequest,
                            RequestQuarantined, error_from_code)
from ferrylm.faults import NO_FAULTS, FaultInjector
from ferrylm.server.process.engine_client import HealthState, ModelInfo
from ferrylm.server.process.ipc_dir import IpcDir, sweep_stale_ipc_dirs  # noqa: F401 - sweep_stale_ipc_dirs re-exported
from ferrylm.server.process.quarantine import Quarantine, fingerprint

log = logging.getLogger("ferrylm.supervisor")

HEARTBEAT_STALE_S = 5.0       # no heartbeat for this long → /health says "stalled" (10 missed beats)
WATCHDOG_TICK_S = 0.25        # how often the progress watchdog looks
STACK_DUMP_WAIT_S = 0.5       # time the engine gets to write its stacks before SIGKILL
STALL_MARGIN = 4.0            # x the expected time between progress ticks of the running step
TICK_GAPS_KEPT = 16           # observed times per tick the watchdog's deadline follows (the slowest of them)
FOLLOWER_EXIT_WAIT_S = 2.0    # tensor-parallel followers get this long to follow rank 0's shutdown
FATAL_EXIT_WAIT_S = 2.0       # an engine that reported a fatal error is SIGKILLed if it has not exited by then
MODEL_ERROR_CODES = frozenset({"model_load_error", "unsupported_architecture"})  # start-up failures: exit 2


@dataclass
class _InFlight:
    """What the supervisor remembers of a request it sent: its quarantine ``fp`` (fingerprint) and whether it was
    sent ``isolate``."""

    fp: str
    isolate: bool

def error_from_output(out: EngineOutput) -> FerryError:
    """Map an engine error output to the typed error the HTTP edge understands (:func:`error_from_code`)."""
    return error_from_code(out.error_code, out.error_message)


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


def _is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP / tracing stop): it cannot run a signal handler."""
    try:
        import psutil

        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except Exception:  # noqa: BLE001 - gone, or no psutil: assume it can run
        return False


class Supervisor:
    """Spawns and watches the engine; routes requests and outputs.

    Args:
        model_path: HF folder the engine loads.
        engine_config: EngineConfig as a dict.
        model_info: what the frontend knows before the engine is up (updated from the engine's Ready).
        max_restarts: restarts allowed within ``restart_window_s`` seconds before giving up.
        on_fatal: called (no args) when the engine is dead for good; the server then exits with
            ``fatal_exit_code`` (1; 2 when the engine's first start failed on the model itself).
        watchdog_timeout: seconds without progress (while requests run; at least STALL_MARGIN x the running
            step's expected time between progress ticks) or without a heartbeat after which a ready engine is
            declared stalled and restarted; 0 or None turns the watchdog off.
        faults: the frontend's fault injector (point ``ipc_garbage``).
        janitor: start the IPC dir's janitor process (``server/process/ipc_dir.py``), which removes the dir when this
            process dies by any signal.
        on_phase: called with each boot phase the engine reports (``ipc.Loading``); on_ready: with its Ready info.
    """

    def __init__(self, model_path: str, engine_config: dict, model_info: ModelInfo, *, max_restarts: int = 3,
                 restart_window_s: float = 600.0, on_fatal: Callable[[], None] | None = None,
                 log_level: str = "INFO", watchdog_timeout: float | None = 120.0,
                 faults: FaultInjector = NO_FAULTS, janitor: bool = True,
                 on_phase: Callable[[str], None] | None = None, on_ready: Callable[[dict], None] | None = None):
        self.model_path = model_path
        self.engine_config = engine_config
        self.model_info = model_info
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.on_fatal = on_fatal
        self.on_phase = on_phase
        self.on_ready = on_ready
        self.log_level = log_level
        self.watchdog_timeout = watchdog_timeout or None
        self.heartbeat_stale_s = min(HEARTBEAT_STALE_S, self.watchdog_timeout or HEARTBEAT_STALE_S)
        self.state = "loading"
        self.detail = "engine starting"
        self.engine_pid: int | None = None
        self.num_restarts = 0
        self.last_stats: dict = {}
        self.memory_plan: dict | None = None  # the engine's boot memory plan (from its Ready message)
        self.engine_info: dict = {}  # what the engine's Ready said about itself (backend, limits, config)
        self.last_heartbeat = 0.0
        self._last_progress = 0.0     # frontend clock: last moment the engine was known to make progress
        self._restart_times: deque[float] = deque()
        self._streams: dict[str, asyncio.Queue] = {}
        self._ctx = zmq.asyncio.Context()
        self._ipc = IpcDir(janitor=janitor)
        self._dir = self._ipc.path
        self._gen = 0
        self._proc: mp.process.BaseProcess | None = None
        self._followers: list[mp.process.BaseProcess] = []   # tensor-parallel ranks 1..N-1 of this generation
        self.tp_size = int(engine_config.get("tensor_parallel_size", 1) or 1)
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._stalled_gen = 0         # generation the watchdog condemned (its exit is expected)
        self._failed_gen = 0          # generation whose failure was already answered (watchdog or Fatal)
        self._closing = False
        self._draining = False
        self._meta: dict[str, _InFlight] = {}
        self._progress: dict = {}     # the last heartbeat's progress report (engine/progress.py)
        self._last_ticks: int | None = None
        self._last_tick_time: float | None = None   # frontend clock: when the tick count last changed
        # seconds per tick observed lately (heartbeats that saw the count move): the watchdog's deadline follows
        # the engine's real pace, so a slow but progressing engine (a saturated CPU) is not taken for a hang
        self._tick_gaps: collections.deque[float] = collections.deque(maxlen=TICK_GAPS_KEPT)
        self.quarantine = Quarantine(window_s=restart_window_s)
        self.faults = faults
        self.fatal_exit_code = 1

    # --- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine (returns at once; readiness arrives later)."""
        self._spawn()
        if self.watchdog_timeout:
            self._watchdog = asyncio.get_running_loop().create_task(self._watchdog_loop())

    def _spawn(self) -> None:
        self._gen += 1
        in_addr = f"ipc://{self._dir}/in-{self._gen}"
        out_addr = f"ipc://{self._dir}/out-{self._gen}"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(out_addr)
        rendezvous = f"{self._dir}/tp-{self._gen}" if self.tp_size > 1 else None
        spec = EngineSpec(self.model_path, self.engine_config, in_addr, out_addr, os.getpid(), self.log_level,
                          tp_rendezvous=rendezvous)
        proc = mp.get_context("spawn").Process(target=engine_main, args=(asdict(spec),), name="ferrylm-engine",
                                               daemon=True)
        proc.start()
        self._proc = proc
        self.engine_pid = proc.pid
        self._followers = [self._spawn_follower(rank, rendezvous, proc.pid) for rank in range(1, self.tp_size)]
        self.state = "loading" if self.num_restarts == 0 else "restarting"
        self._progress, self._last_ticks = {}, None
        self._last_tick_time = None
        self._tick_gaps.clear()
        self.last_heartbeat = self._last_progress = time.monotonic()
        log.info("engine process %d started (generation %d)", proc.pid, self._gen)
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, self._on_engine_exit, proc, self._gen)
        for rank, f in enumerate(self._followers, start=1):
            loop.add_reader(f.sentinel, self._on_follower_exit, f, self._gen, rank)
        self._reader = loop.create_task(self._read_loop(self._pull, self._gen))

    def _spawn_follower(self, rank: int, rendezvous: str, leader_pid: int) -> mp.process.BaseProcess:
        from ferrylm.engine.parallel.follower import FollowerSpec, follower_main

        spec = FollowerSpec(self.model_path, self.engine_config, rank, self.tp_size, rendezvous, os.getpid(),
                            leader_pid, self.log_level)
        f = mp.get_context("spawn").Process(target=follower_main, args=(asdict(spec),),
                                            name=f"ferrylm-engine-tp{rank}", daemon=True)
        f.start()
        log.info("tensor-parallel rank %d process %d started (generation %d)", rank, f.pid, self._gen)
        return f

    @property
    def rank_pids(self) -> list[int]:
        """The pids of the current generation's rank processes (rank 0 first; one entry without tensor parallel)."""
        procs = ([self._proc] if self._proc is not None else []) + list(self._followers)
        return [p.pid for p in procs if p.pid is not None]

    def _kill_followers(self, followers: list) -> None:
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

    def _on_follower_exit(self, proc, gen: int, rank: int) -> None:
        """Rank ``rank`` of generation ``gen`` exited: unless it followed rank 0's shutdown, the group cannot
        compute any more: its requests are answered now and rank 0 is killed, whose exit restarts the group."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        proc.join(timeout=1.0)
        if gen != self._gen or self._closing or proc.exitcode == 0:
            return
        how = describe_exit(proc.exitcode)
        leader = self._proc
        if self.state == "loading":   # the first start: a restart would fail the same way (its log says why)
            self._give_up(f"tensor-parallel rank {rank} failed to start ({how}); see its log above")
            if leader is not None and leader.exitcode is None:
                leader.kill()
            return
        log.error("tensor-parallel rank %d (process %d) exited (%s); answering %d in-flight requests, restarting "
                  "the rank group", rank, proc.pid, how, len(self._streams))
        if gen != self._failed_gen:
            self._engine_failed(gen, f"tensor-parallel rank {rank} exited ({how})",
                                EngineUnavailable(f"tensor-parallel rank {rank} of the engine exited ({how}); the "
                                                  f"engine is restarting"),
                                blame=proc.exitcode != -signal.SIGKILL)
        if self.state == "ready":
            self.state, self.detail = "restarting", f"tensor-parallel rank {rank} exited ({how})"
        if leader is not None and leader.exitcode is None:
            leader.kill()   # its sentinel: teardown, the followers' end, the restart

    async def close(self, timeout_s: float = 5.0) -> None:
        """Ask the engine to stop, wait up to ``timeout_s``, then kill it; answer what is left; remove the IPC
        dir. Idempotent."""
        if self._closing and self._ctx.closed:
            return
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        proc = self._proc
        if proc is not None and proc.is_alive() and self.state != "ready":
            # NOTE: an engine that is still loading reads no messages: waiting for it to obey Shutdown only
            # delays the exit (a SIGTERM during boot must be quick)
            log.info("stopping engine process %d, which is not ready (%s)", proc.pid, self.state)
            proc.kill()
        if proc is not None and proc.is_alive():
            self._send_nowait(ipc.Shutdown())
            deadline = time.monotonic() + timeout_s
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                log.warning("engine process %d did not stop within %.0f s; killing it", proc.pid, timeout_s)
                proc.kill()
            proc.join(timeout=5)
        if self._followers:   # they exit on rank 0's SHUTDOWN header, or with rank 0
            deadline = time.monotonic() + FOLLOWER_EXIT_WAIT_S
            while any(f.exitcode is None for f in self._followers) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self._kill_followers(self._followers)
        self._fail_all(EngineUnavailable("the server is shutting down"))
        self._teardown_sockets()
        self._ctx.term()
        self._ipc.remove()

    def kill_now(self) -> None:
        """Synchronous last resort (second signal): SIGKILL the engine, reap it, remove the IPC dir."""
        self._closing = True
        for proc in [self._proc, *self._followers]:
            if proc is None or proc.pid is None:
                continue
            try:
                proc.kill()
                proc.join(timeout=2)
            except Exception:  # noqa: BLE001 - we are exiting anyway
                pass
        self._ipc.remove(wait_s=0)

    def _teardown_sockets(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        for s in (self._push, self._pull):
            if s is not None:
                s.close(linger=0)
        self._push = self._pull = None

    def _on_engine_exit(self, proc, gen: int) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        # NOTE: the sentinel fires when the child's fds close, a moment before it becomes reapable; join with a
        # timeout does a blocking waitpid, which returns within microseconds here.
        proc.join(timeout=1.0)
        if gen != self._gen or self._closing:
            return
        self._kill_followers(self._followers)   # no rank outlives rank 0
        how = describe_exit(proc.exitcode)
        stalled = gen == self._stalled_gen
        log.error("engine process %d exited (%s)%s; answering %d in-flight requests", proc.pid, how,
                  " after the watchdog killed it" if stalled else "", len(self._streams))
        err = EngineUnavailable(f"the engine process exited ({how}); it is restarting")
        if gen != self._failed_gen:
            # NOTE: SIGKILL comes from outside (an operator, the kernel's OOM killer): not held against the requests
            # of the step; a crash (segfault, abort, exit) is
            self._engine_failed(gen, f"the engine process exited ({how})", err,
                                blame=proc.exitcode != -signal.SIGKILL)
        else:
            self._fail_all(err)   # answered already (watchdog / Fatal); anything registered since
        self._teardown_sockets()
        if self.state == "dead":
            return  # fatal start-up error already reported
        if self._draining:
            log.info("not restarting the engine: the server is shutting down")
            self.state, self.detail = "dead", f"the engine exited ({how}) while the server was shutting down"
            return
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > self.restart_window_s:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.max_restarts:
            self._give_up(f"the engine {'stalled' if stalled else 'died'} ({how}); "
                          f"{len(self._restart_times)} restarts within {self.restart_window_s:.0f} s already "
                          f"(--max-engine-restarts {self.max_restarts})")
            return
        self._restart_times.append(now)
        self.num_restarts += 1
        self.state = "restarting"
        self.detail = f"engine {'stalled and was killed' if stalled else 'exited'} ({how}); " \
                      f"restart {self.num_restarts}"
        delay = min(0.5 * 2 ** (len(self._restart_times) - 1), 10.0)
        log.info("restarting the engine in %.1f s (restart %d)", delay, self.num_restarts)
        loop.call_later(delay, self._restart)

    def _restart(self) -> None:
        if not self._closing and not self._draining and self.state != "dead":
            self._spawn()

    def _give_up(self, why: str, exit_code: int = 1) -> None:
        log.error("engine is dead for good: %s", why)
        self.fatal_exit_code = exit_code
        self.state = "dead"
        self.detail = why
        if self.on_fatal is not None:
            self.on_fatal()

    def _fail_all(self, err: FerryError, special: dict[str, FerryError] | None = None) -> None:
        """Answer every in-flight request with (a copy of) ``err``, or with its own error in ``special``."""
        for rid, q in self._streams.items():
            e = (special or {}).get(rid) or err
            q.put_nowait(type(e)(e.message, code=e.code))

    def _suspects(self) -> list[str]:
        """The requests of the step the engine was running at its last heartbeat ([] between steps)."""
        p = self._progress
        ids = p.get("step_request_ids") if isinstance(p, dict) and p.get("in_step") else None
        return [r for r in ids if isinstance(r, str)] if isinstance(ids, list) else []

    def _engine_failed(self, gen: int, why: str, err: FerryError, request_ids: list[str] | None = None, *,
                       blame: bool = True) -> None:
        """Generation ``gen`` failed (``why``): unless ``blame`` is False (the cause is outside the engine:
        SIGKILL, SIGSTOP), strike the requests of its failing step (``request_ids``, else the last heartbeat's);
        answer the quarantined ones with RequestQuarantined and every other request in flight with ``err``. Once
        per generation."""
        self._failed_gen = gen
        special: dict[str, FerryError] = {}
        struck: dict[str, bool] = {}   # fingerprint -> quarantined now (one strike per failure, however many copies)
        for rid in (request_ids if request_ids is not None else self._suspects()) if blame else ():
            m = self._meta.get(rid)
            if m is None:
                continue
            if m.fp not in struck:
                struck[m.fp] = self.quarantine.strike(m.fp, why)
                if struck[m.fp]:
                    log.error("[%s] quarantined: the engine failed twice while it ran (%s)%s", rid, why,
                              " alone" if m.isolate else "")
                else:
                    log.warning("[%s] suspect: the engine failed while it ran (%s); a resend runs isolated", rid,
                                why)
            q = self.quarantine.error_for(m.fp) if struck[m.fp] else None
            if q is not None:
                special[rid] = q
        self._fail_all(err, special)

    # --- watchdog ---------------------------------------------------------------------------------------------
    async def _watchdog_loop(self) -> None:
        last = time.monotonic()
        while not self._closing:
            await asyncio.sleep(WATCHDOG_TICK_S)
            now = time.monotonic()
            late, last = now - last > 4 * WATCHDOG_TICK_S, now
            if late:
                # NOTE: our own event loop was blocked: heartbeats may sit unread in the pipe. Judge the engine
                # only after the reader had a turn, or a busy frontend would kill a healthy engine.
                continue
            try:
                self._check_progress(now)
            except Exception:  # pragma: no cover - the watchdog must survive its own bugs
                log.exception("watchdog check failed")

    def stall_deadline(self) -> float:
        """Seconds without progress after which the running engine is stalled: ``watchdog_timeout``, or more when
        the running step is expected to take longer than that between two progress ticks: STALL_MARGIN x the
        larger of its expected duration / ticks per step and the slowest time per tick observed over the last
        TICK_GAPS_KEPT moves of the tick count (a saturated host slows every layer down; its ticks still come, at
        its own pace). A hang stops the ticks, so it never feeds the observed pace."""
        wd = float(self.watchdog_timeout or 0.0)
        p = self._progress
        try:
            if p.get("in_step"):
                per_tick = float(p.get("expected_step_s") or 0.0) / max(1, int(p.get("ticks_per_step") or 1))
                observed = max(self._tick_gaps) if self._tick_gaps else 0.0
                return max(wd, STALL_MARGIN * per_tick, STALL_MARGIN * observed)
        except (TypeError, ValueError, AttributeError):
            pass
        return wd

    def _check_progress(self, now: float) -> None:
        wd = self.watchdog_timeout
        if not wd or self.state != "ready" or self._proc is None or self._closing:
            return
        no_progress = now - self._last_progress
        no_heartbeat = now - self.last_heartbeat
        deadline = self.stall_deadline()
        if self._streams and no_progress > deadline:
            step = self._progress if self._progress.get("in_step") else {}
            where = (f"inside a step of {step.get('step_tokens')} tokens running for {step.get('step_age_s')} s, "
                     f"expected {step.get('expected_step_s')} s" if step else "between steps")
            self._stall(f"{len(self._streams)} requests in flight but no progress for {no_progress:.1f} s, "
                        f"{where} (deadline {deadline:.1f} s, --watchdog-timeout {wd:g}; last heartbeat "
                        f"{no_heartbeat:.1f} s ago)")
        elif no_heartbeat > wd:
            self._stall(f"no heartbeat for {no_heartbeat:.1f} s (--watchdog-timeout {wd:g})")

    def _stall(self, why: str) -> None:
        proc, gen = self._proc, self._gen
        assert proc is not None
        log.error("engine process %d is stalled: %s; answering %d requests, dumping its stacks, restarting it",
                  proc.pid, why, len(self._streams))
        self._stalled_gen = gen
        self.state = "stalled"
        self.detail = why
        stopped = _is_stopped(proc.pid)   # SIGSTOP / a debugger: not the requests' doing
        # NOTE: under tensor parallel rank 0 also stalls when a follower it waits for in a collective is stopped
        stopped_follower = any(_is_stopped(f.pid) for f in self._followers if f.pid is not None)
        if stopped_follower:
            log.error("a tensor-parallel follower of engine process %d is stopped (SIGSTOP or a debugger)", proc.pid)
        self._engine_failed(gen, "it stalled", EngineStalled(f"the engine stalled ({why}); it is being restarted"),
                            blame=not (stopped or stopped_follower))
        self._teardown_sockets()   # nothing more from or to this generation
        if stopped:
            log.error("cannot dump the stalled engine's Python stacks: process %d is stopped (SIGSTOP or a "
                      "debugger) and cannot run a signal handler; killing it", proc.pid)
            delay = 0.0
        else:
            for f in self._followers:   # a follower stuck in a collective is the usual cause: its stacks too
                try:
                    os.kill(f.pid, STACK_DUMP_SIGNAL)
                except (ProcessLookupError, TypeError):
                    pass
            try:
                os.kill(proc.pid, STACK_DUMP_SIGNAL)
                log.error("asked engine process %d to dump its Python stacks (%s) to the log", proc.pid,
                          signal.Signals(STACK_DUMP_SIGNAL).name)
                delay = STACK_DUMP_WAIT_S
            except ProcessLookupError:
                return  # already gone; the sentinel handles it
        asyncio.get_running_loop().call_later(delay, self._kill, proc, gen)

    def _kill(self, proc, gen: int) -> None:
        if proc.exitcode is None and proc.is_alive():
            log.error("killing stalled engine process %d (generation %d)", proc.pid, gen)
            proc.kill()   # SIGKILL works on a stopped process too; the sentinel then restarts the engine

    # --- IPC ----------------------------------------------------------------------------------------------------
    async def _read_loop(self, sock: zmq.asyncio.Socket, gen: int) -> None:
        while True:
            try:
                data = await sock.recv()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if gen != self._gen:
                return
            # NOTE: one guard per message: nothing a message holds may end this task (heartbeats would go unread
            # and the watchdog would kill a healthy engine)
            try:
                self._on_message(data, gen)
            except Exception as e:  # noqa: BLE001
                log.exception("could not handle a message from the engine (%d bytes): %r", len(data), e)

    def _on_message(self, data: bytes, gen: int) -> None:
        """Handle one message of engine generation ``gen``. Raises on a message it cannot handle (the reader
        logs it and goes on)."""
        now = time.monotonic()
        self.last_heartbeat = now
        try:
            msg = ipc.decode(data)
        except Exception:  # a bad message must not stop the reader
            log.exception("undecodable IPC message from the engine (%d bytes)", len(data))
            return
        if isinstance(msg, ipc.Outputs):
            self._last_progress = now
            for out in msg.outputs:
                q = self._streams.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
        elif isinstance(msg, ipc.Heartbeat):
            self._on_heartbeat(msg, now)
        elif isinstance(msg, ipc.Loading):
            self.detail = f"engine {msg.phase}"
            if self.on_phase is not None:
                self.on_phase(msg.phase)
        elif isinstance(msg, ipc.Ready):
            info = msg.info
            self.model_info.max_model_len = int(info["max_model_len"])
            self.model_info.kv_pool_tokens = int(info["kv_pool_tokens"])
            self.memory_plan = info.get("memory_plan")
            self.engine_info = {k: v for k, v in info.items() if k != "memory_plan"}
            self._last_progress = now
            log.debug("engine ready: %s", self.engine_info)
            if self.on_ready is not None:
                self.on_ready(info)
            self.state = "ready"
            self.detail = ""
        elif isinstance(msg, ipc.Fatal):
            self._on_fatal(msg, gen)
        else:
            log.error("unexpected %s message from the engine", type(msg).__name__)

    def _on_heartbeat(self, msg: ipc.Heartbeat, now: float) -> None:
        self.last_stats = msg.stats if isinstance(msg.stats, dict) else {}
        prog = msg.progress if isinstance(msg.progress, dict) else {}
        self._progress = prog
        running = prog.get("num_running", self.last_stats.get("num_running"))
        waiting = prog.get("num_waiting", self.last_stats.get("num_waiting"))
        ticks = prog.get("ticks")
        if not running and not waiting:
            # NOTE: idle is not stuck; but waiting requests are work (an engine that hangs before it schedules
            # them must be found: with nothing running every waiting request fits)
            self._last_progress = now
            # the observed pace counts busy time only: an idle spell is no slow tick
            self._last_tick_time = now
            if ticks is not None:
                self._last_ticks = ticks
        elif ticks is not None:
            if ticks != self._last_ticks:                  # a layer or a step boundary since the last beat
                self._last_progress = now
                try:
                    moved = int(ticks) - int(self._last_ticks) if self._last_ticks is not None else 0
                except (TypeError, ValueError):
                    moved = 0
                if moved > 0 and self._last_tick_time is not None:
                    self._tick_gaps.append((now - self._last_tick_time) / moved)
                self._last_tick_time = now
            self._last_ticks = ticks
        else:  # an engine without progress reports: the loop iteration's age
            self._last_progress = max(self._last_progress, now - float(msg.last_step_age))

    def _on_fatal(self, msg: ipc.Fatal, gen: int) -> None:
        log.error("engine reported a fatal error (%s): %s", msg.code or "unknown", msg.message)
        if self.state == "loading":  # the first start failed: restarting would fail the same way
            self._give_up(f"the engine failed to start: {msg.message}",
                          exit_code=2 if msg.code in MODEL_ERROR_CODES else 1)
            return
        if self.state != "ready" or gen != self._gen:
            return  # a restart that fails to start: the exit handler counts it against the restart limit
        device = msg.code == "device_error"
        self.state = "restarting"   # /health red at once, before the process is gone
        self.detail = f"the engine {'hit a device error' if device else 'failed'} ({msg.message}); restarting"
        err: FerryError = (DeviceError if device else EngineUnavailable)(
            f"the engine {'hit a sticky device error' if device else 'failed a step'} ({msg.message}); it is "
            f"restarting")
        ids = [r for r in msg.request_ids if isinstance(r, str)] if isinstance(msg.request_ids, list) else None
        self._engine_failed(gen, "a device error" if device else "a failed step", err, ids)
        proc = self._proc
        if proc is not None:
            asyncio.get_running_loop().call_later(FATAL_EXIT_WAIT_S, self._kill_if_alive, proc, gen)

    def _kill_if_alive(self, proc, gen: int) -> None:
        if proc.exitcode is None and proc.is_alive():
            log.error("engine process %d (generation %d) reported a fatal error but did not exit within %.0f s; "
                      "killing it", proc.pid, gen, FATAL_EXIT_WAIT_S)
            proc.kill()

    # --- drain --------------------------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def begin_drain(self) -> None:
        """Refuse new requests from now on (503, /health ``draining``); running ones continue."""
        self._draining = True

    async def drain(self, timeout_s: float) -> int:
        """Wait until no request is in flight or ``timeout_s`` passed; return how many are still in flight."""
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self._streams)

    def fail_in_flight(self, err: FerryError) -> None:
        """Answer every in-flight request with ``err`` (abort in the engine follows from the request's end)."""
        self._fail_all(err)

    # --- EngineClient -----------------------------------------------------------------------------------------
    def health(self) -> HealthState:
        now = time.monotonic()
        hb_age = now - self.last_heartbeat if self.last_heartbeat else None
        p = self._progress
        step = {k: p.get(k) for k in ("in_step", "step_age_s", "step_tokens", "expected_step_s")} if p else {}
        extra = {"engine_pid": self.engine_pid, "restarts": self.num_restarts,
                 **({"tensor_parallel_pids": self.rank_pids} if self.tp_size > 1 else {}),
                 "heartbeat_age_s": None if hb_age is None else round(hb_age, 2),
                 "in_flight": len(self._streams), "step": step,
                 # the figures of the engine that is running: none while it loads or restarts (the last
                 # heartbeat's are the dead engine's: fresh-user trial, "num_running": 2 during a restart)
                 "engine": dict(self.last_stats) if self.state == "ready" else {},
                 "stall_deadline_s": round(self.stall_deadline(), 2) if self.watchdog_timeout else None,
                 "quarantine": self.quarantine.stats()}
        if self._draining:
            return HealthState("draining", "the server is shutting down", extra)
        if self.state == "ready" and hb_age is not None and hb_age > self.heartbeat_stale_s:
            return HealthState("stalled", f"no heartbeat from the engine for {hb_age:.1f} s", extra)
        return HealthState(self.state, self.detail, extra)

    def memory(self) -> dict | None:
        """``GET /v1/memory``: the current engine's boot plan and its live figures (from the last heartbeat:
        free memory now, expert slots now, prefill budget, OOM recoveries by action), or None before the first
        Ready."""
        if self.memory_plan is None:
            return None
        stats = self.last_stats
        return {"engine_pid": self.engine_pid, "state": self.state, "plan": self.memory_plan,
                "server": dict(self.engine_info),
                "live": dict(stats.get("memory") or {}), "oom_recoveries": dict(stats.get("oom_recoveries") or {}),
                "kv_pages_used": stats.get("kv_pages_used"), "kv_pages_total": stats.get("kv_pages_total")}

    def check_admission(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise what :meth:`generate` would refuse the request with before sending it: EngineUnavailable
        (draining, not ready), InvalidRequest (the id is in flight), RequestQuarantined (it failed the engine
        twice)."""
        self._admit(request_id, prompt_token_ids, params.to_dict())

    def _admit(self, request_id: str, prompt_token_ids: list[int], pdict: dict) -> str:
        """:meth:`check_admission` on ``params.to_dict()``; returns the request's fingerprint."""
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        if self.state != "ready" or self._push is None:
            raise EngineUnavailable(f"the engine is not ready ({self.state})")
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        fp = fingerprint(prompt_token_ids, pdict)
        self.quarantine.check(fp)
        return fp

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[EngineOutput]:
        """Send the request and yield its outputs until finished. Raises FerryError subclasses (the refusals of
        :meth:`check_admission` before anything is sent); leaving early aborts the request in the engine."""
        pdict = params.to_dict()
        fp = self._admit(request_id, prompt_token_ids, pdict)
        isolate = self.quarantine.is_suspect(fp)
        if isolate:
            log.warning("[%s] runs isolated: the same request was running when the engine failed", request_id)
        q: asyncio.Queue = asyncio.Queue()
        # NOTE: registered before the send: the send may yield to the event loop, and an answer that arrives
        # then (an immediate rejection) must find its queue
        self._streams[request_id] = q
        self._meta[request_id] = _InFlight(fp, isolate)
        finished = False
        try:
            if self.faults.enabled and self.faults.fires("ipc_garbage"):
                await self._send_garbage()
            try:
                # NOBLOCK: never wait on a pipe whose reader may be dead or stopped
                await self._push.send(ipc.encode(ipc.AddRequest(request_id, list(prompt_token_ids), pdict,
                                                                isolate=isolate)), zmq.NOBLOCK)
            except (zmq.ZMQError, AttributeError) as e:   # AttributeError: the pipe was torn down meanwhile
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
            self._streams.pop(request_id, None)
            self._meta.pop(request_id, None)
            if not finished:
                self._send_abort([request_id])

    async def _send_garbage(self) -> None:
        """Fault ``ipc_garbage``: malformed messages the engine must survive (undecodable bytes; a message with
        unknown fields; an AddRequest whose fields are wrong)."""
        import msgpack

        for data in (b"\xc1 not msgpack", msgpack.packb(["AddRequest", {"nonsense": 1}]),
                     msgpack.packb(["NoSuchMessage", {}]),
                     ipc.encode(ipc.AddRequest(f"garbage-{os.urandom(4).hex()}", ["x", -1], {"temperature": "hot"})),
                     ipc.encode(ipc.AddRequest(f"garbage-{os.urandom(4).hex()}", [1, 2], "not a dict"))):
            try:
                await self._push.send(data, zmq.NOBLOCK)
            except (zmq.ZMQError, AttributeError):
                return

    def _send_nowait(self, msg) -> None:
        """Fire-and-forget send; a full or dead pipe drops the message (the engine's death is handled elsewhere)."""
        if self._push is None:
            return
        try:
            fut = self._push.send(ipc.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieve, never log

    def _send_abort(self, ids: list[str]) -> None:
        self._send_nowait(ipc.AbortRequest(ids))

    async def abort(self, request_id: str) -> None:
        """Abort in the engine; the request's stream (if still open) ends without further outputs."""
        self._send_abort([request_id])
