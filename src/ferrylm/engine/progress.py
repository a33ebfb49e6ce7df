"""Progress inside a step, for the watchdog: a counter the engine bumps per layer and per step boundary, and the
expected duration of the step now running.

The supervisor's watchdog must tell a long step from a hang. A 2048-token prefill chunk of a MoE model on two
CPU cores takes ~20 s, far longer than any sane ``--watchdog-timeout``, yet it is making progress the whole time.
So the engine exposes :class:`StepProgress`:

- ``ticks``: bumped when a step begins, after every decoder layer's forward (one forward hook per layer, which
  only increments a Python int: no clock read, no device sync) and when the step ends. The heartbeat thread
  reports it every ~0.5 s; the supervisor counts a changed value as progress.
- ``expected_step_s``: the running step's expected duration, from measured step times (``warmup`` measures a
  full prefill chunk at boot): ``tokens x seconds per token`` for prefill-sized steps, the decode step time
  otherwise. The watchdog's deadline for "no tick" is ``max(--watchdog-timeout, margin x expected_step_s /
  ticks_per_step)``, so a step that is slow by nature is never taken for a hang, and a hang inside a fast step is
  still found at ``--watchdog-timeout``.
- ``step_request_ids``: the requests of the running step: when the engine dies or stalls in a step, these are the
  suspects the supervisor isolates (and quarantines when they fail again; ``server/process/quarantine.py``).

On CUDA the forward is asynchronous: a layer's hook runs when the host has *queued* the layer, so ticks measure
host progress; a kernel that never finishes stops the ticks at the next synchronising call (the expert routing
read, the sampler), which is where the watchdog then sees the hang.

Fault injection (``ferrylm/faults.py``): the layer hook is the site of ``step_delay`` (sleep per layer: long steps
with progress) and ``device_error`` (a sticky device error raised inside the forward, as a real one would be).

Abort at a layer boundary: ``layer_callback`` (set by the worker) runs after each layer of a step; it applies the
frontend's AbortRequests at once (``Engine.abort`` frees the pages now and the engine commits nothing for a request
that finished during the step). When that leaves the step no request, the engine sets ``abandoned`` and the next
layer boundary raises :class:`StepAbandoned`: the rest of the chunk is not computed (a host flag, no device sync;
layers replayed inside a CUDA graph have no boundary, so such a step runs to its end).

Fields are plain ints, floats and tuples assigned whole, so the heartbeat thread reads them without a lock (the
GIL makes each assignment atomic; a read may mix two steps' fields, which only costs one heartbeat's accuracy).
"""

from __future__ import annotations

from typing import Callable

import logging
import time
from dataclasses import dataclass, field

from ferrylm.faults import NO_FAULTS, FaultInjector

log = logging.getLogger("ferrylm.engine")

PREFILL_SIZED_TOKENS = 32   # steps with at least this many tokens estimate by seconds per token
EMA_ALPHA = 0.3             # weight of the newest measurement in the step-time averages
_HOOKS_ATTR = "_ferrylm_progress_hooks"
_TARGET_ATTR = "_ferrylm_progress"


class StepAbandoned(BaseException):
    """Raised at a layer boundary of a step whose requests were all aborted meanwhile; the engine drops the step
    (nothing of it is committed). A BaseException so that no ``except Exception`` inside the forward (a graph
    fallback, a kernel probe) mistakes it for a failure."""


@dataclass
class StepProgress:
    """What the engine is doing now (see the module docstring). Times are ``time.monotonic()`` seconds.

    Attributes:
        ticks: progress counter (step boundaries and layers).
        steps: steps begun so far.
        in_step: a step is running.
        step_started: when the running (or last) step began.
        step_tokens: tokens the running step computes.
        step_request_ids: the running step's requests.
        expected_step_s: expected duration of the running step (seconds; 0 = no measurement yet).
        ticks_per_step: ticks one step makes when every layer is hooked (hooked layers + 1).
        sec_per_token: measured seconds per token of prefill-sized steps (None before one was measured).
        decode_step_s: measured seconds of a small (decode) step (None before one was measured).
        faults: the engine's fault injector (points ``step_delay`` and ``device_error`` fire in the layer hook).
    """

    ticks: int = 0
    steps: int = 0
    in_step: bool = False
    step_started: float = 0.0
    step_tokens: int = 0
    step_request_ids: tuple[str, ...] = ()
    expected_step_s: float = 0.0
    ticks_per_step: int = 1
    sec_per_token: float | None = None
    decode_step_s: float | None = None
    faults: FaultInjector = field(default=NO_FAULTS, repr=False)
    # called after every decoder layer while a step runs (the worker's abort poll: a client that left during a
    # long prefill frees its pages at the next layer boundary, not after the chunk); None: nothing
    layer_callback: Callable[[], None] | None = field(default=None, repr=False)
    # set by the engine when every request of the running step was aborted: the next layer boundary raises
    abandoned: bool = False

    # --- the model side ---------------------------------------------------------------------------------------
    def attach(self, model) -> int:
        """Make ``model``'s decoder layers (``model.model.layers``) tick this object; return how many layers.

        One forward hook per layer, installed once per model; a later :meth:`attach` of another StepProgress to
        the same model only retargets the hooks (engines built one after another over one loaded model, as the
        tests and the offline API do, never stack hooks). A model without ``model.model.layers`` (a test double)
        ticks at step boundaries only."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            return 0
        try:
            object.__setattr__(model, _TARGET_ATTR, self)   # nn.Module.__setattr__ would treat it as a submodule
            if not getattr(model, _HOOKS_ATTR, None):
                hooks = [layer.register_forward_hook(_layer_hook(model)) for layer in layers]
                object.__setattr__(model, _HOOKS_ATTR, hooks)
        except (AttributeError, TypeError):   # not an nn.Module stack: no per-layer progress
            return 0
        self.ticks_per_step = len(layers) + 1
        return len(layers)

    def on_layer(self) -> None:
        """A decoder layer finished its forward (host side). Raises what an injected fault raises, and
        StepAbandoned when the step was abandoned."""
        self.ticks += 1
        if self.faults.enabled:
            self.faults.layer_hook(self.step_tokens)
        cb = self.layer_callback
        if cb is not None and self.in_step:
            cb()
        if self.abandoned and self.in_step:
            raise StepAbandoned()

    # --- the engine side --------------------------------------------------------------------------------------
    def begin_step(self, request_ids: tuple[str, ...], tokens: int, prompt_tokens: int = 0) -> None:
        """A step of ``tokens`` tokens for ``request_ids`` starts now. ``prompt_tokens``: the largest prompt of the
        step (the fault rules' ``min_prompt``)."""
        self.step_request_ids = request_ids
        self.abandoned = False
        self.step_tokens = tokens
        self.expected_step_s = self.expected(tokens)
        self.step_started = time.monotonic()
        self.steps += 1
        self.in_step = True
        self.ticks += 1
        if self.faults.enabled:
            self.faults.set_step(prompt_tokens, "prefill" if tokens > len(request_ids) else "decode")

    def end_step(self, *, measured: bool = True) -> float:
        """The running step ended; return its duration (seconds). ``measured``: fold the duration into the
        estimates (False for a step cut short by an error). ``step_request_ids`` keeps the ended step's requests
        (the worker names them when the step raised)."""
        dt = time.monotonic() - self.step_started
        if measured and self.step_tokens > 0:
            self._learn(self.step_tokens, dt)
        self.in_step = False
        self.ticks += 1
        return dt

    def seed_from(self, other: "StepProgress | None") -> None:
        """Take ``other``'s measured step times where this object has none yet (the boot warmup's throwaway engine
        measured them on this model and host: without them the first prefill-sized step would be expected to take
        a decode step's time, and on a slow host a long first chunk could outlast ``--watchdog-timeout``)."""
        if other is None:
            return
        if self.sec_per_token is None:
            self.sec_per_token = other.sec_per_token
        if self.decode_step_s is None:
            self.decode_step_s = other.decode_step_s

    def expected(self, tokens: int) -> float:
        """Expected seconds for a step of ``tokens`` tokens (0.0 while nothing was measured)."""
        per_token = (self.sec_per_token or 0.0) * tokens if tokens >= PREFILL_SIZED_TOKENS else 0.0
        return max(per_token, self.decode_step_s or 0.0)

    def _learn(self, tokens: int, dt: float) -> None:
        if tokens >= PREFILL_SIZED_TOKENS:
            spt = dt / tokens
            self.sec_per_token = spt if self.sec_per_token is None else \
                (1 - EMA_ALPHA) * self.sec_per_token + EMA_ALPHA * spt
        else:
            self.decode_step_s = dt if self.decode_step_s is None else \
                (1 - EMA_ALPHA) * self.decode_step_s + EMA_ALPHA * dt

    def report(self) -> dict:
        """The heartbeat's view (plain values for msgpack)."""
        return {"ticks": self.ticks, "steps": self.steps, "in_step": self.in_step,
                "step_age_s": round(time.monotonic() - self.step_started, 3) if self.in_step else 0.0,
                "step_tokens": self.step_tokens, "expected_step_s": round(self.expected_step_s, 4),
                "ticks_per_step": self.ticks_per_step,
                "step_request_ids": list(self.step_request_ids) if self.in_step else []}


def _layer_hook(model):
    def hook(module, args, output):  # noqa: ARG001 - forward hook signature
        target = getattr(model, _TARGET_ATTR, None)
        if target is not None:
            target.on_layer()
    return hook
