"""The engine process: the Engine wrapped with IPC, heartbeats and a parent-death watch.

Started by the frontend's Supervisor with multiprocessing "spawn". Its loop: drain messages → step → send
outputs. A heartbeat thread (own socket) reports about every 0.5 s whether the loop is busy or idle; a watch
thread exits the process within ~0.5 s when the parent (frontend) dies, so no orphan keeps memory or sockets.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass

HEARTBEAT_INTERVAL_S = 0.5


@dataclass
class EngineSpec:
    """Everything the engine process needs, as plain data (crosses ``spawn`` without pickling objects).

    ``in_addr``: zmq address the engine PULLs requests from; ``out_addr``: where it PUSHes outputs/heartbeats.
    ``parent_pid``: the frontend's pid (the engine exits when it goes away).
    """

    model_path: str
    engine_config: dict
    in_addr: str
    out_addr: str
    parent_pid: int
    log_level: str = "INFO"


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(0.5)


def _heartbeat_loop(ctx, addr: str, state: dict, stop: threading.Event) -> None:
    import zmq

    from ferrylm.engine import ipc

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    while not stop.wait(HEARTBEAT_INTERVAL_S):
        engine = state.get("engine")
        stats = engine.stats() if engine is not None else {}
        age = time.monotonic() - engine.last_step_time if engine is not None and engine.num_running else 0.0
        try:
            sock.send(ipc.encode(ipc.Heartbeat(stats=stats, last_step_age=age)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    sock.close()


def engine_main(spec_dict: dict) -> None:
    """Entry point of the engine process (``spawn`` target). Exits 0 on Shutdown or parent death, 1 on a fatal
    error after reporting it."""
    spec = EngineSpec(**spec_dict)
    try:
        import setproctitle

        setproctitle.setproctitle("ferrylm-engine")
    except Exception:  # pragma: no cover - cosmetic
        pass
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True, name="parent-watch").start()

    import zmq

    from ferrylm.config import EngineConfig
    from ferrylm.engine import ipc
    from ferrylm.engine.sampling_params import SamplingParams

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(spec.in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(spec.out_addr)
    state: dict = {}
    stop = threading.Event()
    threading.Thread(target=_heartbeat_loop, args=(ctx, spec.out_addr, state, stop), daemon=True,
                     name="heartbeat").start()
    log = logging.getLogger("ferrylm.engine")
    try:
        from ferrylm.engine.factory import build_engine

        engine = build_engine(spec.model_path, EngineConfig(**spec.engine_config))
    except Exception as e:
        log.error("engine failed to start: %s", e)
        push.send(ipc.encode(ipc.Fatal(f"{type(e).__name__}: {e}")))
        stop.set()
        push.close()
        ctx.term()
        os._exit(1)
    state["engine"] = engine
    lim = engine.limits
    push.send(ipc.encode(ipc.Ready({"max_model_len": lim.max_model_len, "kv_pool_tokens": lim.pool_tokens,
                                    "page_size": lim.page_size, "num_pages": lim.num_pages,
                                    "max_running_requests": lim.max_running_requests,
                                    "max_prefill_length": lim.max_prefill_length,
                                    "device": str(engine.device), "pid": os.getpid()})))
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while True:
        timeout = 0 if engine.has_work() else int(HEARTBEAT_INTERVAL_S * 1000)
        if poller.poll(timeout):
            while True:
                try:
                    msg = ipc.decode(pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, ipc.AddRequest):
                    engine.add_request(msg.request_id, msg.prompt_token_ids, SamplingParams.from_dict(msg.params))
                elif isinstance(msg, ipc.AbortRequest):
                    for rid in msg.request_ids:
                        engine.abort(rid)
                elif isinstance(msg, ipc.Shutdown):
                    log.info("engine shutting down")
                    stop.set()
                    push.close()
                    ctx.term()
                    return
        if engine.has_work():
            try:
                outs = engine.step()
            except Exception:
                # An unexpected error inside a step must not leave clients waiting: report and exit so the
                # supervisor answers every in-flight request and restarts the engine.
                log.error("engine step failed:\n%s", traceback.format_exc())
                push.send(ipc.encode(ipc.Fatal("engine step failed; see the engine log")))
                os._exit(1)
            if outs:
                push.send(ipc.encode(ipc.Outputs(outs)))
