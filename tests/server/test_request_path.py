"""The source files a chat request crosses from HTTP to the first kernel, counted so that the figure cannot grow
unnoticed (docs/ARCHITECTURE.md, "A request, from HTTP to the first kernel").

Counted: every file under ``src/ferrylm`` with a Python function that runs for one ``POST /v1/chat/completions``
(any thread of the process: templates and tokenization run in a worker thread), each file once. The path has two
halves, each traced where it runs:

- frontend: from the first ferrylm frame of the ASGI app to the ``AddRequest`` leaving on the zmq pipe (the return
  of ``EngineChannel.send``), over a real Supervisor whose engine side is the test
  (``tests/supervision/harness.py``);
- engine: from that message's bytes arriving (``worker.handle_message``, as the engine loop calls it) through
  ``Engine.step()`` to the first call of the model's ``forward``, the first kernel. The forward's own file counts
  only if something in it ran before.

The engine is built in this process (``build_engine``, CPU, a tiny Qwen3-MoE checkpoint), so no process or thread
set-up changes what is traced. A warm-up request runs first: lazy imports and first-use set-ups are not counted.
Run this file as a script to print the list.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType

from tests.models.hf_checkpoints import build_checkpoint
from tests.server.conftest import build_tiny_tokenizer, make_client
from tests.supervision.harness import ready_supervisor, shutdown

import ferrylm
from ferrylm.config import EngineConfig
from ferrylm.engine import ipc, worker
from ferrylm.engine.boot import build_engine
from ferrylm.server.api.app import create_app
from ferrylm.server.process.channel import EngineChannel
from ferrylm.server.text.tokenizer import TextCodec

SRC = str(Path(ferrylm.__file__).parent) + "/"
#: the files counted on main; lower it when the path gets shorter
MAX_FILES = 40


@dataclass
class _Trace:
    """A profile hook recording the ferrylm files of the functions called until ``stop`` is entered (``on_call``)
    or returns (else)."""

    stop: CodeType
    on_call: bool
    files: list[str] = field(default_factory=list)
    on: bool = True
    reached: bool = False

    def __call__(self, frame, event: str, arg) -> None:
        if not self.on or event not in ("call", "return"):
            return
        code = frame.f_code
        if code is self.stop and (event == "call") == self.on_call:
            self.on, self.reached = False, True
            return
        name = code.co_filename
        if event == "call" and name.startswith(SRC) and name[len(SRC):] not in self.files:
            self.files.append(name[len(SRC):])


class _Hook:
    """The trace of this thread and of every thread started while it is set (the app's worker threads)."""

    def __init__(self) -> None:
        self.trace: _Trace | None = None
        threading.setprofile(self._thread)

    def _thread(self, frame, event: str, arg) -> None:
        if self.trace is not None:
            self.trace(frame, event, arg)

    def start(self, trace: _Trace) -> None:
        self.trace = trace
        sys.setprofile(self._thread)

    def stop(self) -> None:
        sys.setprofile(None)
        self.trace = None

    def close(self) -> None:
        self.stop()
        threading.setprofile(None)


@dataclass
class RequestPath:
    frontend: list[str]
    engine: list[str]

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(self.frontend + self.engine))


async def _trace(tmp: Path, hook: _Hook) -> RequestPath:
    codec = TextCodec.from_pretrained(build_tiny_tokenizer(tmp / "tokenizer"))
    ckpt = build_checkpoint("qwen3_moe", tmp / "model", vocab_size=512)
    engine = build_engine(str(ckpt.path), EngineConfig(device="cpu", dtype="float32", page_size=16, num_pages=32))
    sup, fake = await ready_supervisor(tmp / "sup")
    forward = type(engine.model).forward.__code__
    path = RequestPath([], [])
    try:
        async with make_client(create_app(sup, codec, "tiny")) as client:
            for traced in (False, True):
                front, back = _Trace(EngineChannel.send.__code__, on_call=False), _Trace(forward, on_call=True)
                body = {"model": "tiny", "max_tokens": 2,
                        "messages": [{"role": "user", "content": f"Hello world {traced}"}]}
                if traced:
                    hook.start(front)
                reply = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                msg = await fake.recv()
                while not isinstance(msg, ipc.AddRequest):
                    msg = await fake.recv()
                hook.stop()
                if traced:
                    hook.start(back)
                worker.handle_message(engine, ipc.encode(msg))
                outs = []
                while not any(o.finish_reason for o in outs):
                    outs += engine.step()
                    hook.stop()
                await fake.send(ipc.Outputs(outs))
                assert (await asyncio.wait_for(reply, 30)).status_code == 200
                if traced:
                    assert front.reached and back.reached, "a trace missed its end point"
                    path = RequestPath(front.files, back.files)
    finally:
        await shutdown(sup, fake)
    return path


def trace_request_path(tmp: Path) -> RequestPath:
    """The files one chat request crosses (module docstring), frontend then engine, each in first-call order."""
    hook = _Hook()
    try:
        return asyncio.run(_trace(tmp, hook))
    finally:
        hook.close()


def test_a_chat_request_crosses_at_most_max_files(tmp_path) -> None:
    path = trace_request_path(tmp_path)
    assert "server/api/app.py" in path.frontend and "engine/model_runner.py" in path.engine, path
    assert len(path.files) <= MAX_FILES, "\n".join([f"{len(path.files)} files:", *path.files])


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = trace_request_path(Path(d))
    print(f"frontend {len(p.frontend)}:", *p.frontend, f"engine {len(p.engine)}:", *p.engine,
          f"together {len(p.files)}", sep="\n  ")
