"""The zmq pipes between the frontend and one engine generation.

Each generation gets fresh endpoints in the server's private IPC dir (``in-GEN``: frontend → engine, PUSH;
``out-GEN``: engine → frontend, PULL), so nothing queued for a dead engine reaches its successor. Every send is
NOBLOCK: the frontend never waits on a pipe whose reader may be dead or stopped. One guard per message: the reader
task survives anything a message holds (heartbeats that went unread would make the watchdog kill a healthy engine).

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable

import zmq
import zmq.asyncio

from ferrylm.engine import ipc

log = logging.getLogger("ferrylm.supervisor")


class EngineChannel:
    """The two bound pipes of generation ``gen`` in ``ipc_dir``, and the task reading the engine's messages.

    ``in_addr`` / ``out_addr`` are the endpoints the engine connects to.
    """

    def __init__(self, ctx: zmq.asyncio.Context, ipc_dir: str, gen: int):
        self.in_addr = f"ipc://{ipc_dir}/in-{gen}"
        self.out_addr = f"ipc://{ipc_dir}/out-{gen}"
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.bind(self.in_addr)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(self.out_addr)
        self.reader: asyncio.Task | None = None

    def start_reader(self, on_message: Callable[[bytes], None]) -> None:
        """Hand every message the engine sends to ``on_message`` (raw bytes), on the running loop, until
        :meth:`close`."""
        self.reader = asyncio.get_running_loop().create_task(self._read_loop(on_message))

    async def _read_loop(self, on_message: Callable[[bytes], None]) -> None:
        while True:
            try:
                data = await self.pull.recv()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            # NOTE: one guard per message: nothing a message holds may end this task
            try:
                on_message(data)
            except Exception as e:  # noqa: BLE001
                log.exception("could not handle a message from the engine (%d bytes): %r", len(data), e)

    async def send(self, msg) -> None:
        """Send ``msg`` (an ipc message) now. Raises zmq.ZMQError when the pipe is full, closed or unconnected."""
        await self.push.send(ipc.encode(msg), zmq.NOBLOCK)

    def send_nowait(self, msg) -> None:
        """Fire-and-forget send; a full or dead pipe drops the message (the engine's death is handled elsewhere)."""
        try:
            fut = self.push.send(ipc.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieve, never log

    async def send_garbage(self) -> None:
        """Fault ``ipc_garbage``: malformed messages the engine must survive (undecodable bytes; a message with
        unknown fields; an AddRequest whose fields are wrong)."""
        import msgpack

        for data in (b"\xc1 not msgpack", msgpack.packb(["AddRequest", {"nonsense": 1}]),
                     msgpack.packb(["NoSuchMessage", {}]),
                     ipc.encode(ipc.AddRequest(f"garbage-{os.urandom(4).hex()}", ["x", -1], {"temperature": "hot"})),
                     ipc.encode(ipc.AddRequest(f"garbage-{os.urandom(4).hex()}", [1, 2], "not a dict"))):
            try:
                await self.push.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:
                return

    def close(self) -> None:
        """Stop the reader and close both pipes (pending messages are dropped). Idempotent."""
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None
        self.push.close(linger=0)
        self.pull.close(linger=0)
