"""Named fault-injection points: make an allocation that scales with the request fail on purpose.

Off by default and free when off: a disabled :class:`FaultInjector` has ``enabled`` False and every site tests that
attribute (or calls :meth:`FaultInjector.check`, whose first line tests it). It is switched on only by the env
variable ``FERRYLM_FAULTS`` or the ``--faults`` flag (both are read; the flag's rules come first), parsed once
when the engine (or the frontend) is built, and passed down explicitly: there is no module-level mutable state.

Spec: comma-separated rules ``point[:key=value]...``, e.g.
``prefill_workspace:after=2:times=1`` or ``attention_scratch:min_prompt=300,detokenize:times=1``.

Points (where each is checked):

=====================  ================================================================  ======================
point                  site                                                              raises
=====================  ================================================================  ======================
``prefill_workspace``  ``Engine._run``: inputs of a step holding a prefill chunk           torch.OutOfMemoryError
``attention_scratch``  ``PagedAttention.attend``: K/V gather, after the step's K/V write   torch.OutOfMemoryError
``deltanet_scratch``   ``GatedDeltaNet.forward``: chunk-form scratch of a step with a     torch.OutOfMemoryError
                       prefill, after the layer's conv-state write (models/gated_deltanet.py)
``expert_fetch``       ``experts/cached.py``, ``stream.py``: slot fetch, prefill staging   torch.OutOfMemoryError
``kv_page_alloc``      ``Scheduler._grow``: pages for a request's next tokens              torch.OutOfMemoryError
``logits``             ``Engine._run``: logits of the sampled rows and sampling            torch.OutOfMemoryError
``detokenize``         frontend ``IncrementalDetokenizer.step``                            MemoryError
``engine_stall``       ``engine/worker.py`` loop: hang before the next step (heartbeats   (hangs)
                       continue); ``file=PATH``: when PATH exists (removed first)
``step_delay``         ``engine/progress.py`` layer hook: sleep ``ms`` per decoder layer   (slow step, ticking)
                       (a long step that makes progress; ``ms`` large: a hang inside a
                       step)
``device_error``       ``engine/progress.py`` layer hook: a sticky device error inside     torch.AcceleratorError
                       the forward (illegal memory access; the engine must exit)           (RuntimeError before
                                                                                           torch 2.9)
``heartbeat_error``    ``engine/worker.py`` heartbeat thread: the stats read fails         RuntimeError
``boot_delay``         ``engine/worker.py``: sleep ``ms`` before the engine is built        (slow boot)
                       (every boot, restarts included: a restart that takes a known
                       time); ``file=PATH``: only while PATH exists (it is kept)
``ipc_garbage``        frontend ``Supervisor.generate``: before the request, send the      (malformed messages)
                       engine an undecodable message and an AddRequest with bad fields
=====================  ================================================================  ======================

Keys (all optional): ``after=N`` let the first N matching hits pass; ``times=N`` fire at most N times (default:
every matching hit); ``min_prompt=N`` match only when the request concerned has a prompt of at least N tokens
(a step's sites use the largest prompt in the step, see :meth:`FaultInjector.set_step`); ``max_prompt=N`` only
when it has at most N; ``phase=prefill|decode``
match only steps of that kind; ``bytes=N`` the size the error reports (default: the site's own estimate, at least
1 MiB); ``file=PATH`` (``engine_stall`` and ``boot_delay``; the last key of its rule, so PATH may contain ``:``);
``ms=N`` (``step_delay``: milliseconds per layer, default 100; ``boot_delay``: milliseconds before the build,
default 1000).

The error is the real type: ``torch.OutOfMemoryError`` with a CUDA-like message ("CUDA out of memory. Tried to
allocate ..."), so the engine's OOM guard cannot tell it from a real one; the frontend site raises ``MemoryError``.
The legacy env variable ``FERRYLM_FAULT_STALL_FILE=PATH`` is read as ``engine_stall:file=PATH``.

This module does not import torch at import time (the frontend uses it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV = "FERRYLM_FAULTS"
STALL_FILE_ENV = "FERRYLM_FAULT_STALL_FILE"
POINTS: tuple[str, ...] = ("prefill_workspace", "attention_scratch", "expert_fetch", "kv_page_alloc", "logits",
                           "detokenize", "engine_stall", "step_delay", "device_error", "heartbeat_error",
                           "ipc_garbage", "deltanet_scratch", "boot_delay")
FRONTEND_POINTS = frozenset({"detokenize", "ipc_garbage"})
# what torch raises for an illegal address on CUDA (torch >= 2.9: torch.AcceleratorError, a RuntimeError)
DEVICE_ERROR_TEXT = ("CUDA error: an illegal memory access was encountered\nSearch for `cudaErrorIllegalAddress' in "
                     "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.\n"
                     "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
                     "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")
_MIN_REPORTED_BYTES = 1 << 20


@dataclass(frozen=True)
class FaultRule:
    """One rule of the spec (see the module docstring for the keys). ``times`` None = every matching hit."""

    point: str
    after: int = 0
    times: int | None = None
    min_prompt: int = 0
    max_prompt: int | None = None
    phase: str | None = None
    nbytes: int | None = None
    file: str | None = None
    ms: int | None = None


def parse_rules(spec: str | None) -> list[FaultRule]:
    """Parse a spec string into rules.

    Raises:
        ValueError: unknown point or key, a value that is not a non-negative integer, a bad phase, a point named
            twice, or ``file=`` on a point other than ``engine_stall`` and ``boot_delay``. The message quotes the
            offending part.
    """
    rules: list[FaultRule] = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, *opts = part.split(":")
        name = name.strip()
        if name not in POINTS:
            raise ValueError(f"unknown fault point {name!r} in {part!r}; points: {', '.join(POINTS)}")
        kw: dict = {}
        for i, opt in enumerate(opts):
            key, sep, value = opt.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"fault option {opt!r} in {part!r} must be key=value")
            if key == "file":
                if name not in ("engine_stall", "boot_delay"):
                    raise ValueError(f"file= applies to engine_stall and boot_delay only, not {name!r}")
                kw["file"] = ":".join([value, *opts[i + 1:]])  # the rest of the rule: a path may contain ':'
                break
            elif key == "phase":
                if value not in ("prefill", "decode"):
                    raise ValueError(f"phase must be prefill or decode, got {value!r} in {part!r}")
                kw["phase"] = value
            elif key in ("after", "times", "min_prompt", "max_prompt", "bytes", "ms"):
                if key == "ms" and name not in ("step_delay", "boot_delay"):
                    raise ValueError(f"ms= applies to step_delay and boot_delay only, not {name!r}")
                try:
                    n = int(value)
                except ValueError:
                    n = -1
                if n < 0:
                    raise ValueError(f"fault option {key} must be an integer >= 0, got {value!r} in {part!r}")
                kw["nbytes" if key == "bytes" else key] = n
            else:
                raise ValueError(f"unknown fault option {key!r} in {part!r}; keys: after, times, min_prompt, "
                                 f"max_prompt, phase, bytes, file, ms")
        if any(r.point == name for r in rules):
            raise ValueError(f"fault point {name!r} is named twice")
        rules.append(FaultRule(name, **kw))
    return rules


def _fmt_bytes(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.2f} MiB"


class FaultInjector:
    """The rules of one process plus their hit counters.

    Args:
        rules: parsed rules (:func:`parse_rules`); empty → disabled.

    Attributes:
        enabled: any rule at all (sites test this first; a disabled injector costs one attribute read).
        step_prompt_tokens, step_phase: the current step's context (set by the engine before each attempt), used
            by sites that do not know their request (attention, experts, logits).
    """

    def __init__(self, rules: list[FaultRule] | tuple[FaultRule, ...] = ()):
        self.rules: dict[str, FaultRule] = {r.point: r for r in rules}
        self.enabled = bool(self.rules)
        self._hits: dict[str, int] = {}
        self._fired: dict[str, int] = {}
        self.step_prompt_tokens = 0
        self.step_phase: str | None = None

    @classmethod
    def parse(cls, spec: str | None) -> "FaultInjector":
        """An injector from a spec string (None or "" → disabled). Raises ValueError like :func:`parse_rules`."""
        return cls(parse_rules(spec))

    @classmethod
    def from_config(cls, flag: str | None = None, environ: Mapping[str, str] | None = None) -> "FaultInjector":
        """Rules from ``--faults`` (``flag``) plus ``FERRYLM_FAULTS`` plus the legacy stall-file variable.

        Raises:
            ValueError: a bad spec (the message names where it came from), or a point set in both places.
        """
        env = os.environ if environ is None else environ
        rules: list[FaultRule] = []
        for origin, spec in (("--faults", flag), (ENV, env.get(ENV))):
            try:
                for r in parse_rules(spec):
                    if any(x.point == r.point for x in rules):
                        raise ValueError(f"fault point {r.point!r} is named twice")
                    rules.append(r)
            except ValueError as e:
                raise ValueError(f"{origin}: {e}") from None
        stall = env.get(STALL_FILE_ENV)
        if stall and not any(r.point == "engine_stall" for r in rules):
            rules.append(FaultRule("engine_stall", file=stall))
        return cls(rules)

    # --- context ----------------------------------------------------------------------------------------------
    def set_step(self, prompt_tokens: int, phase: str | None) -> None:
        """Context for the next hits: the largest prompt (tokens) among the step's requests, and ``prefill`` /
        ``decode``."""
        self.step_prompt_tokens = prompt_tokens
        self.step_phase = phase

    # --- hits -------------------------------------------------------------------------------------------------
    def fires(self, point: str, *, prompt_tokens: int | None = None) -> bool:
        """Count a hit at ``point`` and say whether it must fail now (rule matches, past ``after``, within
        ``times``)."""
        if not self.enabled:
            return False
        rule = self.rules.get(point)
        if rule is None:
            return False
        prompt = self.step_prompt_tokens if prompt_tokens is None else prompt_tokens
        if prompt < rule.min_prompt or (rule.max_prompt is not None and prompt > rule.max_prompt):
            return False
        if rule.phase is not None and prompt_tokens is None and rule.phase != self.step_phase:
            return False
        hits = self._hits.get(point, 0) + 1
        self._hits[point] = hits
        if hits <= rule.after:
            return False
        fired = self._fired.get(point, 0)
        if rule.times is not None and fired >= rule.times:
            return False
        self._fired[point] = fired + 1
        return True

    def check(self, point: str, *, nbytes: int = 0, prompt_tokens: int | None = None) -> None:
        """Raise ``torch.OutOfMemoryError`` ("CUDA out of memory. Tried to allocate X ...") when ``point`` fires.
        ``nbytes``: the size of the allocation the site is about to make (bytes), reported in the message."""
        if not self.enabled or not self.fires(point, prompt_tokens=prompt_tokens):
            return
        import torch

        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {_fmt_bytes(self._size(point, nbytes))}. "
            f"(ferrylm fault injection at {point!r}, firing {self._fired[point]})")

    def check_host(self, point: str, *, nbytes: int = 0, prompt_tokens: int | None = None) -> None:
        """Raise ``MemoryError`` (a host allocation failure) when ``point`` fires."""
        if not self.enabled or not self.fires(point, prompt_tokens=prompt_tokens):
            return
        raise MemoryError(f"cannot allocate {_fmt_bytes(self._size(point, nbytes))} "
                          f"(ferrylm fault injection at {point!r}, firing {self._fired[point]})")

    def layer_hook(self, step_tokens: int = 0) -> None:  # noqa: ARG002 - the step context is set_step's
        """The per-layer site (``engine/progress.py``): sleep for ``step_delay``; raise a sticky device error for
        ``device_error`` (``torch.AcceleratorError`` where torch has it, else a RuntimeError with the CUDA
        message, as torch raises for an illegal address)."""
        if not self.enabled:
            return
        rule = self.rules.get("step_delay")
        if rule is not None and self.fires("step_delay"):
            import time

            time.sleep((100 if rule.ms is None else rule.ms) / 1000)
        if "device_error" in self.rules and self.fires("device_error"):
            raise device_error(f"(ferrylm fault injection at 'device_error', firing {self._fired['device_error']})")

    def boot_hook(self) -> None:
        """The engine process's boot site (``engine/worker.py``, before the engine is built): sleep for
        ``boot_delay`` (with ``file=PATH``, only while PATH exists)."""
        rule = self.rules.get("boot_delay") if self.enabled else None
        if rule is not None and (rule.file is None or os.path.exists(rule.file)) and self.fires("boot_delay"):
            import time

            time.sleep((1000 if rule.ms is None else rule.ms) / 1000)

    def should_stall(self) -> bool:
        """``engine_stall``: True when the loop must hang now. With ``file=PATH``: PATH exists (it is removed, so
        a restarted engine does not hang again); otherwise by the rule's counters, one hit per loop step."""
        if not self.enabled:
            return False
        rule = self.rules.get("engine_stall")
        if rule is None:
            return False
        if rule.file:
            if not os.path.exists(rule.file):
                return False
            try:
                os.remove(rule.file)
            except OSError:
                return False
            return True
        return self.fires("engine_stall", prompt_tokens=0)

    def fired(self, point: str) -> int:
        """How many times ``point`` has fired in this process."""
        return self._fired.get(point, 0)

    def _size(self, point: str, nbytes: int) -> int:
        rule = self.rules[point]
        return rule.nbytes if rule.nbytes is not None else max(int(nbytes), _MIN_REPORTED_BYTES)

    def __repr__(self) -> str:
        return f"FaultInjector({', '.join(self.rules) or 'off'})"


def device_error(note: str = "") -> RuntimeError:
    """The exception torch raises for an illegal memory access on CUDA: ``torch.AcceleratorError`` (torch >= 2.9),
    else a RuntimeError with the same message."""
    import torch

    cls = getattr(torch, "AcceleratorError", RuntimeError)
    return cls(DEVICE_ERROR_TEXT + (f"\n{note}" if note else ""))


NO_FAULTS = FaultInjector()
"""The disabled injector (no rules; its counters are never touched), the default of every site."""
