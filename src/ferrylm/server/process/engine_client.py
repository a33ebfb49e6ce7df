"""The interface the HTTP layer uses to talk to an engine (the supervisor implements it; tests fake it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from ferrylm.engine.outputs import EngineOutput
from ferrylm.engine.sampling_params import SamplingParams


@dataclass
class HealthState:
    """``status`` is one of ``ready``, ``loading``, ``restarting``, ``stalled``, ``dead``, ``draining``."""

    status: str
    detail: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.status == "ready"


@dataclass
class ModelInfo:
    """What the frontend needs to know about the served model.

    ``max_model_len``: context in tokens; ``kv_pool_tokens``: tokens the KV pool holds (0 = unknown);
    ``eos_token_ids``: the engine's EOS ids.
    """

    name: str
    path: str
    max_model_len: int
    kv_pool_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()


class EngineClient(Protocol):
    """Async access to the engine.

    ``generate`` yields :class:`EngineOutput` objects until one is finished. It raises a
    :class:`ferrylm.errors.FerryError` subclass (``EngineUnavailable`` when the engine is not ready or dies
    mid-request, ``InsufficientMemory``, ``ContextLengthExceeded``, ``QueueTimeout``) instead of yielding an
    error output. Leaving the iteration early (client disconnect) must abort the request in the engine; the
    caller also calls ``abort`` explicitly when it stops on a stop string.

    ``check_admission`` raises, without sending anything, the refusal ``generate`` would raise before the engine
    sees the request (not ready, shutting down, quarantined): the frontend calls it first, so a refused stream is
    an HTTP status, and starts a stream's body as soon as it passes.
    """

    model_info: ModelInfo

    def check_admission(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> HealthState: ...
