"""The Supervisor: owns the engine process's life and implements EngineClient for the HTTP layer.

- start: private IPC dir (named with the pid; stale dirs of dead servers are swept) → bind zmq pipes → spawn
  ``engine_main`` ("spawn" context).
- readiness: state ``loading`` until the engine's Ready message; ``ready`` after. /health is ready only while
  the engine's heartbeat (every ~0.5 s, busy or idle) is fresh; a stale heartbeat reads ``stalled``.
- death: the process sentinel is watched by the event loop (``add_reader``, event-driven, no polling); every
  in-flight request is answered at once with EngineUnavailable, then the engine restarts with backoff, at most
  ``max_restarts`` times per ``restart_window_s``; past that the state is ``dead`` and ``on_fatal`` is called so
  the server exits non-zero.
- stall: the progress watchdog (a tick every 0.25 s) kills an engine that has requests running but completed no
  step, or sent no heartbeat, for ``watchdog_timeout`` s: its requests get EngineStalled at once, its Python
  stacks are dumped to the log (SIGUSR1 → faulthandler; impossible when the process is stopped, which is logged),
  then SIGKILL and the ordinary death path (restart with backoff) follow.
- drain: ``begin_drain`` refuses new requests (``draining``); ``drain`` waits for the running ones.
- each engine generation gets fresh IPC endpoints, so nothing queued for a dead engine reaches its successor.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import tempfile
import time
from collections import deque
from dataclasses import asdict
from typing import AsyncIterator, Callable

import zmq
import zmq.asyncio

from ferrylm.engine import ipc
from ferrylm.engine.outputs import EngineOutput
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.worker import STACK_DUMP_SIGNAL, EngineSpec, engine_main
from ferrylm.errors import EngineStalled, EngineUnavailable, FerryError, InvalidRequest, error_from_code
from ferrylm.server.engine_client import HealthState, ModelInfo

log = logging.getLogger("ferrylm.supervisor")

HEARTBEAT_STALE_S = 5.0       # no heartbeat for this long → /health says "stalled" (10 missed beats)
WATCHDOG_TICK_S = 0.25        # how often the progress watchdog looks
STACK_DUMP_WAIT_S = 0.5       # time the engine gets to write its stacks before SIGKILL
_IPC_PREFIX = "ferrylm-"

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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_ipc_dirs(tmpdir: str | None = None) -> int:
    """Remove IPC dirs left by servers that were SIGKILLed (their pid is gone). Returns how many."""
    n = 0
    for d in glob.glob(os.path.join(tmpdir or tempfile.gettempdir(), f"{_IPC_PREFIX}*-*")):
        m = re.fullmatch(rf"{_IPC_PREFIX}(\d+)-\w+", os.path.basename(d))
        if not m or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        try:
            if os.stat(d).st_uid != os.getuid() or not all(re.fullmatch(r"(in|out)-\d+", f) for f in os.listdir(d)):
                continue  # not ours, or not only IPC endpoints: leave it alone
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        n += 1
    return n


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
        on_fatal: called (no args) when the engine is dead for good; the server then exits non-zero.
        watchdog_timeout: seconds without a completed step (while requests run) or without a heartbeat after
            which a ready engine is declared stalled and restarted; 0 or None turns the watchdog off.
    """

    def __init__(self, model_path: str, engine_config: dict, model_info: ModelInfo, *, max_restarts: int = 3,
                 restart_window_s: float = 600.0, on_fatal: Callable[[], None] | None = None,
                 log_level: str = "INFO", watchdog_timeout: float | None = 120.0):
        self.model_path = model_path
        self.engine_config = engine_config
        self.model_info = model_info
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.on_fatal = on_fatal
        self.log_level = log_level
        self.watchdog_timeout = watchdog_timeout or None
        self.heartbeat_stale_s = min(HEARTBEAT_STALE_S, self.watchdog_timeout or HEARTBEAT_STALE_S)
        self.state = "loading"
        self.detail = "engine starting"
        self.engine_pid: int | None = None
        self.num_restarts = 0
        self.last_stats: dict = {}
        self.memory_plan: dict | None = None  # the engine's boot memory plan (from its Ready message)
        self.last_heartbeat = 0.0
        self._last_progress = 0.0     # frontend clock: last moment the engine was known to make progress
        self._restart_times: deque[float] = deque()
        self._streams: dict[str, asyncio.Queue] = {}
        self._ctx = zmq.asyncio.Context()
        sweep_stale_ipc_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{os.getpid()}-")
        self._gen = 0
        self._proc: mp.process.BaseProcess | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._stalled_gen = 0         # generation the watchdog condemned (its exit is expected)
        self._closing = False
        self._draining = False

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
        spec = EngineSpec(self.model_path, self.engine_config, in_addr, out_addr, os.getpid(), self.log_level)
        proc = mp.get_context("spawn").Process(target=engine_main, args=(asdict(spec),), name="ferrylm-engine",
                                               daemon=True)
        proc.start()
        self._proc = proc
        self.engine_pid = proc.pid
        self.state = "loading" if self.num_restarts == 0 else "restarting"
        self.last_heartbeat = self._last_progress = time.monotonic()
        log.info("engine process %d started (generation %d)", proc.pid, self._gen)
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, self._on_engine_exit, proc, self._gen)
        self._reader = loop.create_task(self._read_loop(self._pull, self._gen))

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
        self._fail_all(EngineUnavailable("the server is shutting down"))
        self._teardown_sockets()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def kill_now(self) -> None:
        """Synchronous last resort (second signal): SIGKILL the engine, reap it, remove the IPC dir."""
        self._closing = True
        proc = self._proc
        if proc is not None and proc.pid is not None:
            try:
                proc.kill()
                proc.join(timeout=2)
            except Exception:  # noqa: BLE001 - we are exiting anyway
                pass
        shutil.rmtree(self._dir, ignore_errors=True)

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
        how = describe_exit(proc.exitcode)
        stalled = gen == self._stalled_gen
        log.error("engine process %d exited (%s)%s; answering %d in-flight requests", proc.pid, how,
                  " after the watchdog killed it" if stalled else "", len(self._streams))
        self._fail_all(EngineUnavailable(f"the engine process exited ({how}); it is restarting"))
        self._teardown_sockets()
        if self.state == "dead":
            return  # fatal start-up error already reported
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
        if not self._closing and self.state != "dead":
            self._spawn()

    def _give_up(self, why: str) -> None:
        log.error("engine is dead for good: %s", why)
        self.state = "dead"
        self.detail = why
        if self.on_fatal is not None:
            self.on_fatal()

    def _fail_all(self, err: FerryError) -> None:
        """Answer every in-flight request with (a copy of) ``err``."""
        for q in self._streams.values():
            q.put_nowait(type(err)(err.message, code=err.code))

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

    def _check_progress(self, now: float) -> None:
        wd = self.watchdog_timeout
        if not wd or self.state != "ready" or self._proc is None or self._closing:
            return
        no_progress = now - self._last_progress
        no_heartbeat = now - self.last_heartbeat
        if self._streams and no_progress > wd:
            self._stall(f"{len(self._streams)} requests in flight but no step completed for {no_progress:.1f} s "
                        f"(--watchdog-timeout {wd:g}; last heartbeat {no_heartbeat:.1f} s ago)")
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
        self._fail_all(EngineStalled(f"the engine stalled ({why}); it is being restarted"))
        self._teardown_sockets()   # nothing more from or to this generation
        if _is_stopped(proc.pid):
            log.error("cannot dump the stalled engine's Python stacks: process %d is stopped (SIGSTOP or a "
                      "debugger) and cannot run a signal handler; killing it", proc.pid)
            delay = 0.0
        else:
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
            now = time.monotonic()
            self.last_heartbeat = now
            try:
                msg = ipc.decode(data)
            except Exception:  # a bad message must not stop the reader
                log.exception("undecodable IPC message from the engine (%d bytes)", len(data))
                continue
            if isinstance(msg, ipc.Outputs):
                self._last_progress = now
                for out in msg.outputs:
                    q = self._streams.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(msg, ipc.Heartbeat):
                self.last_stats = msg.stats
                if not msg.stats.get("num_running"):
                    self._last_progress = now                      # idle is not stuck
                else:
                    self._last_progress = max(self._last_progress, now - float(msg.last_step_age))
            elif isinstance(msg, ipc.Ready):
                info = msg.info
                self.model_info.max_model_len = info["max_model_len"]
                self.model_info.kv_pool_tokens = info["kv_pool_tokens"]
                self.memory_plan = info.get("memory_plan")
                self._last_progress = now
                self.state = "ready"
                self.detail = ""
                log.info("engine ready: %s", {k: v for k, v in info.items() if k != "memory_plan"})
            elif isinstance(msg, ipc.Fatal):
                log.error("engine reported a fatal error: %s", msg.message)
                if self.state == "loading":  # the first start failed: restarting would fail the same way
                    self._give_up(f"the engine failed to start: {msg.message}")

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
        extra = {"engine_pid": self.engine_pid, "restarts": self.num_restarts,
                 "heartbeat_age_s": None if hb_age is None else round(hb_age, 2),
                 "in_flight": len(self._streams), "engine": dict(self.last_stats)}
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
                "live": dict(stats.get("memory") or {}), "oom_recoveries": dict(stats.get("oom_recoveries") or {}),
                "kv_pages_used": stats.get("kv_pages_used"), "kv_pages_total": stats.get("kv_pages_total")}

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[EngineOutput]:
        """Send the request and yield its outputs until finished. Raises FerryError subclasses; leaving early
        aborts the request in the engine."""
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        if self.state != "ready" or self._push is None:
            raise EngineUnavailable(f"the engine is not ready ({self.state})")
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        q: asyncio.Queue = asyncio.Queue()
        try:
            # NOBLOCK: never wait on a pipe whose reader may be dead or stopped
            await self._push.send(ipc.encode(ipc.AddRequest(request_id, list(prompt_token_ids),
                                                            params.to_dict())), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineUnavailable(f"the engine is not accepting requests ({e})") from None
        self._streams[request_id] = q
        finished = False
        try:
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
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send_abort([request_id])

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
