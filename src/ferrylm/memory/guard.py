"""The OOM guard: decisions of the recovery ladder at the engine's step boundary, its counters, and the elastic
expert cache. The ladder (``memory/ladder.py``) applies the decisions.

The ladder catches every allocation failure of a step (:func:`is_oom`), leaves the ``except`` block so the step's
tensors lose their last references, calls :meth:`OomGuard.release` (garbage collection, then the CUDA allocator's
cache back to the driver) and asks :meth:`OomGuard.next_action` what to try next. Per step the rungs are:

0. ``retry`` once at the same size (a fragmented allocator often succeeds once its cache is released; an injected
   fault that fires once is survived here too);
1. ``shrink``: when the expert slot cache can spare it, it gives back in ONE move the headroom the plan promised:
   the planned workspace (``workspace_bytes``) plus ``shrink_margin_bytes``, at least the failed allocation
   (doubling on a second try within the step); it grows back when free memory returns (:meth:`OomGuard.tick`).
   This comes before halving the chunk: with experts off the device each prefill chunk streams every expert
   layer across PCIe once, so a halved chunk doubles that cost for the rest of the prompt, and a cache shrunk by a
   few slots at a time keeps the engine at the edge of OOM, paying a failure and a retry every step;
2. ``halve``: the prefill tokens of the step halved, down to ``prefill_floor`` (128) tokens; the scheduler's
   per-step budget stays lowered and is doubled back every ``restore_after_steps`` clean steps;
3. ``defer`` / ``preempt``: a step that holds a prefill chunk and other work *defers* its prefill chunks (they
   keep their pages and counters and run in a later step; the decodes run now), or, with only prefill chunks,
   defers all but the first; a decode-only step preempts its newest request (requeued, recomputed later), and
   repeats;
4. ``fail``: the requests still in the step end with ``insufficient_memory`` (HTTP 503 + Retry-After at the
   edge); the engine keeps serving.

Every action is counted (:attr:`OomGuard.recoveries`, by action, for ``/metrics``) and logged with its numbers.
"""

from __future__ import annotations

import gc
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from ferrylm.memory.budget import gib
from ferrylm.memory.probe import free_bytes, release_cached

if TYPE_CHECKING:
    from ferrylm.experts.executor import ExpertExecutor

log = logging.getLogger("ferrylm.memory")

ACTIONS = ("retry", "halve", "shrink", "defer", "preempt", "fail", "grow", "restore")

_CUDA_OOM_TEXT = ("CUDA out of memory", "CUDA error: out of memory", "HIP out of memory",
                  "DefaultCPUAllocator: can't allocate memory", "out of memory")
_SIZE_RE = re.compile(r"[Tt]ried to allocate ([0-9.]+) ?(GiB|MiB|KiB|GB|MB|KB|B|bytes)")
_UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1,
          "bytes": 1}


def is_oom(exc: BaseException) -> bool:
    """True for an allocation failure: ``torch.OutOfMemoryError``, ``MemoryError``, or a RuntimeError whose
    message is the CUDA/CPU allocator's ("CUDA out of memory", "CUDA error: out of memory", ...)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc)
        return any(t in msg for t in _CUDA_OOM_TEXT)
    return False


# NOTE: sticky CUDA errors only: the ones that poison the context (every later call fails), by their cudaError_t
# names (torch's messages say "Search for `cudaErrorIllegalAddress'") and their runtime message texts (CUDA,
# HIP and Triton's "Triton Error [CUDA]: ..." all reuse them). Any other "CUDA error: ..." (invalid argument, no
# kernel image, a capture misuse, too many resources requested for launch) leaves the context usable: the step
# fails, the engine lives.
STICKY_CUDA_ERRORS = {
    "cudaErrorIllegalAddress": "an illegal memory access was encountered",          # 700
    "cudaErrorLaunchTimeout": "the launch timed out and was terminated",              # 702
    "cudaErrorAssert": "device-side assert triggered",                                # 710
    "cudaErrorHardwareStackError": "hardware stack error",                            # 714
    "cudaErrorIllegalInstruction": "an illegal instruction was encountered",         # 715
    "cudaErrorMisalignedAddress": "misaligned address",                               # 716
    "cudaErrorInvalidAddressSpace": "operation not supported on global/shared address space",  # 717
    "cudaErrorInvalidPc": "invalid program counter",                                   # 718
    "cudaErrorLaunchFailure": "unspecified launch failure",                           # 719
    "cudaErrorECCUncorrectable": "uncorrectable ECC error encountered",               # 214
    "cudaErrorNvlinkUncorrectable": "uncorrectable NVLink error detected during the execution",  # 220
}
# library statuses that report a kernel that failed on the device (the context is gone with it)
_STICKY_STATUS = ("CUBLAS_STATUS_EXECUTION_FAILED", "CUDNN_STATUS_EXECUTION_FAILED")


def is_device_error(exc: BaseException) -> bool:
    """True for a sticky device error, one that poisons the CUDA context so that every later call fails
    (illegal memory access, device-side assert, launch failure, ECC ...): matched by its error kind
    (:data:`STICKY_CUDA_ERRORS`: the cudaError_t name or its message; ``torch.AcceleratorError`` (torch >= 2.9)
    and RuntimeError alike), never by "CUDA error" alone. Never an allocation failure (:func:`is_oom` wins:
    "CUDA error: out of memory" is an OOM). The engine must not retry it: it reports it and exits so it is
    restarted."""
    if is_oom(exc) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return (any(name in text or msg in text for name, msg in STICKY_CUDA_ERRORS.items())
            or any(t in text for t in _STICKY_STATUS))


def oom_bytes(exc: BaseException) -> int | None:
    """The size of the failed allocation in bytes, parsed from the allocator's message, or None."""
    m = _SIZE_RE.search(str(exc))
    if not m:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2)])


# --- elastic expert cache --------------------------------------------------------------------------------------
@runtime_checkable
class ElasticCache(Protocol):
    """An expert slot cache that can give memory back between steps and take it again.

    ``num_slots``: slots now; ``slot_bytes``: device bytes per slot; ``min_slots``: the backend cannot work with
    fewer. ``shrink(n)`` drops up to ``n`` slots (least useful first; nothing is pinned between steps) and
    returns the device bytes it freed (0: nothing could go). ``grow(n)`` adds up to ``n`` slots and returns how
    many it added (it may add fewer, or 0, when memory is short; it must not raise on OOM)."""

    @property
    def num_slots(self) -> int: ...

    @property
    def slot_bytes(self) -> int: ...

    @property
    def min_slots(self) -> int: ...

    def shrink(self, n: int) -> int: ...

    def grow(self, n: int) -> int: ...


class NoElasticCache:
    """The resident backend (every expert is a weight) or a dense model: no slots, nothing to free."""

    num_slots = 0
    slot_bytes = 0
    min_slots = 0

    def shrink(self, n: int) -> int:
        return 0

    def grow(self, n: int) -> int:
        return 0


class ExecutorSlotCache:
    """:class:`ElasticCache` over an expert executor's slot cache (``ExpertExecutor.shrink_slots`` / ``grow_slots``:
    the offloading backends, ``experts/slots.py``)."""

    def __init__(self, executor: ExpertExecutor):
        self.executor = executor

    @property
    def num_slots(self) -> int:
        return self.executor.num_slots

    @property
    def slot_bytes(self) -> int:
        return self.executor.slot_bytes

    @property
    def min_slots(self) -> int:
        return self.executor.min_slots

    def shrink(self, n: int) -> int:
        return int(self.executor.shrink_slots(n))

    def grow(self, n: int) -> int:
        try:
            return int(self.executor.grow_slots(n))
        except Exception as e:  # noqa: BLE001 - growing is opportunistic; an OOM here just means "not yet"
            if is_oom(e):
                return 0
            raise


def elastic_cache_of(executor: ExpertExecutor | None) -> ElasticCache:
    """The executor's elastic slot cache, or :class:`NoElasticCache` when it has none (a dense model, or a backend
    without a slot cache: ``slot_needs()`` is None, e.g. resident)."""
    if executor is not None and executor.slot_needs() is not None:
        return ExecutorSlotCache(executor)
    return NoElasticCache()


# --- the guard -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GuardConfig:
    """Knobs of the ladder.

    Attributes:
        prefill_floor: the prefill chunk is never halved below this (tokens).
        restore_after_steps: clean steps after which a lowered prefill budget is doubled back (steps).
        grow_interval_s: seconds between attempts to grow a shrunk expert cache back (and after the last OOM).
        free_refresh_s: seconds between free-memory readings for the live figures.
        max_shrinks_per_step: expert-cache shrinks tried within one failing step.
        workspace_bytes: the plan's workspace (bytes): what one shrink gives back at least.
        shrink_margin_bytes: added to it (bytes).
    """

    prefill_floor: int = 128
    restore_after_steps: int = 64
    grow_interval_s: float = 5.0
    free_refresh_s: float = 1.0
    max_shrinks_per_step: int = 2
    workspace_bytes: int = 0
    shrink_margin_bytes: int = 256 << 20


@dataclass(frozen=True)
class Recovery:
    """One rung the ladder (``memory/ladder.py``) applies: ``action`` (one of ``ACTIONS``), ``slots`` for
    ``"shrink"`` (expert slots to give back), ``prefill_tokens`` for ``"halve"`` (the step's prefill after it)."""

    action: str
    slots: int = 0
    prefill_tokens: int = 0


@dataclass
class StepRecovery:
    """The ladder's state within one step: what was tried (``actions``), the last failed allocation
    (``oom_bytes``, bytes or None) and message."""

    retried: bool = False
    shrinks: int = 0
    actions: list[str] = field(default_factory=list)
    oom_bytes: int | None = None
    message: str = ""


class OomGuard:
    """Decides and counts recoveries; keeps the lowered prefill budget and the shrunk slots to give back.

    Args:
        device: the compute device (allocator cache release, free-memory readings).
        cache: the expert slot cache (:func:`elastic_cache_of`).
        prefill_limit: the configured per-step token budget (tokens), restored after a halving.
        reserve_bytes: the plan's reserve; the cache only grows back while more than this stays free.
        config: :class:`GuardConfig`.
        read_free: ``() -> free bytes`` of the device (default: the driver / host reading); tests fake it.
        clock: ``() -> seconds`` (default ``time.monotonic``).
    """

    def __init__(self, device: torch.device, cache: ElasticCache, *, prefill_limit: int, reserve_bytes: int = 0,
                 config: GuardConfig | None = None, read_free: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.device = device
        self.cache = cache
        self.config = config or GuardConfig()
        self.prefill_limit = prefill_limit
        self.reserve_bytes = reserve_bytes
        self._read_free = read_free or (lambda: free_bytes(device))
        self._clock = clock
        self.recoveries: dict[str, int] = {}
        self.failed_requests = 0
        self.prefill_budget = prefill_limit     # what the scheduler is allowed now (tokens)
        self.shrunk_slots = 0                   # slots given up and not yet grown back
        self.last_oom_time: float | None = None
        self._clean_steps = 0
        self._last_grow_try = 0.0
        self.free_now: int | None = None
        self._free_time = 0.0

    # --- ladder -----------------------------------------------------------------------------------------------
    def begin(self) -> StepRecovery:
        return StepRecovery()

    def release(self) -> None:
        """Free what a failed step left behind: collect unreachable tensors, return the CUDA allocator's cached
        blocks to the driver."""
        gc.collect()
        release_cached(self.device)

    def note_oom(self, st: StepRecovery, exc: BaseException) -> None:
        """Record a failed attempt's size and message in ``st`` (call inside the ``except``, keep nothing else)."""
        st.oom_bytes = oom_bytes(exc)
        st.message = str(exc).split("\n")[0][:300]
        self.last_oom_time = self._clock()
        self._clean_steps = 0

    def next_action(self, st: StepRecovery, *, prefill_tokens: int, num_seqs: int, has_prefill: bool = False,
                    allow_shrink: bool = True) -> Recovery:
        """The next rung for a step that failed (module docstring), for the ladder to apply: ``retry``,
        ``shrink`` (counted once :meth:`shrank` confirms it freed memory), ``halve``, ``defer`` (a step with a
        prefill and other work), ``preempt`` (a decode-only step) or ``fail``.

        Args:
            st: the step's state. prefill_tokens: tokens of the step's prefill chunks (chunks of more than one
                token). num_seqs: sequences in the step. has_prefill: the step computes part of a prompt.
            allow_shrink: False right after a shrink that freed nothing.
        """
        if not st.retried:
            st.retried = True
            return Recovery(self._count(st, "retry"))
        if (allow_shrink and st.shrinks < self.config.max_shrinks_per_step
                and self.cache.num_slots > self.cache.min_slots):
            per = max(1, self.cache.slot_bytes)
            want_bytes = max(st.oom_bytes or per, self.config.workspace_bytes + self.config.shrink_margin_bytes)
            want = -(-want_bytes // per) * (2 ** st.shrinks)
            st.shrinks += 1
            return Recovery("shrink", slots=min(want, self.cache.num_slots - self.cache.min_slots))
        if prefill_tokens > self.config.prefill_floor:
            n = max(self.config.prefill_floor, prefill_tokens // 2)
            self.prefill_budget = min(self.prefill_budget, n)
            return Recovery(self._count(st, "halve"), prefill_tokens=n)
        if num_seqs > 1:
            return Recovery(self._count(st, "defer" if has_prefill else "preempt"))
        return Recovery(self._count(st, "fail"))

    def shrank(self, st: StepRecovery, freed: int) -> bool:
        """Record a shrink that gave back ``freed`` bytes; False when it freed nothing (the ladder asks again)."""
        if freed <= 0:
            return False
        n = max(1, freed // max(1, self.cache.slot_bytes))
        self.shrunk_slots += n
        self._last_grow_try = self._clock()
        log.warning("OOM recovery: expert cache shrunk by %d slots (%s freed, %d slots left) to give back "
                    "the planned workspace %s + margin (failed allocation: %s)", n, gib(freed),
                    self.cache.num_slots, gib(self.config.workspace_bytes),
                    gib(st.oom_bytes) if st.oom_bytes else "unknown size")
        self._count(st, "shrink")
        return True

    def _count(self, st: StepRecovery, action: str) -> str:
        st.actions.append(action)
        self.recoveries[action] = self.recoveries.get(action, 0) + 1
        return action

    def count_failed(self, n: int) -> None:
        """``n`` requests ended with insufficient_memory."""
        self.failed_requests += n

    # --- between steps ------------------------------------------------------------------------------------------
    def step_succeeded(self) -> int | None:
        """Count a clean step; return a new (raised) prefill budget when it is time to restore it, else None."""
        if self.prefill_budget >= self.prefill_limit:
            return None
        self._clean_steps += 1
        if self._clean_steps < self.config.restore_after_steps:
            return None
        self._clean_steps = 0
        old = self.prefill_budget
        self.prefill_budget = min(self.prefill_limit, old * 2)
        self.recoveries["restore"] = self.recoveries.get("restore", 0) + 1
        log.info("OOM guard: prefill budget raised back from %d to %d tokens (limit %d) after %d clean steps",
                 old, self.prefill_budget, self.prefill_limit, self.config.restore_after_steps)
        return self.prefill_budget

    def tick(self) -> None:
        """Between steps: refresh the free-memory reading (at most every ``free_refresh_s``) and grow a shrunk
        expert cache back when enough memory is free beyond the reserve (at most every ``grow_interval_s``, and
        not within ``grow_interval_s`` of the last OOM)."""
        now = self._clock()
        if now - self._free_time >= self.config.free_refresh_s or self.free_now is None:
            self._refresh_free(now)
        if self.shrunk_slots <= 0 or now - self._last_grow_try < self.config.grow_interval_s:
            return
        if self.last_oom_time is not None and now - self.last_oom_time < self.config.grow_interval_s:
            return
        self._last_grow_try = now
        self._refresh_free(now)
        per = max(1, self.cache.slot_bytes)
        spare = (self.free_now or 0) - self.reserve_bytes
        n = min(self.shrunk_slots, max(0, spare // per))
        if n <= 0:
            return
        added = self.cache.grow(n)
        if added > 0:
            self.shrunk_slots -= added
            self.recoveries["grow"] = self.recoveries.get("grow", 0) + 1
            log.info("OOM guard: expert cache grew back by %d slots (%d still to regain; %s free, reserve %s)",
                     added, self.shrunk_slots, gib(self.free_now or 0), gib(self.reserve_bytes))

    def read_free_now(self) -> int | None:
        """Read the free memory now (bytes; None when the reading fails) and keep it for the live figures."""
        self._refresh_free(self._clock())
        return self.free_now

    def _refresh_free(self, now: float) -> None:
        try:
            self.free_now = int(self._read_free())
        except Exception:  # noqa: BLE001 - a reading is a nicety; never fail a step for it
            self.free_now = None
        self._free_time = now

    def stats(self) -> dict:
        """Live figures: recoveries by action, failed requests, the prefill budget now, the expert slots now and
        given up, free memory (bytes, refreshed every ``free_refresh_s``)."""
        return {"oom_recoveries": dict(self.recoveries), "oom_failed_requests": self.failed_requests,
                "prefill_budget": self.prefill_budget, "expert_slots": self.cache.num_slots,
                "expert_slots_shrunk": self.shrunk_slots, "free_bytes": self.free_now,
                "free_age_s": round(max(0.0, self._clock() - self._free_time), 2) if self.free_now is not None
                else None}
