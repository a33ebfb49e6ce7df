"""The engine process: the Engine wrapped with IPC, heartbeats and a parent-death watch.

Started by the frontend's Supervisor with multiprocessing "spawn". Its loop: drain messages → step → send
outputs. A heartbeat thread (own socket) reports about every 0.5 s, busy or idle, the engine's stats and
``last_step_age`` (seconds the current loop iteration has been running while requests are running: a stuck step
makes it grow). Liveness of the frontend: Linux ``PR_SET_PDEATHSIG`` kills the engine the moment the frontend
dies, and a watch thread (any OS) exits the process within ~0.5 s, so no orphan keeps memory, GPU or sockets.
``faulthandler`` prints every thread's Python stack to stderr (the server log) on a fatal signal and on
``SIGUSR1`` (the supervisor's watchdog sends it before killing a stalled engine).

One guard per boundary, so that nothing a message or a statistic holds can end the process:

- the message loop (:func:`handle_message`): a message that does not decode, or whose fields are wrong, is
  logged and dropped; an AddRequest that cannot be applied is answered with an ``invalid_request`` error;
- the heartbeat thread (:func:`heartbeat_message`): a stats or progress read that fails, or a value msgpack cannot
  encode, still sends a heartbeat (with what could be read), so the watchdog never kills a healthy engine;
- the step: an unexpected error is reported (``Fatal`` with the step's requests, ``code`` ``device_error`` for a
  sticky CUDA error, ``step_failed`` otherwise) and the process exits so the supervisor answers and restarts.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from ferrylm.config import EngineConfig
from ferrylm.engine import ipc
from ferrylm.engine.host_malloc import keep_freed_blocks
from ferrylm.engine.outputs import EngineOutput
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.errors import FerryError
from ferrylm.faults import FaultInjector

HEARTBEAT_INTERVAL_S = 0.5
# Fault injection (tests): the ``engine_stall`` point of ferrylm/faults.py. With ``engine_stall:file=PATH`` (or the
# older env variable below naming PATH), when PATH exists the engine loop removes it and hangs before its next step
# (heartbeats continue), as a deadlocked kernel would. Off (one attribute test per step) otherwise.
FAULT_STALL_FILE_ENV = "FERRYLM_FAULT_STALL_FILE"


@dataclass
class EngineSpec:
    """Everything the engine process needs, as plain data (crosses ``spawn`` without pickling objects).

    ``in_addr``: zmq address the engine PULLs requests from; ``out_addr``: where it PUSHes outputs/heartbeats.
    ``parent_pid``: the frontend's pid (the engine exits when it goes away).
    ``tp_rendezvous``: under ``--tensor-parallel-size N > 1``, the rank group's file store (this process is rank 0;
    the followers are ``engine/parallel/follower.py``); None for one rank.
    """

    model_path: str
    engine_config: dict
    in_addr: str
    out_addr: str
    parent_pid: int
    log_level: str = "INFO"
    tp_rendezvous: str | None = None


STACK_DUMP_SIGNAL = signal.SIGUSR1


def _die_with_parent(parent_pid: int) -> None:
    """Linux: ask the kernel to SIGKILL us when the parent dies (works even if this process is stuck in C code
    holding the GIL). Best effort; the watch thread covers other systems.

    NOTE: the kernel means the parent *thread* that started us: the Supervisor spawns from its event-loop thread,
    which lives as long as the server."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except Exception:  # pragma: no cover - exotic libc
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _watch_parent(parent_pid: int, ipc_dir: str | None) -> None:
    while True:
        if os.getppid() != parent_pid:
            if ipc_dir:
                shutil.rmtree(ipc_dir, ignore_errors=True)  # the frontend cannot clean up after itself any more
            os._exit(0)
        time.sleep(0.5)


def _ipc_dir(addr: str) -> str | None:
    """The private directory of an ``ipc://<dir>/<name>`` address (None for other transports)."""
    return os.path.dirname(addr[len("ipc://"):]) if addr.startswith("ipc://") else None


_log = logging.getLogger("ferrylm.engine")


def heartbeat_message(state: dict) -> bytes:
    """One encoded heartbeat of the engine in ``state["engine"]`` (none yet: empty stats). Never raises: a part
    that cannot be read (``engine.stats()``, the progress report) or encoded is left out and the error is logged
    once per kind (``state["heartbeat_errors"]`` counts them and is sent along)."""
    engine = state.get("engine")
    now = time.monotonic()
    parts: dict = {"stats": {}, "progress": {}, "last_step_age": 0.0}
    if engine is not None:
        try:
            faults = engine.faults
            if faults.enabled and faults.fires("heartbeat_error"):
                raise RuntimeError("fault injection (heartbeat_error): the stats read failed")
            parts["stats"] = engine.stats()
        except Exception as e:  # noqa: BLE001 - the heartbeat must go out whatever the stats do
            _note_heartbeat_error(state, "stats", e)
        try:
            busy = engine.num_running > 0
            parts["progress"] = {**engine.progress.report(), "num_running": engine.num_running,
                                 "num_waiting": engine.num_waiting}
            # NOTE: measured from the start of the loop iteration, not from the engine's last step: after an idle
            # spell the last step is old although nothing is stuck.
            parts["last_step_age"] = now - state.get("iteration_start", now) if busy else 0.0
        except Exception as e:  # noqa: BLE001
            _note_heartbeat_error(state, "progress", e)
    errors = state.get("heartbeat_errors", 0)
    if errors:
        parts["stats"] = {**parts["stats"], "heartbeat_errors": errors} if isinstance(parts["stats"], dict) \
            else {"heartbeat_errors": errors}
    try:
        return ipc.encode(ipc.Heartbeat(**parts))
    except Exception as e:  # noqa: BLE001 - e.g. a stats value msgpack cannot encode
        _note_heartbeat_error(state, "encode", e)
        parts["stats"] = {"heartbeat_errors": state.get("heartbeat_errors", 0)}
        try:
            return ipc.encode(ipc.Heartbeat(**parts))
        except Exception:  # noqa: BLE001 - the progress report itself: send a bare beat
            return ipc.encode(ipc.Heartbeat(stats=parts["stats"]))


def _note_heartbeat_error(state: dict, what: str, e: BaseException) -> None:
    state["heartbeat_errors"] = state.get("heartbeat_errors", 0) + 1
    seen = state.setdefault("heartbeat_error_kinds", set())
    if what not in seen:  # once per kind: a failing read would otherwise log twice a second
        seen.add(what)
        _log.error("heartbeat: the %s failed (%r); heartbeats go on without it (logged once)", what, e,
                   exc_info=e)


def _heartbeat_loop(ctx, addr: str, state: dict, stop: threading.Event) -> None:
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    while not stop.wait(HEARTBEAT_INTERVAL_S):
        try:
            sock.send(heartbeat_message(state), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        except Exception as e:  # noqa: BLE001 - the last line of the guard: this thread must never die
            _note_heartbeat_error(state, "send", e)
    sock.close()


def handle_message(engine, data: bytes) -> tuple[bool, list]:
    """Apply one message from the frontend to ``engine``. Returns ``(shutdown, outputs)``: ``shutdown`` True for
    a Shutdown message; ``outputs``: error outputs to send now (an AddRequest that could not be applied).

    Never raises: a message that does not decode or has wrong fields is logged and dropped (nothing is known to
    answer); an AddRequest whose request id is readable but whose fields cannot be applied is answered with
    ``invalid_request``. The engine's state is unchanged by a message that failed."""
    try:
        msg = ipc.decode(data)
    except Exception as e:  # noqa: BLE001 - msgpack errors, unknown type, wrong fields: all the sender's
        _log.error("dropped an undecodable message from the frontend (%d bytes): %r", len(data), e)
        return False, []
    try:
        if isinstance(msg, ipc.AddRequest):
            params = SamplingParams.from_dict(msg.params)
            engine.add_request(msg.request_id, msg.prompt_token_ids, params, isolate=bool(msg.isolate))
        elif isinstance(msg, ipc.AbortRequest):
            for rid in msg.request_ids:
                engine.abort(rid)
        elif isinstance(msg, ipc.Shutdown):
            return True, []
        else:
            _log.error("dropped an unexpected %s message from the frontend", type(msg).__name__)
    except Exception as e:  # noqa: BLE001 - one bad message must not end the process
        rid = getattr(msg, "request_id", None)
        _log.error("[%s] could not apply a %s message: %r", rid, type(msg).__name__, e, exc_info=e)
        if isinstance(msg, ipc.AddRequest) and isinstance(rid, str):
            return False, [EngineOutput(rid, [], error_code="invalid_request",
                                        error_message=f"malformed request: {type(e).__name__}: {e}")]
    return False, []


def make_layer_poll(engine, sock, deferred: list[bytes]):
    """The abort poll run after each decoder layer of a step (``StepProgress.layer_callback``): reads what the
    frontend sent meanwhile without blocking; an AbortRequest is applied at once (``Engine.abort``: the pages come
    back at this layer boundary, not after the chunk), anything else waits in ``deferred`` for the main loop,
    in order. Never raises (one bad message must not fail the step)."""
    import zmq

    def poll() -> None:
        try:
            while True:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                try:
                    msg = ipc.decode(data)
                except Exception:  # noqa: BLE001 - the main loop logs and drops it
                    msg = None
                if isinstance(msg, ipc.AbortRequest) and not deferred:
                    handle_message(engine, data)
                else:
                    deferred.append(data)   # in order behind anything already waiting
        except Exception as e:  # noqa: BLE001 - the poll must never fail the step
            _log.error("abort poll failed: %r", e)

    return poll


def _join_group(config, rendezvous: str | None):
    """Rank 0's step broadcaster under ``--tensor-parallel-size N > 1`` (joins the group at ``rendezvous``), else
    None."""
    if config.tensor_parallel_size == 1:
        return None
    if not rendezvous:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size}: the engine was started without "
                         f"a rank group (the supervisor starts one process per rank)")
    from ferrylm.engine.engine import resolve_device
    from ferrylm.engine.parallel.group import init_group
    from ferrylm.engine.parallel.step_sync import StepBroadcaster
    from ferrylm.models.tensor_parallel import TPShard

    group = init_group(TPShard(0, config.tensor_parallel_size), resolve_device(config.device), rendezvous)
    return StepBroadcaster(group)


def _leave_group(tp, *, ok: bool) -> None:
    """Tell the followers the engine stops (``SHUTDOWN`` when ``ok``, else ``ABANDON``), unless a step may be
    inside its collectives (they are ended by rank 0's exit then). No-op for one rank; never raises."""
    if tp is None:
        return
    from ferrylm.engine.parallel.step_sync import ABANDON, SHUTDOWN

    tp.send_final(SHUTDOWN if ok else ABANDON)


def _fault_stall() -> None:
    logging.getLogger("ferrylm.engine").warning("fault injection (engine_stall): the engine loop hangs now")
    while True:
        time.sleep(3600)


#: the signals a terminal or a service manager sends the whole process group
TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def ignore_terminal_signals() -> None:
    """Ignore :data:`TERMINAL_SIGNALS`, then unblock them: a rank process starts with them blocked (the frontend
    spawns it under ``processes.terminal_signals_blocked``), so one that arrived during its imports was held
    pending and is dropped here instead of killing a half-started process."""
    for sig in TERMINAL_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)


def _prepare_process(spec: EngineSpec) -> None:
    """Process-wide setup: die with the parent, ignore the terminal's signals, name the process, stack dumps on
    fatal signals and ``SIGUSR1``, logging, malloc keeping a step's freed blocks."""
    _die_with_parent(spec.parent_pid)
    # NOTE: the frontend owns the engine's life (Shutdown message, SIGKILL, PDEATHSIG = SIGKILL). A terminal's
    # Ctrl-C, or a service manager's SIGTERM to the whole group, must not kill the engine under a draining frontend
    # (its in-flight requests would get "engine exited" instead of finishing).
    ignore_terminal_signals()
    threading.Thread(target=_watch_parent, args=(spec.parent_pid, _ipc_dir(spec.in_addr)), daemon=True,
                     name="parent-watch").start()
    try:
        import setproctitle

        setproctitle.setproctitle("ferrylm-engine")
    except Exception:  # pragma: no cover - cosmetic
        pass
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(faulthandler, "register"):  # not on Windows
        faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    keep_freed_blocks()


class _Channel:
    """The engine's sockets: ``pull`` (requests in), ``push`` (outputs out) and the heartbeat thread's own socket
    (which reads ``state``)."""

    def __init__(self, spec: EngineSpec) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(spec.in_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(spec.out_addr)
        self.state: dict = {}
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=_heartbeat_loop, args=(self.ctx, spec.out_addr, self.state,
                                                                         self._stop), daemon=True, name="heartbeat")
        self._heartbeat.start()

    def send(self, msg) -> None:
        """Encode and push one IPC message."""
        self.push.send(ipc.encode(msg))

    def close(self) -> None:
        # NOTE: ctx.term() blocks until every socket of the context is closed, the heartbeat thread's included.
        self._stop.set()
        self._heartbeat.join(timeout=2 * HEARTBEAT_INTERVAL_S)
        self.pull.close(linger=0)
        self.push.close()  # linger 1 s: the last message still goes out
        if not self._heartbeat.is_alive():
            self.ctx.term()


def _exit(chan: _Channel, tp, *, ok: bool) -> None:
    """Tell the rank group, close the sockets and leave the process at once (0 when ``ok``, else 1)."""
    _leave_group(tp, ok=ok)
    chan.close()
    if ok:
        # NOTE: skip the interpreter's teardown (seconds of freeing tensors, atexit hooks): the OS reclaims memory
        # at once and the frontend is waiting on our exit.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0 if ok else 1)


def _boot(spec: EngineSpec, chan: _Channel):
    """Build the engine (``engine/boot.py``), reporting each phase as ``Loading``; returns ``(engine, tp)``. A
    failure is sent as ``Fatal`` and the process exits 1."""
    tp = None   # rank 0's step broadcaster under tensor parallel (engine/parallel/step_sync.py)
    try:
        from ferrylm.engine.boot import build_engine

        config = EngineConfig(**spec.engine_config)
        FaultInjector.from_config(config.faults).boot_hook()   # point boot_delay (tests: a slow restart)
        tp = _join_group(config, spec.tp_rendezvous)
        engine = build_engine(spec.model_path, config, tp=tp, on_phase=lambda name: chan.send(ipc.Loading(name)))
    except Exception as e:
        # a known failure is its message; anything else needs the place it happened
        _log.error("engine failed to start: %s", e, exc_info=not isinstance(e, (FerryError, ValueError)))
        msg = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
        chan.send(ipc.Fatal(msg, code=str(getattr(e, "code", "") or "start_failed")))
        _exit(chan, tp, ok=False)
    return engine, tp


def ready_message(engine):
    """The ``Ready`` message: the engine's limits, backends and memory plan for the frontend."""
    lim = engine.limits
    plan = engine.memory_plan
    return ipc.Ready({"max_model_len": lim.max_model_len, "kv_pool_tokens": lim.pool_tokens,
                      "page_size": lim.page_size, "num_pages": lim.num_pages,
                      "max_running_requests": lim.max_running_requests,
                      "max_prefill_length": lim.max_prefill_length,
                      "device": str(engine.device), "pid": os.getpid(),
                      "moe_backend": engine.expert_backend, "attention_backend": engine.runner.attention,
                      "dtype": str(engine.pool.dtype).removeprefix("torch."),
                      "engine_config": engine.config.to_dict(),
                      "model_bytes": engine.model_bytes,
                      "memory_plan": plan.to_dict() if plan is not None else None})


def _drain_messages(engine, chan: _Channel, tp, deferred: list[bytes]) -> None:
    """Apply every message waiting (those the layer poll deferred first); a Shutdown ends the process."""
    import zmq

    while True:
        if deferred:
            data = deferred.pop(0)
        else:
            try:
                data = chan.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
        shutdown, rejected = handle_message(engine, data)
        if rejected:
            chan.send(ipc.Outputs(rejected))
        if shutdown:
            _log.info("engine shutting down (%d requests still running)", engine.num_running)
            _exit(chan, tp, ok=True)


def step_failure(engine, e: BaseException):
    """The ``Fatal`` message for an unexpected error inside a step (``device_error`` for a sticky CUDA error, else
    ``step_failed``), naming the step's requests; the error is logged with its traceback."""
    from ferrylm.memory.guard import is_device_error

    ids = list(engine.progress.step_request_ids)
    if is_device_error(e):
        _log.error("sticky device error in a step of %d requests %s; the engine exits to be restarted:"
                   "\n%s", len(ids), ids, traceback.format_exc())
        return ipc.Fatal(f"device error: {str(e).splitlines()[0]}", code="device_error", request_ids=ids)
    _log.error("engine step of %d requests %s failed:\n%s", len(ids), ids, traceback.format_exc())
    return ipc.Fatal(f"engine step failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                     f"see the engine log", code="step_failed", request_ids=ids)


def _serve(engine, chan: _Channel, tp) -> None:
    """The loop: drain messages (waiting up to a heartbeat interval when idle) -> step -> send outputs."""
    import zmq

    poller = zmq.Poller()
    poller.register(chan.pull, zmq.POLLIN)
    faults = engine.faults
    deferred: list[bytes] = []   # messages the layer poll read during a step, for this loop
    engine.progress.layer_callback = make_layer_poll(engine, chan.pull, deferred)
    while True:
        chan.state["iteration_start"] = time.monotonic()
        timeout = 0 if engine.has_work() or deferred else int(HEARTBEAT_INTERVAL_S * 1000)
        if deferred or poller.poll(timeout):
            _drain_messages(engine, chan, tp, deferred)
        if not engine.has_work():
            continue
        if faults.enabled and faults.should_stall():
            _fault_stall()
        try:
            outs = engine.step()
        except Exception as e:
            # An unexpected error inside a step must not leave clients waiting: report and exit so the supervisor
            # answers every in-flight request and restarts the engine. A sticky device error (illegal address,
            # device-side assert) poisons the CUDA context: nothing more can run here.
            chan.send(step_failure(engine, e))
            _exit(chan, tp, ok=False)
        if outs:
            chan.send(ipc.Outputs(outs))


def engine_main(spec_dict: dict) -> None:
    """Entry point of the engine process (``spawn`` target). Exits 0 on Shutdown, 1 on a fatal error after
    reporting it; on the parent's death it is SIGKILLed (Linux) or exits 0 (watch thread)."""
    spec = EngineSpec(**spec_dict)
    _prepare_process(spec)
    chan = _Channel(spec)
    engine, tp = _boot(spec, chan)
    chan.state["engine"] = engine
    chan.send(ready_message(engine))
    _serve(engine, chan, tp)
