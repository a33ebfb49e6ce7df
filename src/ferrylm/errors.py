"""Typed errors raised inside ferrylm.

Each error carries the numbers that explain it. Only the HTTP edge (``server/api/errors.py``) maps them to status
codes and OpenAI-style error JSON ``{"error": {"message", "type", "param", "code"}}``; inside the engine and the
model code they are ordinary exceptions.
"""

from __future__ import annotations


class FerryError(Exception):
    """Base class. ``code`` is the OpenAI-style machine-readable code, ``param`` the offending field (or None)."""

    code: str = "internal_error"
    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code

    def rename_param(self, name: str) -> None:
        """The field was sent under another name (``max_completion_tokens`` for ``max_tokens``): name it in
        ``param`` and in the message, where the old name is quoted."""
        if self.param:
            self.message = self.message.replace(f"'{self.param}'", f"'{name}'")
            self.args = (self.message,)
        self.param = name


class InvalidRequest(FerryError):
    """The client sent something we cannot serve (bad value, bad type, template error). HTTP 400."""

    code = "invalid_request"


class GrammarFailed(InvalidRequest):
    """A request's output grammar (structured output, a forced tool call) could not go on mid-request: no token
    it allows is left (another rule banned them: ``min_tokens`` bans ``stop_token_ids`` the grammar needs; a
    complete grammar ends the request instead), or it matches no document at all. The request ends with this error instead of going on unconstrained. HTTP 400 (an error
    event once the stream started)."""

    code = "grammar_failed"


class ContextLengthExceeded(InvalidRequest):
    """Prompt (+ max_tokens) does not fit the model context or the KV pool. HTTP 400.

    The message must start with "This model's maximum context length is N tokens." (clients such as LiteLLM
    detect overflow by that wording).
    """

    code = "context_length_exceeded"


class ModelNotFound(FerryError):
    """The request names a model this server does not serve. HTTP 404."""

    code = "model_not_found"
    param = "model"


class NotFound(FerryError):
    """The request names something this server does not have (a stored response id ...). HTTP 404."""

    code = "not_found"


class ModelLoadError(FerryError):
    """``--model`` names something that is not a loadable model (missing path, missing config.json, ...)."""

    code = "model_load_error"


class UnsupportedArchitecture(ModelLoadError):
    """config.json names an architecture ferrylm does not implement."""

    code = "unsupported_architecture"


class EngineUnavailable(FerryError):
    """The engine process is dead, restarting or not ready. HTTP 503 + Retry-After."""

    code = "engine_unavailable"


class EngineStalled(EngineUnavailable):
    """The engine stopped making progress (no completed step or no heartbeat for ``--watchdog-timeout``
    seconds); the watchdog killed and is restarting it. HTTP 503 + Retry-After."""

    code = "engine_stalled"


class DeviceError(EngineUnavailable):
    """The engine hit a sticky device error (illegal memory access, device-side assert: the CUDA context is
    poisoned) and is being restarted; the requests in flight are answered with this. HTTP 503 + Retry-After."""

    code = "device_error"


class RequestQuarantined(FerryError):
    """This request (same prompt and parameters) was running when the engine failed, twice: it is refused for a
    while so that it cannot take the server down (``server/process/quarantine.py``). HTTP 500: the server cannot serve
    it; retrying does not help."""

    code = "request_quarantined"


class QueueTimeout(FerryError):
    """A request waited in the queue longer than ``--queue-timeout`` seconds. HTTP 503."""

    code = "queue_timeout"


class RequestTimeout(FerryError):
    """A request ran past its server-side deadline (``--request-timeout`` or the request's ``x-request-timeout``
    header, counted from arrival); the engine stopped it. HTTP 408."""

    code = "request_timeout"


class InsufficientMemory(FerryError):
    """A request could not be served within device memory even after every recovery step. HTTP 503."""

    code = "insufficient_memory"


#: Retry-After seconds of the 503 answers, by error class (the first class an error is an instance of; others: 1)
RETRY_AFTER_S: dict[type, int] = {EngineStalled: 5, EngineUnavailable: 5, QueueTimeout: 2, InsufficientMemory: 2}


def error_from_code(code: str | None, message: str | None) -> FerryError:
    """The typed error for an engine output's ``error_code`` (``context_length_exceeded``, ``invalid_request``,
    ``insufficient_memory``, ``queue_timeout``, ``engine_unavailable``, ``engine_stalled``, ``device_error``,
    ``request_quarantined``, ``request_timeout``, ``grammar_failed``; any other code:
    :class:`EngineUnavailable` carrying it), with the engine's ``message``."""
    cls = {"context_length_exceeded": ContextLengthExceeded, "invalid_request": InvalidRequest,
           "grammar_failed": GrammarFailed,
           "insufficient_memory": InsufficientMemory, "queue_timeout": QueueTimeout,
           "engine_unavailable": EngineUnavailable, "engine_stalled": EngineStalled, "device_error": DeviceError,
           "request_quarantined": RequestQuarantined, "request_timeout": RequestTimeout}.get(code or "",
                                                                                            EngineUnavailable)
    return cls(message or code or "engine error", code=code)

