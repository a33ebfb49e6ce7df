"""The default ``--max-running-requests``: as many requests as the memory plan carries.

Rule: the largest ``N`` in ``1 .. MAX_RUNNING_REQUESTS`` (256, vLLM's default ``max_num_seqs``) whose own plan
(:func:`~ferrylm.memory.plan.plan_memory` with ``max_running_requests = N``: the KV floor, the recurrent-state slots
and the expert slots of one decode step all follow ``N``) fits and

- holds ``N`` requests of ``TYPICAL_REQUEST_TOKENS`` (1024 tokens: a prompt of about a thousand tokens and its
  answer; the context when that is shorter) in its KV pool, and
- gives the recurrent state of hybrid models (``N`` slots, their prefix-cache snapshots and the scratch slot) no
  more bytes than the KV pool, and, beside an expert cache that cannot hold every expert, no more than
  ``STATE_SHARE_OF_CACHE`` of the bytes the state and the slots share: every running request pays for a slot
  taken by the state in hit rate, so the state does not take the expert cache's room.

``N = 1`` when no ``N`` meets it (a pool shorter than one typical request). An explicit ``--max-running-requests``
wins. Pure: the caller hands in a function giving the plan's inputs at each ``N``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ferrylm.memory.budget import MemoryPlanError
from ferrylm.memory.plan import MemoryPlan, PlanInputs, plan_memory

TYPICAL_REQUEST_TOKENS = 1024
MAX_RUNNING_REQUESTS = 256
STATE_SHARE_OF_CACHE = 0.10


def typical_tokens(max_model_len: int) -> int:
    """Tokens of one typical request: ``TYPICAL_REQUEST_TOKENS``, or the context when shorter."""
    return max(1, min(TYPICAL_REQUEST_TOKENS, max_model_len))


def requests_in_pool(pool_tokens: int, max_model_len: int, upper: int = MAX_RUNNING_REQUESTS) -> int:
    """Typical requests a KV pool of ``pool_tokens`` holds, in ``1 .. upper``."""
    return max(1, min(upper, pool_tokens // typical_tokens(max_model_len)))


def carries(plan: MemoryPlan, n: int) -> bool:
    """``plan`` (made for ``n`` running requests) holds ``n`` typical requests in its KV pool and gives the
    recurrent state no more bytes than the KV pool, nor more than its share beside a missing expert cache (module
    docstring)."""
    if plan.kv_tokens < n * typical_tokens(plan.max_model_len) or plan.state_bytes > plan.kv_bytes:
        return False
    if 0 < plan.expert_slots < plan.expert_total:  # a cache that misses: the state shares its room
        shared = plan.state_bytes + plan.expert_slots * plan.expert_slot_bytes
        return plan.state_bytes <= STATE_SHARE_OF_CACHE * shared
    return True


@dataclass(frozen=True)
class RunningChoice:
    """The resolved ``max_running_requests`` (``n``) and where it comes from (``note``, the plan table's right
    column)."""

    n: int
    note: str


def choose_running_requests(inputs_at: Callable[[int], PlanInputs], upper: int = MAX_RUNNING_REQUESTS
                            ) -> RunningChoice:
    """The largest ``N`` in ``1 .. upper`` whose plan (``plan_memory(inputs_at(N))``) fits and :func:`carries`
    ``N``, by bisection (both conditions only get harder as ``N`` grows); 1 when none does (the caller's plan at 1
    then raises if nothing fits)."""
    def ok(n: int) -> bool:
        try:
            return carries(plan_memory(inputs_at(n)), n)
        except MemoryPlanError:
            return False

    lo, hi = 0, max(1, upper)   # ok(lo) holds (0: nothing asked); find the last ok in 1 .. hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    typ = typical_tokens(inputs_at(1).max_model_len)
    if lo == 0:
        return RunningChoice(1, f"the KV pool holds less than one {typ}-token request; --max-running-requests "
                                f"sets it")
    return RunningChoice(lo, f"{typ}-token requests the KV pool holds (at most {MAX_RUNNING_REQUESTS}); "
                             f"--max-running-requests sets it")
