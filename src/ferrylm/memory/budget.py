"""What the memory plan may hand out, and the boot error when it cannot.

``budget = usable - reserve``, one cut. ``usable`` is what ferrylm may use: ``--gpu-memory-limit`` when it is at most
the memory free at boot, else the free memory itself. ``reserve`` scales with ``usable``, never with the card: under
the limit ``max(512 MiB, 5% of the limit)``, else ``max(512 MiB, (1 - memory_ratio) x free)``; ``--memory-reserve``
raises it (the larger of the two is the one cut). It is never handed out: the room of the OOM guard, allocator
fragmentation and the driver. A plan that cannot work raises :class:`MemoryPlanError` naming the numbers, the other
processes holding device memory (when nvidia-ml-py sees them) and the flag to change; it never suggests raising
``--memory-ratio`` when the memory is held by someone else.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrylm.errors import FerryError
from ferrylm.memory.probe import GiB, MiB, ProcessUsage


class MemoryPlanError(FerryError):
    """The memory plan cannot work on this device with these flags (a boot error; the message has the numbers
    and the flag to change)."""

    code = "insufficient_memory"


RESERVE_FLOOR = GiB // 2


def default_reserve(free_bytes: int, memory_ratio: float = 0.9) -> int:
    """Without a limit: ``max(512 MiB, (1 - memory_ratio) x free)`` bytes (the ratio is the reserve's share of the
    memory free at boot, not a second cut)."""
    return max(RESERVE_FLOOR, round((1.0 - memory_ratio) * free_bytes))


def gib(n: float) -> str:
    """``n`` bytes as ``"1.23 GiB"`` (or MiB below 1 GiB)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class MemoryBudget:
    """What the plan may hand out, known before the weights load: the reading (``kind`` ``"cuda"`` or ``"host"``,
    ``total_bytes``, ``free_at_boot_bytes``), the flags that cut it (``memory_ratio``, ``gpu_memory_limit_bytes``,
    ``memory_reserve_bytes``: bytes or None) and the other processes holding device memory (for messages)."""

    kind: str
    total_bytes: int
    free_at_boot_bytes: int
    memory_ratio: float
    gpu_memory_limit_bytes: int | None
    memory_reserve_bytes: int | None
    other_processes: tuple[ProcessUsage, ...] = ()


def check_host_fits(need_bytes: int, available_bytes: int, total_bytes: int, what: str) -> None:
    """Before loading: refuse a model whose host-resident part (all weights on a CPU host; the routed experts'
    host banks on a GPU host with an offloading backend) is larger than the host's available memory, with both
    sizes.

    Raises:
        MemoryPlanError: ``need_bytes`` > ``available_bytes``.
    """
    if need_bytes > available_bytes:
        raise MemoryPlanError(
            f"the model does not fit in host memory: {what} need {gib(need_bytes)}, and the host has "
            f"{gib(available_bytes)} available ({gib(total_bytes)} total). To fix: use a smaller model (a synthetic "
            f"preset takes :layers=N or :quant=int4), a GPU with --moe-backend resident, or a host with more memory.")


def limit_reserve(limit_bytes: int) -> int:
    """Under ``--gpu-memory-limit`` (the allocator is capped at the limit): ``max(512 MiB, 5% of the limit)`` bytes
    kept out of the plan, for what the plan cannot see (allocator fragmentation, the lazily allocated piecewise graph
    buffers): a plan that hands out the whole limit fails its own warmup."""
    return max(GiB // 2, limit_bytes // 20)


def budget_cut(p: MemoryBudget) -> tuple[int, int, str, str]:
    """``(reserve, budget, binding, reserve_note)``: one cut of what ferrylm may use (module docstring)."""
    limit = p.gpu_memory_limit_bytes
    explicit = p.memory_reserve_bytes
    if limit is not None and limit <= p.free_at_boot_bytes:
        scaled, why = limit_reserve(limit), "max(512 MiB, 5% of --gpu-memory-limit)"
        usable, binding = limit, "limit"
    else:
        scaled = default_reserve(p.free_at_boot_bytes, p.memory_ratio)
        why = f"max(512 MiB, (1 - --memory-ratio {p.memory_ratio:g}) x free at boot)"
        usable, binding = p.free_at_boot_bytes, "free at boot - reserve"
    if explicit is not None and (explicit >= scaled or binding == "limit"):
        scaled, why = explicit, "--memory-reserve"
    return scaled, usable - scaled, binding, why


def check_budget(b: MemoryBudget) -> None:
    """Before the weights load: fail at once when the reading leaves no budget at all.

    Raises:
        MemoryPlanError: ``free_at_boot * memory_ratio - reserve`` (or the limit) is not positive.
    """
    reserve, budget, binding, _ = budget_cut(b)
    if budget <= 0:
        PlanExplainer(b, reserve, budget, binding).fail("nothing is left for the weights")


class PlanExplainer:
    """Builds the boot error: the shortfall, the budget's derivation, who holds the memory, what to change."""

    def __init__(self, p: MemoryBudget, reserve: int, budget: int, binding: str, minimum: int = 0):
        self.p, self.reserve, self.budget, self.binding, self.minimum = p, reserve, budget, binding, minimum

    def fail(self, what: str, *, left: str = "", smaller: str = "") -> None:
        """Raise the :class:`MemoryPlanError`: ``what`` did not fit, ``left`` (what was left for it, if said),
        the budget's derivation, who holds the memory, the fixes (``smaller``: flags that shrink the need)."""
        p = self.p
        dev = "GPU" if p.kind == "cuda" else "host"
        held = p.total_bytes - p.free_at_boot_bytes
        parts = [f"memory plan does not fit: {what}"]
        if left:
            parts.append(left)
        budget_why = (f"budget {gib(self.budget)} = {gib(p.free_at_boot_bytes)} free at boot of "
                      f"{gib(p.total_bytes)} {dev} total - reserve {gib(self.reserve)} (--memory-ratio "
                      f"{p.memory_ratio:g} / --memory-reserve)")
        if self.binding == "limit":
            budget_why = (f"budget {gib(self.budget)} = --gpu-memory-limit {gib(p.gpu_memory_limit_bytes)} - reserve "
                          f"{gib(self.reserve)}")
        parts.append(budget_why)
        if self.minimum:
            parts.append(f"this configuration needs a budget of at least {gib(self.minimum)} (weights + workspace + "
                         f"KV floor + one decode step's expert slots), {gib(self.minimum + self.reserve)} free with "
                         f"the reserve")
        others_hold = p.kind == "cuda" and (bool(p.other_processes) or held > max(GiB, p.total_bytes // 10))
        fixes: list[str] = []
        if others_hold:
            who = "; ".join(u.describe() for u in p.other_processes[:5]) or "processes nvidia-ml-py cannot list"
            parts.append(f"{gib(held)} of the {dev} is held by others ({who})")
            fixes.append("free that memory (stop those processes) or use another GPU")
        elif p.kind == "host":
            parts.append(f"{gib(held)} of host memory is in use by others")
            fixes.append("free host memory")
        if self.binding == "limit":
            fixes.append("raise --gpu-memory-limit")
        elif not others_hold and p.memory_ratio < 0.98:
            fixes.append(f"raise --memory-ratio (now {p.memory_ratio:g})")
        if self.reserve > GiB:
            fixes.append(f"lower --memory-reserve (now {gib(self.reserve)})")
        if smaller:
            fixes.append(f"lower {smaller}")
        raise MemoryPlanError("; ".join(parts) + ". To fix: " + ", or ".join(fixes) + ".")
