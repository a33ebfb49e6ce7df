"""``ferry serve``: check the port, resolve the model, start the supervisor and uvicorn, exit with a status
a service manager understands (0 after a clean shutdown, 1 when the engine is dead for good, 2 for bad flags or
a port in use, 128+N after a second signal N).

Shutdown (our own signal handlers; uvicorn's are switched off because they re-raise the signal after a graceful
exit, which turns exit 0 into "killed by SIGTERM"):

1. first SIGTERM/SIGINT: new requests get 503 ``engine_unavailable`` and /health 503 ``draining``; running
   requests continue for up to ``--shutdown-timeout`` seconds; those still running then get an error (stream: an
   error event, then ``[DONE]``); uvicorn closes the listener and connections; the engine is stopped; exit 0.
2. a second signal: every request still running is answered with 503 ``engine_unavailable`` (a stream: its
   error event and its end, ``[DONE]`` where the route has one), SIGKILL the engine, remove the IPC dir, and exit
   128+N once those answers went out (at most ``FINAL_ANSWERS_S``); a third signal exits at once. A signal
   within ``SIGNAL_REPEAT_WINDOW_S`` of the first is the same one relayed (``make``, ``timeout`` and service
   managers signal the whole process group, then the parent passes it on): it is ignored.

Before the event loop runs (resolving and converting the model, loading the tokenizer, importing uvicorn), the
signals are :class:`BootSignals`' (installed by ``cli.main`` before anything slow): the first SIGTERM/SIGINT
unwinds the start-up (:class:`BootInterrupted`), nothing has been spawned yet, and the server exits 0; a second one
exits 128+N at once. The event loop takes the signals over before it spawns the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import logging
import math
import os
import signal
import socket
import sys
import time
from typing import Any

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.errors import EngineUnavailable, ModelLoadError, UnsupportedArchitecture

from ferrylm.server.process.boot_responder import BootResponder
from ferrylm.server.process.boot_signals import SIGNAL_REPEAT_WINDOW_S, BootInterrupted, BootSignals, is_relay

log = logging.getLogger("ferrylm.serve")


ENGINE_STOP_S = 5.0  # at exit, seconds the engine process gets to obey the stop message before it is killed
ENGINE_STOP_AFTER_TIMEOUT_S = 1.0  # the same when --shutdown-timeout ran out with requests still running
FINAL_ANSWERS_S = 2.0  # after a second signal, the most the open requests' error answers may take to go out
FLUSH_S = 0.05         # then, the time the event loop gets to write them to the sockets


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, before the model loads. Raises OSError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock  # NOTE: not inheritable: the engine (spawned, fds closed) must never hold the port


def serve(args: argparse.Namespace, engine_config: EngineConfig, boot: BootSignals | None = None) -> int:
    """Run the server until SIGINT/SIGTERM or engine death. Returns the process exit code.

    ``boot``: the signal handling installed before this call (``cli.main``); installed here when None."""
    boot = boot or BootSignals().install()
    try:
        return _serve(args, engine_config, boot)
    except BootInterrupted as e:
        log.info("received %s while starting: exiting", signal.Signals(e.sig).name)
        return 0


def visible_gpus() -> int:
    """GPUs a CUDA process started now would see, without importing torch: the ids of ``CUDA_VISIBLE_DEVICES`` up
    to the first invalid one (CUDA's rule), else the ``/dev/nvidia<N>`` device nodes."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        import glob

        return len(glob.glob("/dev/nvidia[0-9]*"))
    n = 0
    for part in env.split(","):
        part = part.strip()
        if not part or part.startswith("-"):
            break
        n += 1
    return n


def check_tp_devices(engine_config: EngineConfig, gpus: int | None = None) -> str | None:
    """The error line when ``--tensor-parallel-size`` asks for more GPUs than are visible (rank r runs on
    ``cuda:r``; ``--device auto`` means CUDA when there is a GPU), else None."""
    n = engine_config.tensor_parallel_size
    if n == 1 or engine_config.device == "cpu":
        return None
    gpus = visible_gpus() if gpus is None else gpus
    if engine_config.device == "auto" and gpus == 0:
        return None   # auto runs on the CPU: the ranks are CPU processes (gloo)
    if n > gpus:
        return (f"--tensor-parallel-size {n} needs {n} GPUs (rank r on cuda:r); {gpus} visible "
                f"(CUDA_VISIBLE_DEVICES / --device cpu)")
    return None


def listen_error(host: str, port: int, e: OSError) -> str:
    """The line for a failed bind: a port in use or not ours to take names ``--port``, anything else (an address
    not on this machine) ``--host``."""
    flag = "--port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
    return f"cannot listen on {host}:{port}: {e.strerror or e} (choose another {flag})"


def check_device(device: str, gpus: int | None = None) -> str | None:
    """The error line when ``--device`` names a CUDA device this host does not show (no GPU visible, or an index
    past the visible ones), else None. Without importing torch: :func:`visible_gpus`."""
    if not device.startswith("cuda"):
        return None
    gpus = visible_gpus() if gpus is None else gpus
    index = int(device.partition(":")[2] or 0)
    if index < gpus:
        return None
    seen = "no GPU is visible here" if gpus == 0 else f"{gpus} GPU(s) are visible (cuda:0..cuda:{gpus - 1})"
    return f"--device {device}: {seen} (CUDA_VISIBLE_DEVICES, /dev/nvidia*); use --device cpu or auto"


def check_serve_args(args: argparse.Namespace, engine_config: EngineConfig) -> str | None:
    """The first error line among ``ferry serve``'s own flags (each names its flag), else None. Run by the CLI
    before anything loads; ``engine_config`` is already validated."""
    for flag, value, ok, rule in (
            ("--watchdog-timeout", args.watchdog_timeout, args.watchdog_timeout >= 0, ">= 0 seconds (0: off)"),
            ("--shutdown-timeout", args.shutdown_timeout, args.shutdown_timeout >= 0, ">= 0 seconds"),
            ("--max-request-bytes", args.max_request_bytes, args.max_request_bytes >= 1, ">= 1"),
            ("--sse-ping-interval", args.sse_ping_interval, args.sse_ping_interval >= 0, ">= 0 seconds (0: never)"),
            ("--responses-store-size", args.responses_store_size, args.responses_store_size >= 0, ">= 0"),
            ("--max-engine-restarts", args.max_engine_restarts, args.max_engine_restarts >= 0, ">= 0"),
            ("--request-timeout", args.request_timeout,
             args.request_timeout >= 0 and math.isfinite(args.request_timeout), ">= 0 seconds (0: no deadline)")):
        if not ok:
            return f"{flag} must be {rule}, got {value}"
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        return "--served-model-name must not be empty (leave it out to use the model's name)"
    cors = {"--allowed-methods": args.allowed_methods, "--allowed-headers": args.allowed_headers,
            "--allow-credentials": args.allow_credentials or None}
    if not args.allowed_origins and any(v is not None for v in cors.values()):
        given = ", ".join(k for k, v in cors.items() if v is not None)
        return f"{given} needs --allowed-origins (CORS is off without it)"
    try:
        socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"--host {args.host!r} does not resolve: {e}"
    return check_device(engine_config.device) or check_tp_devices(engine_config)


def say(line: str) -> None:
    """One line of ``ferry serve``'s own progress (loading, its phases, ready) on stderr, beside the log."""
    print(line, file=sys.stderr, flush=True)


def _serve(args: argparse.Namespace, engine_config: EngineConfig, boot: BootSignals) -> int:
    """``ferry serve`` after the CLI checked its flags: bind the port, load the model's facts and tokenizer, then
    serve (:func:`_run`). Returns the exit code (2, with one line on stderr, for a port, a model or a flag that
    does not work)."""
    def fail(msg: str) -> int:
        sock.close()
        print(f"ferry serve: {msg}", file=sys.stderr)
        return 2

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"ferry serve: {listen_error(args.host, args.port, e)}", file=sys.stderr)
        return 2
    say(f"loading {args.model} ...")
    try:
        model = load_model(args, engine_config)
    except _FlagError as e:
        return fail(str(e))
    except ModelLoadError as e:
        return fail(e.message)
    try:
        faults = frontend_faults(engine_config)
    except ValueError as e:
        return fail(str(e))
    try:
        return _run(args, engine_config, boot, sock, model, faults)
    finally:
        sock.close()


class _FlagError(ValueError):
    """A flag that does not fit the model (``--max-model-len`` past its context, ``--tensor-parallel-size``)."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """What the frontend knows of the served model before the engine starts: what ``--model`` named
    (``resolved``: a ``ResolvedModel``) and its config."""

    resolved: Any
    config: ModelConfig


def load_model(args: argparse.Namespace, engine_config: EngineConfig) -> LoadedModel:
    """Resolve ``--model``, read its config, check the engine flags against it, verify its files (the tokenizer
    loads later, while the engine boots: :func:`load_frontend_codec`). Raises ModelLoadError
    (UnsupportedArchitecture for an architecture no model family serves), _FlagError for a flag the model does not
    allow."""
    from ferrylm.checkpoints.gguf_config import check_tensor_parallel
    from ferrylm.checkpoints.resolve import resolve_model
    from ferrylm.checkpoints.verify import verify_checkpoint
    from ferrylm.models.registry import supported_architectures

    resolved = resolve_model(args.model)
    check_tensor_parallel(resolved.path, engine_config.tensor_parallel_size)
    mcfg = ModelConfig.from_folder(resolved.path)
    if mcfg.architecture not in supported_architectures():
        raise UnsupportedArchitecture(f"{resolved.path}: architecture {mcfg.architecture!r} is not supported; "
                                      f"supported: {', '.join(supported_architectures())}")
    try:
        engine_config.check_model(mcfg)   # --max-model-len against the context, --tensor-parallel-size
    except ValueError as e:
        raise _FlagError(str(e)) from None
    if resolved.source != "synthetic":
        verify_checkpoint(resolved.path)   # a truncated file: one line naming it, exit 2 (not an engine crash)
    return LoadedModel(resolved, mcfg)


def load_frontend_codec(args: argparse.Namespace, model: LoadedModel, faults: Any) -> Any:
    """The served model's codec (harmony's for gpt-oss) with ``--chat-template`` and the frontend's fault points.
    Raises ModelLoadError: no loadable tokenizer, or the template cannot be read."""
    from ferrylm.faults import FRONTEND_POINTS
    from ferrylm.server.text.harmony import load_codec
    from ferrylm.server.text.tokenizer import load_chat_template

    codec = load_codec(model.resolved.path)
    if getattr(args, "chat_template", None):
        codec.set_chat_template(load_chat_template(args.chat_template))
    if any(p in FRONTEND_POINTS for p in faults.rules):
        codec.faults = faults   # the engine builds its own injector from the same spec
    return codec


def frontend_faults(engine_config: EngineConfig) -> Any:
    """The frontend's fault injector from ``--faults``. Raises ValueError for a spec that does not parse."""
    from ferrylm.faults import FRONTEND_POINTS, FaultInjector

    faults = FaultInjector.from_config(engine_config.faults)
    if any(p in FRONTEND_POINTS for p in faults.rules):
        log.warning("fault injection is ON in the frontend: %s", faults)
    return faults


def _uvicorn_server(app: Any, log_level: str) -> Any:
    """A uvicorn server for ``app`` without uvicorn's signal handling (ours drains first, then sets
    ``should_exit``)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn >= 0.29
            yield

        def install_signal_handlers(self) -> None:  # older uvicorn
            pass

    # uvicorn's own graceful wait only covers the HTTP tail after our drain (the last bytes of answered streams)
    return Server(uvicorn.Config(app, log_level=log_level.lower(), access_log=False, timeout_graceful_shutdown=5))


def _make_app(args: argparse.Namespace, sup: Any, model: LoadedModel, codec: Any, names: list[str]) -> Any:
    """The FastAPI app over ``sup`` with ``ferry serve``'s HTTP flags."""
    from ferrylm.server.api.app import CorsPolicy, create_app

    api_key = args.api_key or os.environ.get("FERRYLM_API_KEY") or None
    cors = CorsPolicy(args.allowed_origins, args.allowed_methods or ["*"], args.allowed_headers or ["*"],
                      args.allow_credentials) if args.allowed_origins else None
    return create_app(sup, codec, names, api_key=api_key,
                      max_request_bytes=int(getattr(args, "max_request_bytes", 8 << 20)), cors=cors,
                      request_timeout=getattr(args, "request_timeout", None) or None,
                      sse_ping_interval=float(args.sse_ping_interval),
                      responses_store_size=int(getattr(args, "responses_store_size", 1024)),
                      tool_call_parser=getattr(args, "tool_call_parser", None) or "auto",
                      architecture=model.config.architecture, model_type=(model.config.raw or {}).get("model_type"),
                      webui=args.webui)


def _run(args: argparse.Namespace, engine_config: EngineConfig, boot: BootSignals, sock: socket.socket,
         model: LoadedModel, faults: Any) -> int:
    """Start the supervisor and uvicorn on ``sock`` and serve until the shutdown (module docstring). Returns the
    exit code: 0, or the supervisor's when the engine is dead for good."""
    from ferrylm.server.process.engine_client import ModelInfo
    from ferrylm.server.process.supervisor import Supervisor

    names = args.served_model_name or [model.resolved.name]   # each accepted in `model`; responses report the first
    name = names[0]
    max_len = engine_config.max_model_len or model.config.max_position_embeddings
    info = ModelInfo(name=name, path=str(model.resolved.path), max_model_len=max_len,
                     eos_token_ids=tuple(model.config.eos_token_ids))
    exit_code = 0

    def on_fatal() -> None:
        nonlocal exit_code
        exit_code = sup.fatal_exit_code   # 1; 2 when the engine's first start failed on the model itself
        if stop.server is not None:
            stop.server.should_exit = True

    def on_ready(engine_info: dict) -> None:
        say(f"ready: http://{args.host}:{args.port} ({name}, {int(engine_info['max_model_len'])}-token context)")

    sup = Supervisor(str(model.resolved.path), engine_config.to_dict(), info, max_restarts=args.max_engine_restarts,
                     on_fatal=on_fatal, log_level=args.log_level,
                     watchdog_timeout=float(getattr(args, "watchdog_timeout", 120.0)),
                     faults=faults, on_phase=lambda phase: say(f"  {phase} ..."), on_ready=on_ready)
    stop = _Shutdown(sup, float(getattr(args, "shutdown_timeout", 30.0)))

    def start_http() -> tuple[Any, Any]:
        """The tokenizer, the app and its uvicorn server: built in a thread while the engine loads. Raises
        ModelLoadError: no loadable tokenizer."""
        app = _make_app(args, sup, model, load_frontend_codec(args, model, faults), names)
        return app, _uvicorn_server(app, args.log_level)

    code = asyncio.run(_main(boot, sup, stop, sock, start_http,
                             f"serving {name} ({model.resolved.path}) on http://{args.host}:{args.port}"))
    return code or exit_code


async def _main(boot: BootSignals, sup: Any, stop: "_Shutdown", sock: socket.socket, start_http, serving: str) -> int:
    """The event loop's part: take the signals over from ``boot``, start the engine, build the tokenizer and the
    app meanwhile (``start_http``, in a thread; the port answers 503 meanwhile: ``boot_responder.py``), serve on
    ``sock`` until the shutdown, stop the engine; hand the signals back (record-only) once it served. Returns 2 when
    the tokenizer failed to load, else 0."""
    loop = asyncio.get_running_loop()
    boot.armed = False            # from here a signal is recorded, then replayed through on_signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.on_signal, sig)
    for sig in boot.received:     # arrived between disarming and the loop's handlers
        stop.on_signal(sig)
    if stop.signals_seen:         # shutting down before the engine was ever spawned
        await sup.close()
        return 0
    responder = BootResponder(sock, sup.health)
    try:
        await responder.start()   # 503 at once on the port until uvicorn takes it
        await sup.start()   # the engine loads while this process builds the tokenizer and the app
        try:
            app, server = await asyncio.to_thread(start_http)
        except ModelLoadError as e:
            print(f"ferry serve: {e.message}", file=sys.stderr)
            await sup.close()
            return 2
        finally:
            await responder.stop()
        if stop.signals_seen or sup.state == "dead":   # a signal, or the engine failed for good, meanwhile
            await sup.close()
            return 0
        stop.attach(app, server)
        log.debug("%s", serving)
        try:
            await stop.server.serve(sockets=[sock])
        finally:
            await sup.close(stop.engine_stop_s)
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)   # resets to SIG_DFL: record-only until the process exits
        boot.received.clear()
        boot.install(armed=False)


class _Shutdown:
    """The signals of a running server (module docstring, "Shutdown"): the first drains, the second answers what
    is left and exits 128+N, a third exits at once; a relayed repeat of the first is ignored.

    Attributes:
        signals_seen: (signal, monotonic time) of each signal taken.
        engine_stop_s: what the engine gets to obey the stop message at the end (shorter when the drain ran out).
    """

    def __init__(self, sup: Any, shutdown_timeout: float):
        self.sup = sup
        self.shutdown_timeout = shutdown_timeout
        self.app: Any = None
        self.server: Any = None
        self.signals_seen: list[tuple[int, float]] = []
        self.engine_stop_s = ENGINE_STOP_S
        self._tasks: list[asyncio.Task] = []   # keep references

    def attach(self, app: Any, server: Any) -> None:
        """The app (its open requests) and the uvicorn server this shutdown stops."""
        self.app, self.server = app, server

    def on_signal(self, sig: int) -> None:
        name_ = signal.Signals(sig).name
        if self.signals_seen and is_relay(self.signals_seen[0][1]):
            log.info("%s again within %g s of the first: taken as the same signal (a parent relaying its process "
                     "group's signal)", name_, SIGNAL_REPEAT_WINDOW_S)
            return
        self.signals_seen.append((sig, time.monotonic()))
        if len(self.signals_seen) > 2 or (len(self.signals_seen) > 1 and self.server is None):
            self.exit_at_once(sig)
        if self.server is None:   # the tokenizer is loading: _main stops the engine once it is built
            log.info("received %s while starting: exiting", name_)
            self.sup.begin_drain()   # an engine that dies meanwhile is not restarted
            return
        if len(self.signals_seen) > 1:
            log.warning("second signal (%s): answering the %d open requests with an error, then exiting", name_,
                        self.app.state.open_requests.count)
            self._tasks.append(asyncio.get_running_loop().create_task(self.exit_answered(sig)))
            return
        log.info("received %s: graceful shutdown (send it again to cut the running requests and exit)", name_)
        self.sup.begin_drain()
        self._tasks.append(asyncio.get_running_loop().create_task(self.drain_and_stop()))

    async def drain_and_stop(self) -> None:
        """The first signal: wait for the running requests (``--shutdown-timeout``), answer what is left with an
        error, then stop uvicorn."""
        t0, sup, timeout = time.monotonic(), self.sup, self.shutdown_timeout
        log.info("shutting down: refusing new requests; waiting up to %g s for %d running requests", timeout,
                 sup.num_in_flight)
        left = await sup.drain(timeout)
        if left:
            log.warning("shutting down: %d requests still running after --shutdown-timeout %g s; answering them "
                        "with an error", left, timeout)
            sup.fail_in_flight(EngineUnavailable(
                f"the server is shutting down; the request did not finish within --shutdown-timeout {timeout:g} s"))
            # the engine is mid-step on what was just answered: it reads the stop message only after that step,
            # which can take seconds (a long prefill chunk); nothing is left to wait for, so it gets a short grace
            self.engine_stop_s = ENGINE_STOP_AFTER_TIMEOUT_S
            await sup.drain(2.0)  # the error events go out
        if len(self.signals_seen) > 1:   # a second signal cut what was running (exit_answered); it exits
            return
        log.info("shutting down: %s in %.2f s; stopping",
                 f"{left} requests cut" if left else "drained", time.monotonic() - t0)
        self.server.should_exit = True

    def exit_at_once(self, sig: int) -> None:
        self.sup.kill_now()
        logging.shutdown()
        os._exit(128 + sig)

    async def exit_answered(self, sig: int) -> None:
        """The second signal: every request in flight is answered with an error (a stream's error event and
        end), the engine is killed, and the process exits 128+N once the answers went out (at most
        ``FINAL_ANSWERS_S``)."""
        self.sup.fail_in_flight(EngineUnavailable("the server is exiting now (a second signal); the request was cut"))
        self.sup.kill_now()
        open_requests = self.app.state.open_requests
        if not await open_requests.wait_idle(FINAL_ANSWERS_S):
            log.warning("%d requests still open after %g s; exiting", open_requests.count, FINAL_ANSWERS_S)
        await asyncio.sleep(FLUSH_S)   # the sockets take the last bytes
        self.exit_at_once(sig)
