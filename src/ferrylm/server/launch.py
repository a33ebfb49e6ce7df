"""``ferry serve``: check the port, resolve the model, start the supervisor and uvicorn, exit with a status
a service manager understands (0 after a clean shutdown, 1 when the engine is dead for good, 2 for bad flags)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.errors import ModelLoadError

log = logging.getLogger("ferrylm.serve")


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
    sock.set_inheritable(True)
    return sock


def serve(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """Run the server until SIGINT/SIGTERM or engine death. Returns the process exit code."""
    def fail(msg: str) -> int:
        print(f"ferry serve: {msg}", file=sys.stderr)
        return 2

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        return fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e} (choose another --port)")

    from ferrylm.errors import UnsupportedArchitecture
    from ferrylm.models.registry import supported_architectures
    from ferrylm.models.resolve import resolve_model
    from ferrylm.server.tokenizer import TextCodec

    try:
        resolved = resolve_model(args.model)
        mcfg = ModelConfig.from_folder(resolved.path)
        if mcfg.architecture not in supported_architectures():
            raise UnsupportedArchitecture(f"{resolved.path}: architecture {mcfg.architecture!r} is not supported; "
                                          f"supported: {', '.join(supported_architectures())}")
        codec = TextCodec.from_pretrained(resolved.path)
    except ModelLoadError as e:
        sock.close()
        return fail(e.message)

    import uvicorn

    from ferrylm.server.app import create_app
    from ferrylm.server.engine_client import ModelInfo
    from ferrylm.server.supervisor import Supervisor

    name = args.served_model_name or resolved.name
    max_len = engine_config.max_model_len or mcfg.max_position_embeddings
    info = ModelInfo(name=name, path=str(resolved.path), max_model_len=max_len,
                     eos_token_ids=tuple(mcfg.eos_token_ids))
    exit_code = 0
    server_box: dict = {}

    def on_fatal() -> None:
        nonlocal exit_code
        exit_code = 1
        srv = server_box.get("server")
        if srv is not None:
            srv.should_exit = True

    sup = Supervisor(str(resolved.path), engine_config.to_dict(), info, max_restarts=args.max_engine_restarts,
                     on_fatal=on_fatal, log_level=args.log_level)
    api_key = args.api_key or os.environ.get("FERRYLM_API_KEY") or None
    app = create_app(sup, codec, name, api_key=api_key)
    config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=False, timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    server_box["server"] = server

    async def main() -> None:
        await sup.start()
        log.info("serving %s (%s) on http://%s:%d", name, resolved.path, args.host, args.port)
        try:
            await server.serve(sockets=[sock])
        finally:
            await sup.close()

    asyncio.run(main())
    sock.close()
    return exit_code
