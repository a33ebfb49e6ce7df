"""The Supervisor: owns the engine process's life and implements EngineClient for the HTTP layer.

- start: private IPC dir (includes the pid) → bind zmq pipes → spawn ``engine_main`` ("spawn" context).
- readiness: state ``loading`` until the engine's Ready message; ``ready`` after.
- death: the process sentinel is watched by the event loop (``add_reader``, event-driven, no polling); every
  in-flight request is answered at once with EngineUnavailable, then the engine restarts with backoff, at most
  ``max_restarts`` times per ``restart_window_s``; past that the state is ``dead`` and ``on_fatal`` is called so
  the server exits non-zero.
- each engine generation gets fresh IPC endpoints, so nothing queued for a dead engine reaches its successor.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
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
from ferrylm.engine.worker import EngineSpec, engine_main
from ferrylm.errors import (ContextLengthExceeded, EngineUnavailable, FerryError, InsufficientMemory,
                            InvalidRequest, QueueTimeout)
from ferrylm.server.engine_client import HealthState, ModelInfo

log = logging.getLogger("ferrylm.supervisor")

_ERROR_TYPES: dict[str, type[FerryError]] = {
    "context_length_exceeded": ContextLengthExceeded,
    "invalid_request": InvalidRequest,
    "insufficient_memory": InsufficientMemory,
    "queue_timeout": QueueTimeout,
    "engine_unavailable": EngineUnavailable,
}


def error_from_output(out: EngineOutput) -> FerryError:
    """Map an engine error output to the typed error the HTTP edge understands."""
    cls = _ERROR_TYPES.get(out.error_code or "", EngineUnavailable)
    return cls(out.error_message or out.error_code or "engine error", code=out.error_code)


class Supervisor:
    """Spawns and watches the engine; routes requests and outputs.

    Args:
        model_path: HF folder the engine loads.
        engine_config: EngineConfig as a dict.
        model_info: what the frontend knows before the engine is up (updated from the engine's Ready).
        max_restarts: restarts allowed within ``restart_window_s`` seconds before giving up.
        on_fatal: called (no args) when the engine is dead for good; the server then exits non-zero.
    """

    def __init__(self, model_path: str, engine_config: dict, model_info: ModelInfo, *, max_restarts: int = 3,
                 restart_window_s: float = 600.0, on_fatal: Callable[[], None] | None = None,
                 log_level: str = "INFO"):
        self.model_path = model_path
        self.engine_config = engine_config
        self.model_info = model_info
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.on_fatal = on_fatal
        self.log_level = log_level
        self.state = "loading"
        self.detail = "engine starting"
        self.engine_pid: int | None = None
        self.num_restarts = 0
        self.last_stats: dict = {}
        self.last_heartbeat = 0.0
        self._restart_times: deque[float] = deque()
        self._streams: dict[str, asyncio.Queue] = {}
        self._ctx = zmq.asyncio.Context()
        self._dir = tempfile.mkdtemp(prefix=f"ferrylm-{os.getpid()}-")
        self._gen = 0
        self._proc: mp.process.BaseProcess | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._closing = False

    # --- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine (returns at once; readiness arrives later)."""
        self._spawn()

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
        self.last_heartbeat = time.monotonic()
        log.info("engine process %d started (generation %d)", proc.pid, self._gen)
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, self._on_engine_exit, proc, self._gen)
        self._reader = loop.create_task(self._read_loop(self._pull, self._gen))

    async def close(self, timeout_s: float = 5.0) -> None:
        """Ask the engine to stop, wait up to ``timeout_s``, then kill it; remove the IPC dir."""
        self._closing = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            try:
                await self._push.send(ipc.encode(ipc.Shutdown()))
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + timeout_s
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=2)
        self._fail_all(EngineUnavailable("the server is shutting down"))
        self._teardown_sockets()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _teardown_sockets(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for s in (self._push, self._pull):
            if s is not None:
                s.close(linger=0)
        self._push = self._pull = None

    def _on_engine_exit(self, proc, gen: int) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        proc.join(timeout=0)
        if gen != self._gen or self._closing:
            return
        code = proc.exitcode
        log.error("engine process %d exited (code %s); answering %d in-flight requests", proc.pid, code,
                  len(self._streams))
        self._fail_all(EngineUnavailable(f"the engine process exited (code {code}); it is restarting"))
        self._teardown_sockets()
        if self.state == "dead":
            return  # fatal start-up error already reported
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > self.restart_window_s:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.max_restarts:
            self._give_up(f"the engine died {len(self._restart_times) + 1} times within "
                          f"{self.restart_window_s:.0f} s (--max-engine-restarts {self.max_restarts})")
            return
        self._restart_times.append(now)
        self.num_restarts += 1
        self.state = "restarting"
        self.detail = f"engine exited with code {code}; restart {self.num_restarts}"
        delay = min(0.5 * 2 ** (len(self._restart_times) - 1), 10.0)
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
        for q in self._streams.values():
            q.put_nowait(err)

    async def _read_loop(self, sock: zmq.asyncio.Socket, gen: int) -> None:
        try:
            while True:
                msg = ipc.decode(await sock.recv())
                if gen != self._gen:
                    return
                self.last_heartbeat = time.monotonic()
                if isinstance(msg, ipc.Outputs):
                    for out in msg.outputs:
                        q = self._streams.get(out.request_id)
                        if q is not None:
                            q.put_nowait(out)
                elif isinstance(msg, ipc.Heartbeat):
                    self.last_stats = msg.stats
                elif isinstance(msg, ipc.Ready):
                    info = msg.info
                    self.model_info.max_model_len = info["max_model_len"]
                    self.model_info.kv_pool_tokens = info["kv_pool_tokens"]
                    self.state = "ready"
                    self.detail = ""
                    log.info("engine ready: %s", info)
                elif isinstance(msg, ipc.Fatal):
                    log.error("engine reported a fatal error: %s", msg.message)
                    if self.state == "loading":
                        self._give_up(f"the engine failed to start: {msg.message}")
        except asyncio.CancelledError:
            pass
        except Exception:  # pragma: no cover - a decode bug must not go unnoticed
            log.exception("IPC read loop failed")

    # --- EngineClient -----------------------------------------------------------------------------------------
    def health(self) -> HealthState:
        return HealthState(self.state, self.detail, {"engine_pid": self.engine_pid, "restarts": self.num_restarts})

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[EngineOutput]:
        """Send the request and yield its outputs until finished. Raises FerryError subclasses; leaving early
        aborts the request in the engine."""
        if self.state != "ready" or self._push is None:
            raise EngineUnavailable(f"the engine is not ready ({self.state})")
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        finished = False
        try:
            await self._push.send(ipc.encode(ipc.AddRequest(request_id, list(prompt_token_ids), params.to_dict())))
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

    def _send_abort(self, ids: list[str]) -> None:
        if self._push is not None:
            try:
                self._push.send(ipc.encode(ipc.AbortRequest(ids)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    async def abort(self, request_id: str) -> None:
        """Abort in the engine; the request's stream (if still open) ends without further outputs."""
        self._send_abort([request_id])
