"""A Supervisor wired to a scripted engine over real zmq pipes, without an engine process: the test plays the
engine (reads AddRequests, sends heartbeats, outputs, Fatal messages) and drives the watchdog's clock."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from ferrylm.engine import ipc
from ferrylm.engine.outputs import EngineOutput
from ferrylm.server.process.channel import EngineChannel
from ferrylm.server.process.engine_client import ModelInfo
from ferrylm.server.process.supervisor import Supervisor


@dataclass
class FakeProc:
    """Stands in for the engine's multiprocessing.Process: a pid nobody owns is never signalled (tests replace
    ``_stall`` where they would signal)."""

    pid: int = 999_999
    exitcode: int | None = None
    sentinel: int = field(default_factory=lambda: os.pipe()[0])
    killed: bool = False

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.killed = True
        self.exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        pass


class ScriptedEngine:
    """The engine side of the pipes of ``sup``'s current generation."""

    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.pull = sup._ctx.socket(zmq.PULL)
        self.pull.connect(f"ipc://{sup._dir}/in-{sup._gen}")
        self.push = sup._ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(f"ipc://{sup._dir}/out-{sup._gen}")

    async def recv(self, timeout: float = 5.0):
        return ipc.decode(await asyncio.wait_for(self.pull.recv(), timeout))

    async def send(self, msg) -> None:
        await self.push.send(ipc.encode(msg))

    async def send_raw(self, data: bytes) -> None:
        await self.push.send(data)

    async def heartbeat(self, *, ticks: int = 0, in_step: bool = False, running: int = 1, ids=(),
                        expected_step_s: float = 0.0, ticks_per_step: int = 1, stats: dict | None = None) -> None:
        await self.send(ipc.Heartbeat(stats=stats if stats is not None else {"num_running": running},
                                      progress={"ticks": ticks, "in_step": in_step, "num_running": running,
                                                "step_request_ids": list(ids), "expected_step_s": expected_step_s,
                                                "ticks_per_step": ticks_per_step, "step_age_s": 0.0,
                                                "step_tokens": 0}))

    async def output(self, rid: str, tokens=(1,), finish: str | None = None, error: str | None = None) -> None:
        await self.send(ipc.Outputs([EngineOutput(rid, list(tokens), finish_reason=finish, error_code=error,
                                                  error_message=error)]))

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)


async def ready_supervisor(tmp_path, **kw) -> tuple[Supervisor, ScriptedEngine]:
    """A Supervisor in state ``ready`` with live, connected pipes and its reader task running."""
    kw.setdefault("janitor", False)
    sup = Supervisor(str(tmp_path), {}, ModelInfo("m", str(tmp_path), 128), **kw)
    sup._gen = 1
    sup._channel = EngineChannel(sup._ctx, sup._dir, 1)
    sup._proc = FakeProc()
    sup.engine_pid = sup._proc.pid
    sup.state = "ready"
    sup._watch.reset(time.monotonic())
    sup._channel.start_reader(lambda data: sup._on_message(data, 1))
    eng = ScriptedEngine(sup)
    # NOTE: zmq connects in the background; a PUSH without a connected peer refuses a NOBLOCK send. Wait until both
    # pipes carry a message (as the real engine's Ready proves before the frontend sends anything).
    deadline = time.monotonic() + 5
    while True:
        try:
            await sup._channel.push.send(ipc.encode(ipc.AbortRequest([])), zmq.NOBLOCK)
            break
        except zmq.Again:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.005)
    assert isinstance(await eng.recv(), ipc.AbortRequest)
    t = time.monotonic()
    await eng.send(ipc.Heartbeat(stats={"num_running": 0}))
    await wait_for(lambda: sup._watch.last_heartbeat >= t, what="the first heartbeat")
    return sup, eng


async def wait_for(cond, timeout: float = 5.0, what: str = "a condition") -> None:
    """Poll ``cond()`` on the event loop until true; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


async def shutdown(sup: Supervisor, eng: ScriptedEngine) -> None:
    """Close both sides (the fake engine process counts as exited, so close() does not wait for it)."""
    eng.close()
    sup._proc.exitcode = 0 if sup._proc.exitcode is None else sup._proc.exitcode
    await sup.close()
