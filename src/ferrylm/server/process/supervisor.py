"""The Supervisor: owns the engine process's life and implements EngineClient for the HTTP layer.

- start: private IPC dir (named with the pid; stale dirs of dead servers are swept) → bind zmq pipes → spawn
  ``engine_main`` ("spawn" context).
- readiness: state ``loading`` until the engine's Ready message; ``ready`` after. /health is ready only while
  the engine's heartbeat (every ~0.5 s, busy or idle) is fresh; a stale heartbeat reads ``stalled``.
- death: the process sentinel is watched by the event loop (``add_reader``, event-driven, no polling); every
  in-flight request is answered at once with EngineUnavailable, then the engine restarts with backoff
  (``restart_policy.py``); past its limit the state is ``dead`` and ``on_fatal`` is called so the server exits
  non-zero.
- stall: the progress watchdog (a tick every 0.25 s) kills an engine that has requests running but made no
  progress, or sent no heartbeat, for its deadline (``watchdog.py`` judges): its requests get
  EngineStalled at once, its Python stacks are dumped to the log (SIGUSR1 → faulthandler; impossible when the
  process is stopped, which is logged), then SIGKILL and the ordinary death path (restart with backoff) follow.
- failed step: a ``Fatal`` from a ready engine (a sticky device error, an unexpected step error) turns /health red
  at once, answers every request in flight (503 ``device_error`` / ``engine_unavailable``), and the engine is
  restarted when it exits (SIGKILLed if it has not within ``FATAL_EXIT_WAIT_S``).
- answers (``inflight.py``): every request in flight gets one terminal answer when the engine goes away; the
  requests of the failing step get a quarantine strike (``quarantine.py``), so no request can be retried into the
  restart limit.
- drain: ``begin_drain`` refuses new requests (``draining``); ``drain`` waits for the running ones; an engine that
  dies while the server drains is not restarted. Starting and stopping the processes: ``processes.py``.
- each engine generation gets fresh IPC endpoints (``channel.py``), so nothing queued for a dead engine reaches its
  successor.
- tensor parallel (``--tensor-parallel-size N > 1``): a generation is a group of N rank processes started together
  (rank 0 = the engine above; ranks 1..N-1 = followers, ``engine/parallel/follower.py``, meeting rank 0 at a file
  store in the IPC dir). Every rank's sentinel is watched: a follower's death fails the in-flight requests like
  the engine's and kills rank 0, whose exit restarts the whole group; rank 0's exit kills the followers. Heartbeats
  and the watchdog stay rank 0's: a follower stuck in a collective stalls rank 0.
- one guard per boundary: the reader task (``channel.py``) survives any message it cannot decode or handle
  (logged), the watchdog survives its own errors.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import os
import signal
import time
from typing import AsyncIterator, Callable

import zmq
import zmq.asyncio

from ferrylm.engine import ipc
from ferrylm.engine.outputs import EngineOutput
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.worker import EngineSpec
from ferrylm.errors import DeviceError, EngineStalled, EngineUnavailable, FerryError, InvalidRequest
from ferrylm.faults import NO_FAULTS, FaultInjector
from ferrylm.server.process.channel import EngineChannel
from ferrylm.server.process.engine_client import HealthState, ModelInfo
from ferrylm.server.process.inflight import InFlight
from ferrylm.server.process.ipc_dir import IpcDir
from ferrylm.server.process.processes import (ask_for_stacks, describe_exit, is_stopped, kill_followers,
                                              kill_if_alive, kill_processes, spawn_engine, spawn_follower,
                                              stop_engine)
from ferrylm.server.process.quarantine import Quarantine, fingerprint
from ferrylm.server.process.restart_policy import RestartPolicy
from ferrylm.server.process.watchdog import ProgressWatch

log = logging.getLogger("ferrylm.supervisor")

HEARTBEAT_STALE_S = 5.0       # no heartbeat for this long → /health says "stalled" (10 missed beats)
WATCHDOG_TICK_S = 0.25        # how often the progress watchdog looks
STACK_DUMP_WAIT_S = 0.5       # time the engine gets to write its stacks before SIGKILL
FATAL_EXIT_WAIT_S = 2.0       # an engine that reported a fatal error is SIGKILLed if it has not exited by then
MODEL_ERROR_CODES = frozenset({"model_load_error", "unsupported_architecture"})  # start-up failures: exit 2


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
        self._watch = ProgressWatch(self.watchdog_timeout)
        self._restarts = RestartPolicy(max_restarts, restart_window_s)
        self._ctx = zmq.asyncio.Context()
        self._ipc = IpcDir(janitor=janitor)
        self._dir = self._ipc.path
        self._gen = 0
        self._proc: mp.process.BaseProcess | None = None
        self._followers: list[mp.process.BaseProcess] = []   # tensor-parallel ranks 1..N-1 of this generation
        self.tp_size = int(engine_config.get("tensor_parallel_size", 1) or 1)
        self._channel: EngineChannel | None = None   # the pipes of the current generation
        self._watchdog: asyncio.Task | None = None
        self._stalled_gen = 0         # generation the watchdog condemned (its exit is expected)
        self._failed_gen = 0          # generation whose failure was already answered (watchdog or Fatal)
        self._closing = False
        self._draining = False
        self.quarantine = Quarantine(window_s=restart_window_s)
        self._inflight = InFlight(self.quarantine)
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
        gen = self._gen
        self._channel = EngineChannel(self._ctx, self._dir, gen)
        rendezvous = f"{self._dir}/tp-{gen}" if self.tp_size > 1 else None
        spec = EngineSpec(self.model_path, self.engine_config, self._channel.in_addr, self._channel.out_addr,
                          os.getpid(), self.log_level, tp_rendezvous=rendezvous)
        proc = self._proc = spawn_engine(spec)
        self.engine_pid = proc.pid
        self._followers = [spawn_follower(spec, rank, self.tp_size, proc.pid) for rank in range(1, self.tp_size)]
        self.state = "loading" if self.num_restarts == 0 else "restarting"
        self._watch.reset(time.monotonic())
        log.info("engine process %d started (generation %d)", proc.pid, gen)
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, self._on_engine_exit, proc, gen)
        for rank, f in enumerate(self._followers, start=1):
            log.info("tensor-parallel rank %d process %d started (generation %d)", rank, f.pid, gen)
            loop.add_reader(f.sentinel, self._on_follower_exit, f, gen, rank)
        self._channel.start_reader(functools.partial(self._on_message, gen=gen))

    @property
    def rank_pids(self) -> list[int]:
        """The pids of the current generation's rank processes (rank 0 first; one entry without tensor parallel)."""
        procs = ([self._proc] if self._proc is not None else []) + list(self._followers)
        return [p.pid for p in procs if p.pid is not None]

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
                  "the rank group", rank, proc.pid, how, len(self._inflight))
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
        await stop_engine(self._proc, self._followers, lambda: self._send_nowait(ipc.Shutdown()), state=self.state,
                          timeout_s=timeout_s)
        self._inflight.fail_all(EngineUnavailable("the server is shutting down"))
        self._teardown_channel()
        self._ctx.term()
        self._ipc.remove()

    def kill_now(self) -> None:
        """Synchronous last resort (second signal): SIGKILL the engine, reap it, remove the IPC dir."""
        self._closing = True
        kill_processes([self._proc, *self._followers])
        self._ipc.remove(wait_s=0)

    def _teardown_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _on_engine_exit(self, proc, gen: int) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        # NOTE: the sentinel fires when the child's fds close, a moment before it becomes reapable; join with a
        # timeout does a blocking waitpid, which returns within microseconds here.
        proc.join(timeout=1.0)
        if gen != self._gen or self._closing:
            return
        kill_followers(self._followers)   # no rank outlives rank 0
        how = describe_exit(proc.exitcode)
        stalled = gen == self._stalled_gen
        log.error("engine process %d exited (%s)%s; answering %d in-flight requests", proc.pid, how,
                  " after the watchdog killed it" if stalled else "", len(self._inflight))
        err = EngineUnavailable(f"the engine process exited ({how}); it is restarting")
        if gen != self._failed_gen:
            # NOTE: SIGKILL comes from outside (an operator, the kernel's OOM killer): not held against the requests
            # of the step; a crash (segfault, abort, exit) is
            self._engine_failed(gen, f"the engine process exited ({how})", err,
                                blame=proc.exitcode != -signal.SIGKILL)
        else:
            self._inflight.fail_all(err)   # answered already (watchdog / Fatal); anything registered since
        self._teardown_channel()
        if self.state == "dead":
            return  # fatal start-up error already reported
        if self._draining:
            log.info("not restarting the engine: the server is shutting down")
            self.state, self.detail = "dead", f"the engine exited ({how}) while the server was shutting down"
            return
        now = time.monotonic()
        delay = self._restarts.next_delay(now)
        if delay is None:
            self._give_up(f"the engine {'stalled' if stalled else 'died'} ({how}); "
                          f"{self._restarts.recent(now)} restarts within {self._restarts.window_s:.0f} s already "
                          f"(--max-engine-restarts {self._restarts.max_restarts})")
            return
        self.num_restarts += 1
        self.state = "restarting"
        self.detail = f"engine {'stalled and was killed' if stalled else 'exited'} ({how}); " \
                      f"restart {self.num_restarts}"
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

    def _engine_failed(self, gen: int, why: str, err: FerryError, request_ids: list[str] | None = None, *,
                       blame: bool = True) -> None:
        """Generation ``gen`` failed (``why``): unless ``blame`` is False (the cause is outside the engine:
        SIGKILL, SIGSTOP), strike the requests of its failing step (``request_ids``, else the last heartbeat's);
        answer the quarantined ones with RequestQuarantined and every other request in flight with ``err``. Once
        per generation."""
        self._failed_gen = gen
        struck = (request_ids if request_ids is not None else self._watch.suspects()) if blame else []
        self._inflight.fail_engine(why, err, struck)

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
        """Seconds without progress after which the running engine is stalled (:meth:`ProgressWatch.stall_deadline`)."""
        return self._watch.stall_deadline()

    def _check_progress(self, now: float) -> None:
        if not self.watchdog_timeout or self.state != "ready" or self._proc is None or self._closing:
            return
        why = self._watch.stall_reason(now, len(self._inflight))
        if why is not None:
            self._stall(why)

    def _stall(self, why: str) -> None:
        proc, gen = self._proc, self._gen
        assert proc is not None
        log.error("engine process %d is stalled: %s; answering %d requests, dumping its stacks, restarting it",
                  proc.pid, why, len(self._inflight))
        self._stalled_gen = gen
        self.state = "stalled"
        self.detail = why
        stopped = is_stopped(proc.pid)   # SIGSTOP / a debugger: not the requests' doing
        # NOTE: under tensor parallel rank 0 also stalls when a follower it waits for in a collective is stopped
        stopped_follower = any(is_stopped(f.pid) for f in self._followers if f.pid is not None)
        if stopped_follower:
            log.error("a tensor-parallel follower of engine process %d is stopped (SIGSTOP or a debugger)", proc.pid)
        self._engine_failed(gen, "it stalled", EngineStalled(f"the engine stalled ({why}); it is being restarted"),
                            blame=not (stopped or stopped_follower))
        self._teardown_channel()   # nothing more from or to this generation
        if stopped:
            log.error("cannot dump the stalled engine's Python stacks: process %d is stopped (SIGSTOP or a "
                      "debugger) and cannot run a signal handler; killing it", proc.pid)
            delay = 0.0
        elif ask_for_stacks(proc, self._followers):
            delay = STACK_DUMP_WAIT_S
        else:
            return  # already gone; the sentinel handles it
        # SIGKILL works on a stopped process too; the sentinel then restarts the engine
        asyncio.get_running_loop().call_later(delay, kill_if_alive, proc, gen, "it stalled")

    # --- IPC ----------------------------------------------------------------------------------------------------
    def _on_message(self, data: bytes, gen: int) -> None:
        """Handle one message of engine generation ``gen``. Raises on a message it cannot handle (the reader
        logs it and goes on)."""
        if gen != self._gen:
            return   # a message of a generation gone: its failure was answered already
        now = time.monotonic()
        self._watch.last_heartbeat = now
        try:
            msg = ipc.decode(data)
        except Exception:  # a bad message must not stop the reader
            log.exception("undecodable IPC message from the engine (%d bytes)", len(data))
            return
        if isinstance(msg, ipc.Outputs):
            self._watch.last_progress = now
            self._inflight.deliver(msg.outputs)
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
            self._watch.last_progress = now
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
        self._watch.on_heartbeat(prog, self.last_stats, msg.last_step_age, now)

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
            asyncio.get_running_loop().call_later(
                FATAL_EXIT_WAIT_S, kill_if_alive, proc, gen,
                f"it reported a fatal error but did not exit within {FATAL_EXIT_WAIT_S:.0f} s")

    # --- drain --------------------------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    def begin_drain(self) -> None:
        """Refuse new requests from now on (503, /health ``draining``); running ones continue."""
        self._draining = True

    async def drain(self, timeout_s: float) -> int:
        """Wait until no request is in flight or ``timeout_s`` passed; return how many are still in flight."""
        return await self._inflight.drain(timeout_s)

    def fail_in_flight(self, err: FerryError) -> None:
        """Answer every in-flight request with ``err`` (abort in the engine follows from the request's end)."""
        self._inflight.fail_all(err)

    # --- EngineClient -----------------------------------------------------------------------------------------
    def health(self) -> HealthState:
        now = time.monotonic()
        last_heartbeat = self._watch.last_heartbeat
        hb_age = now - last_heartbeat if last_heartbeat else None
        extra = {"engine_pid": self.engine_pid, "restarts": self.num_restarts,
                 **({"tensor_parallel_pids": self.rank_pids} if self.tp_size > 1 else {}),
                 "heartbeat_age_s": None if hb_age is None else round(hb_age, 2),
                 "in_flight": len(self._inflight), "step": self._watch.step(),
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
        if self.state != "ready" or self._channel is None:
            raise EngineUnavailable(f"the engine is not ready ({self.state})")
        if request_id in self._inflight:
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
        channel = self._channel   # not None: _admit checked it, and nothing awaited since

        async def send() -> None:
            if self.faults.enabled and self.faults.fires("ipc_garbage"):
                await channel.send_garbage()
            await channel.send(ipc.AddRequest(request_id, list(prompt_token_ids), pdict, isolate=isolate))

        async for out in self._inflight.run(request_id, fp, isolate, send, self._send_abort):
            yield out

    def _send_nowait(self, msg) -> None:
        """Fire-and-forget send to the current generation (:meth:`EngineChannel.send_nowait`); none: dropped."""
        if self._channel is not None:
            self._channel.send_nowait(msg)

    def _send_abort(self, ids: list[str]) -> None:
        self._send_nowait(ipc.AbortRequest(ids))

    async def abort(self, request_id: str) -> None:
        """Abort in the engine; the request's stream (if still open) ends without further outputs."""
        self._send_abort([request_id])
