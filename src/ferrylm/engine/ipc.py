"""Frontend ↔ engine messages: typed dataclasses, msgpack on the wire (never pickle).

Two ZeroMQ PUSH/PULL pipes per server instance, bound by the frontend under a private temp dir
(``ipc://<dir>/in``, ``ipc://<dir>/out``) so two servers never collide. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from ferrylm.engine.outputs import EngineOutput


@dataclass
class AddRequest:
    """A request for the engine. ``isolate``: run it in steps of its own (set by the supervisor for a suspect of
    an earlier engine failure, never by a client)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict
    isolate: bool = False


@dataclass
class AbortRequest:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class Loading:
    """Sent while the engine boots, once per phase (``phase``: "reading weights", "warming up", "capturing graphs";
    ``engine/boot.py`` names them): the frontend shows them while the model loads."""

    phase: str


@dataclass
class Ready:
    """Sent once after the model is loaded and warm. ``info``: max_model_len, pool tokens, device ..."""

    info: dict


@dataclass
class Heartbeat:
    """Sent about every 0.5 s, busy or idle. ``stats``: Engine.stats(); ``last_step_age`` seconds;
    ``progress``: ``StepProgress.report()`` plus ``num_running`` (engine/progress.py: ticks, the running step's
    requests and expected duration)."""

    stats: dict
    last_step_age: float = 0.0
    progress: dict = field(default_factory=dict)


@dataclass
class Outputs:
    outputs: list[EngineOutput] = field(default_factory=list)


@dataclass
class Fatal:
    """The engine hit an error it cannot serve through and is exiting. ``code``: ``model_load_error`` (or another
    FerryError code) at start-up, ``device_error`` (a sticky device error: the CUDA context is poisoned),
    ``step_failed`` (an unexpected error in a step); ``request_ids``: the requests of the step that failed."""

    message: str
    code: str = ""
    request_ids: list[str] = field(default_factory=list)


_TYPES: dict[str, type] = {c.__name__: c for c in (AddRequest, AbortRequest, Shutdown, Loading, Ready, Heartbeat,
                                                   Outputs, Fatal)}


def encode(msg: Any) -> bytes:
    """Message dataclass → msgpack bytes ``[type_name, fields]``."""
    if isinstance(msg, Outputs):
        body = {"outputs": [o.to_dict() for o in msg.outputs]}
    else:
        body = asdict(msg)
    return msgpack.packb([type(msg).__name__, body], use_bin_type=True)


def decode(data: bytes) -> Any:
    """Inverse of :func:`encode`. Raises ValueError for an unknown message type."""
    name, body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    cls = _TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown IPC message type {name!r}")
    if cls is Outputs:
        return Outputs([EngineOutput.from_dict(o) for o in body["outputs"]])
    return cls(**body)
