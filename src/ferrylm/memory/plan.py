"""The memory plan: how much of the device this engine may use, and how it is split.

Figures (bytes unless named otherwise), in the order the plan takes them:

1. ``free_at_boot`` and ``total`` of the device (CUDA driver figures, or host RAM on the CPU), read before the
   weights load; ``others`` = ``total - free_at_boot`` is memory someone else (or the CUDA context) holds.
2. ``budget = usable - reserve``, one cut (``memory/budget.py``: the limit or the free memory, less a reserve
   that scales with it and is never handed out).
3. minus ``weights`` (measured after loading), the recurrent-state pool of a hybrid model (``state_slot_bytes`` per
   slot, ``max_running_requests + 1`` slots: one per running request and a scratch slot, ``engine/cache/state_pool.py``)
   and ``workspace`` (the peak extra memory of a warmup prefill at the
   maximum chunk and a decode step at the maximum batch; measured on CUDA, estimated on the CPU) leaves ``R``.
4. ``R`` is split between the KV pool (pages of ``page_size`` tokens) and expert slots (offloading backends):
   explicit ``--num-pages`` / ``--num-tokens`` / ``--moe-cache-size`` always win, and one that does not fit is a
   boot error with the numbers. Otherwise, with an expert cache, the KV pool gets its floor and expert slots the
   rest (and what all experts do not need goes back to the KV pool). The floor is ``--kv-reserve-tokens``, or by
   default the model context when the slots left after it are at least a tenth of all experts (and the backend's
   minimum), else one full prefill chunk plus ``max_running_requests`` short requests of ``SHORT_REQUEST_TOKENS``.
   Without an expert cache (resident, dense) the KV pool takes what it can use (``max_running_requests *
   max_model_len`` tokens at most). The KV pool must hold at least ``--kv-reserve-tokens`` tokens (default
   ``min(max_model_len, 512)``), else the boot fails. Expert slots are never fewer than the backend's
   ``min_slots`` (the engine sets it to what one layer of a full decode step can need: ``min(R * k, E)``).
5. ``headroom`` = budget - weights - workspace - KV - experts (never negative).

With default flags the plan takes the largest configuration that fits and gives way down to its minimum: the
weights, the workspace of the chunk measured (the boot lowers a default chunk that does not fit, to 1024 tokens),
the KV floor and the expert slots one decode step needs (the KV pool gives way to them). A plan that cannot work
raises :class:`~ferrylm.memory.budget.MemoryPlanError` naming the numbers and that minimum in GiB.

Pure: :func:`plan_memory` takes readings as data, so tests feed it fake figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ferrylm.experts.executor import ExpertNeeds
from ferrylm.memory.budget import MemoryBudget, MemoryPlanError, PlanExplainer, budget_cut, gib
from ferrylm.memory.probe import ProcessUsage

DEFAULT_MIN_KV_TOKENS = 512
SHORT_REQUEST_TOKENS = 256  # tokens per running request in the default KV floor beside one full prefill chunk


@dataclass(frozen=True)
class PlanInputs:
    """Everything :func:`plan_memory` needs (bytes, tokens, requests).

    Attributes:
        budget: what the plan may hand out (``memory/budget.py``: the reading before loading, ``--memory-ratio``,
            ``--gpu-memory-limit``, ``--memory-reserve``, the other processes holding device memory).
        weights_bytes: model weights on the device (experts included for the resident backend).
        workspace_bytes: peak extra memory of a forward at the max chunk / max batch; ``workspace_source``
            ``"measured"`` or ``"estimated"``.
        kv_bytes_per_token: K+V bytes of one token over all layers, at least 1 (a model whose layers are all linear
            attention stores none). page_size: tokens per page.
        max_model_len, max_running_requests, max_prefill_length: the engine's limits (tokens, requests, tokens).
        num_pages, num_tokens: explicit KV pool size (pages win) or None.
        moe_cache_size: explicit expert slots or None. moe_cache_auto: the rest goes to expert slots.
        kv_reserve_tokens: KV floor (tokens) or None.
        experts: the slot cache's needs, or None (no slot cache).
        host_kv_fraction: on the host, the automatic KV pool takes at most this share of free memory (host RAM
            is shared with everything else); None on CUDA.
        graph_bytes: the decode CUDA graphs' private memory pool, measured by capturing them during the boot
            warmup (they stay allocated while the engine runs).
        state_slot_bytes: one request's recurrent state over the linear-attention layers (hybrid models,
            ``engine/cache/state_pool.StateLayout.bytes_per_slot``; 0 for others).
        state_snapshots: recurrent-state snapshots kept for prefix caching (``engine/cache/state_snapshots.py``), each
            ``state_slot_bytes``.
        allocator_slack_bytes: device memory the CUDA allocator holds in segments it cannot give back (reserved,
            not allocated: fragments between live tensors), measured; the cap counts it, the rows above do not.
    """

    budget: MemoryBudget
    weights_bytes: int
    workspace_bytes: int
    workspace_source: str
    kv_bytes_per_token: int
    page_size: int
    max_model_len: int
    max_running_requests: int
    max_prefill_length: int
    num_pages: int | None = None
    num_tokens: int | None = None
    moe_cache_size: int | None = None
    moe_cache_auto: bool = False
    kv_reserve_tokens: int | None = None
    experts: ExpertNeeds | None = None
    host_kv_fraction: float | None = None
    graph_bytes: int = 0
    state_slot_bytes: int = 0
    state_snapshots: int = 0
    allocator_slack_bytes: int = 0

    @property
    def state_slots(self) -> int:
        """Slots of the recurrent-state pool (one per running request plus the scratch slot) and the prefix
        cache's snapshots (0 without state)."""
        return self.max_running_requests + 1 + self.state_snapshots if self.state_slot_bytes else 0

    @property
    def state_bytes(self) -> int:
        return self.state_slots * self.state_slot_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """The plan (bytes, pages, tokens, slots). ``binding``: what set the budget (``"limit"`` for
    ``--gpu-memory-limit``, else the free-memory formula); ``warnings``: things the operator should know (logged
    at boot)."""

    kind: str
    total_bytes: int
    free_at_boot_bytes: int
    memory_ratio: float
    gpu_memory_limit_bytes: int | None
    reserve_bytes: int
    budget_bytes: int
    weights_bytes: int
    workspace_bytes: int
    workspace_source: str
    kv_pages: int
    page_size: int
    kv_tokens: int
    kv_bytes: int
    kv_bytes_per_token: int
    expert_slots: int
    expert_slot_bytes: int
    expert_bytes: int
    expert_total: int
    headroom_bytes: int
    max_model_len: int
    binding: str
    other_processes: tuple[ProcessUsage, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    graph_bytes: int = 0
    max_prefill_length: int = 0
    prefill_note: str = ""
    reserve_note: str = ""   # where the reserve comes from (the plan table's right column)
    minimum_bytes: int = 0   # the budget this model needs at the least (weights, workspace, KV floor, step slots)
    state_slots: int = 0     # recurrent-state slots of a hybrid model (max running + scratch + prefix snapshots)
    state_snapshots: int = 0
    state_slot_bytes: int = 0
    state_bytes: int = 0
    max_running_requests: int = 0   # requests decoded together: the flag, or what the plan carries (concurrency.py)
    running_note: str = ""          # where it comes from (the plan table's right column)
    graph_max_batch: int = 0        # the largest decode batch whose CUDA graph the plan's graph memory was measured at
    allocator_slack_bytes: int = 0  # reserved by the CUDA allocator, not allocated (PlanInputs.allocator_slack_bytes)
    slack_note: str = ""            # how the slack was measured (the plan table's right column)
    mapped_bytes: int = 0           # weights read in place from the checkpoint's files (page cache, not counted)

    def to_dict(self) -> dict:
        """JSON-ready (``GET /v1/memory``)."""
        d = asdict(self)
        d["other_processes"] = [asdict(p) for p in self.other_processes]
        d["warnings"] = list(self.warnings)
        return d

    def format_table(self) -> str:
        """The plan as an aligned text table (logged at boot)."""
        dev = "device" if self.kind == "cuda" else "host"
        held = self.total_bytes - self.free_at_boot_bytes
        limit = self.gpu_memory_limit_bytes
        rows = [
            (f"{dev} total", gib(self.total_bytes), "CUDA driver" if self.kind == "cuda" else "host RAM (psutil)"),
            ("free at boot", gib(self.free_at_boot_bytes),
             f"measured before loading; {gib(held)} held by others" if self.kind == "cuda"
             else "measured before loading"),
            ("memory ratio / limit", f"{self.memory_ratio:g}",
             "no --gpu-memory-limit" if limit is None else f"--gpu-memory-limit {gib(limit)}"
             + (" (above the free memory: the free memory binds)" if self.binding != "limit" else "")),
            ("reserve (never handed out)", gib(self.reserve_bytes), self.reserve_note),
            ("budget", gib(self.budget_bytes),
             "--gpu-memory-limit - reserve" if self.binding == "limit" else "free at boot - reserve"),
            ("weights", gib(self.weights_bytes), "measured after loading" + (
                f"; {gib(self.mapped_bytes)} more read in place from the file (page cache, not counted)"
                if self.mapped_bytes else "")),
            ("workspace", gib(self.workspace_bytes), f"{self.workspace_source} at the prefill chunk"),
            ("CUDA graphs", gib(self.graph_bytes),
             f"measured at capture, decode batches up to {self.graph_max_batch}" if self.graph_bytes else "none"),
            ("recurrent state", gib(self.state_bytes),
             f"{self.state_slots} x {gib(self.state_slot_bytes)} (linear-attention layers; one per running request "
             f"+ scratch{f' + {self.state_snapshots} prefix-cache snapshots' if self.state_snapshots else ''})"
             if self.state_slots else "none (no linear-attention layers)"),
            ("allocator slack", gib(self.allocator_slack_bytes),
             self.slack_note or "measured after the warmup: reserved by the CUDA allocator, not allocated"),
            ("prefill chunk", f"{self.max_prefill_length} tok", self.prefill_note or "the default or the flag"),
            ("KV pool", gib(self.kv_bytes), f"{self.kv_pages} pages x {self.page_size} = {self.kv_tokens} tokens"),
            ("max running requests", f"{self.max_running_requests}", self.running_note or "--max-running-requests"),
            ("expert slots", gib(self.expert_bytes),
             f"{self.expert_slots} of {self.expert_total} x {gib(self.expert_slot_bytes)}" if self.expert_total
             else "none (experts resident or dense model)"),
            ("headroom", gib(self.headroom_bytes), "budget - the rows above"),
            ("minimum", gib(self.minimum_bytes), "weights + workspace + KV floor + one decode step's expert slots"),
        ]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        return "\n".join(f"  {a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows)


def _pages(tokens: int, page_size: int) -> int:
    return max(0, tokens // page_size)


def _round_up(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


def _kv_floor(p: PlanInputs) -> int:
    """The KV pool's least size, tokens: ``--kv-reserve-tokens`` or ``min(max_model_len, 512)``, whole pages."""
    floor = p.kv_reserve_tokens if p.kv_reserve_tokens is not None else min(p.max_model_len, DEFAULT_MIN_KV_TOKENS)
    return _round_up(floor, p.page_size)


def _explicit_kv(p: PlanInputs) -> int | None:
    """``--num-pages`` / ``--num-tokens`` as tokens of whole pages (pages win), or None."""
    if p.num_pages is not None:
        return p.num_pages * p.page_size
    return _round_up(p.num_tokens, p.page_size) if p.num_tokens is not None else None


def short_pool_warning(pool_tokens: int, max_model_len: int) -> str | None:
    """What a KV pool shorter than the context does to requests (``engine/admission.py``), or None when it holds
    the context."""
    if pool_tokens >= max_model_len:
        return None
    return (f"the KV pool holds {pool_tokens} tokens, fewer than the model context of {max_model_len} tokens: a "
            f"prompt of {pool_tokens} tokens or more is rejected, and a request that outgrows the pool ends there "
            f"with finish_reason length (raise --num-tokens / --num-pages or lower --max-model-len)")


def plan_memory(p: PlanInputs) -> MemoryPlan:
    """Size the KV pool and the expert slots (see the module docstring).

    Raises:
        MemoryPlanError: the weights, workspace or an explicit size do not fit, or the KV pool would be smaller
            than its floor. The message gives the figures and the flag to change.
    """
    reserve, budget, binding, reserve_note = budget_cut(p.budget)
    minimum = minimum_bytes(p)
    sz = _Sizer(p, PlanExplainer(p.budget, reserve, budget, binding, minimum), budget)
    kv_tokens = sz.kv_explicit if sz.kv_explicit is not None else sz.default_kv_tokens()
    kv_tokens, slots = sz.expert_slots(kv_tokens)
    ex = p.experts
    expert_bytes = ex.bytes_for(slots) if ex is not None else 0
    kv_bytes = kv_tokens * p.kv_bytes_per_token
    warnings = [w for w in (short_pool_warning(kv_tokens, p.max_model_len),) if w]
    b = p.budget
    return MemoryPlan(
        kind=b.kind, total_bytes=b.total_bytes, free_at_boot_bytes=b.free_at_boot_bytes,
        memory_ratio=b.memory_ratio, gpu_memory_limit_bytes=b.gpu_memory_limit_bytes, reserve_bytes=reserve,
        budget_bytes=budget, weights_bytes=p.weights_bytes, workspace_bytes=p.workspace_bytes,
        workspace_source=p.workspace_source, kv_pages=kv_tokens // p.page_size, page_size=p.page_size,
        kv_tokens=kv_tokens, kv_bytes=kv_bytes, kv_bytes_per_token=p.kv_bytes_per_token, expert_slots=slots,
        expert_slot_bytes=ex.slot_bytes if ex else 0, expert_bytes=expert_bytes,
        expert_total=ex.total_experts if ex else 0, headroom_bytes=max(0, sz.rest - kv_bytes - expert_bytes),
        max_model_len=p.max_model_len, binding=binding, other_processes=tuple(b.other_processes),
        warnings=tuple(warnings), graph_bytes=p.graph_bytes, max_prefill_length=p.max_prefill_length,
        reserve_note=reserve_note, minimum_bytes=minimum, state_slots=p.state_slots,
        state_slot_bytes=p.state_slot_bytes, state_bytes=p.state_bytes,
        state_snapshots=p.state_snapshots if p.state_slot_bytes else 0,
        max_running_requests=p.max_running_requests, allocator_slack_bytes=p.allocator_slack_bytes)


class _Sizer:
    """The steps of :func:`plan_memory` after the budget: ``rest`` (``R`` of the module docstring: the budget less
    the weights, workspace, graphs, recurrent state and allocator slack), the explicit sizes checked against it,
    then the KV tokens and the expert slots. Each step raises through ``err`` when it cannot fit."""

    def __init__(self, p: PlanInputs, err: PlanExplainer, budget: int) -> None:
        self.p, self.err, self.ex = p, err, p.experts
        self.rest = (budget - p.weights_bytes - p.workspace_bytes - p.graph_bytes - p.state_bytes
                     - p.allocator_slack_bytes)
        if self.rest <= 0:
            state = f", the recurrent state ({gib(p.state_bytes)})" if p.state_bytes else ""
            slack = f", the allocator's slack ({gib(p.allocator_slack_bytes)})" if p.allocator_slack_bytes else ""
            err.fail(f"the weights ({gib(p.weights_bytes)}), the workspace ({gib(p.workspace_bytes)}, "
                     f"{p.workspace_source}){state}{slack} and the CUDA graphs ({gib(p.graph_bytes)}) need "
                     f"{gib(budget - self.rest)}",
                     smaller="--max-prefill-length / --max-running-requests (workspace, recurrent state), "
                             "--moe-backend offload (experts off the device)")
        self.min_kv = _kv_floor(p)
        self.kv_explicit = _explicit_kv(p)
        ex = self.ex
        self.slots_explicit = (min(p.moe_cache_size, ex.total_experts)
                               if ex is not None and p.moe_cache_size is not None else None)
        self.min_expert_bytes = ex.bytes_for(ex.min_slots) if ex is not None else 0
        self._check_explicit()

    def _left(self) -> str:
        p = self.p
        return (f"but only {gib(max(0, self.rest))} are left after the weights ({gib(p.weights_bytes)}) and the "
                f"workspace ({gib(p.workspace_bytes)})")

    def _check_explicit(self) -> None:
        """Explicit ``--num-pages`` / ``--num-tokens`` / ``--moe-cache-size`` that do not fit ``rest`` fail."""
        ex, kv, slots, per_tok = self.ex, self.kv_explicit, self.slots_explicit, self.p.kv_bytes_per_token
        if kv is not None and kv * per_tok + (
                ex.bytes_for(slots) if slots is not None else self.min_expert_bytes) > self.rest:
            what = f"--num-pages/--num-tokens {kv} tokens need {gib(kv * per_tok)}"
            if slots is not None:
                what += f" and --moe-cache-size {slots} needs {gib(ex.bytes_for(slots))}"
            elif ex is not None:
                what += f" and the {ex.backend} backend needs at least {gib(self.min_expert_bytes)} of expert slots"
            self.err.fail(what, left=self._left(), smaller="--num-tokens / --num-pages" +
                          (" / --moe-cache-size" if slots is not None else ""))
        if slots is not None and ex.bytes_for(slots) > self.rest:
            self.err.fail(f"--moe-cache-size {slots} needs {gib(ex.bytes_for(slots))} "
                          f"({slots} x {gib(ex.slot_bytes)} + {gib(ex.fixed_bytes)} prefill buffers)",
                          left=self._left(), smaller="--moe-cache-size")

    def default_kv_tokens(self) -> int:
        """The KV pool without an explicit size: its floor beside an expert cache (:func:`kv_floor_tokens`), else
        what it can use; whole pages, never below the floor (else the boot fails)."""
        p, ex, per_tok = self.p, self.ex, self.p.kv_bytes_per_token
        expert_floor = ex.bytes_for(self.slots_explicit) if self.slots_explicit is not None else self.min_expert_bytes
        kv_room = self.rest - expert_floor
        if p.host_kv_fraction is not None:
            kv_room = min(kv_room, int(p.budget.free_at_boot_bytes * p.host_kv_fraction))
        room_tokens = max(0, kv_room // per_tok)
        if ex is not None and self.slots_explicit is None:
            kv_tokens = min(room_tokens, kv_floor_tokens(p, self.rest, self.min_kv))
        else:
            kv_tokens = min(room_tokens, max(p.max_running_requests * p.max_model_len, self.min_kv))
        kv_tokens = _pages(kv_tokens, p.page_size) * p.page_size
        if kv_tokens < self.min_kv:
            flag = "--kv-reserve-tokens" if p.kv_reserve_tokens is not None else "the default KV floor"
            self.err.fail(f"the KV pool would hold {kv_tokens} tokens ({gib(kv_tokens * per_tok)}), fewer than "
                          f"{flag} ({self.min_kv} tokens, {gib(self.min_kv * per_tok)})"
                          + (f" after {gib(expert_floor)} of expert slots" if expert_floor else ""),
                          left=self._left(),
                          smaller="--kv-reserve-tokens" + (" / --moe-cache-size" if self.slots_explicit else ""))
        return kv_tokens

    def expert_slots(self, kv_tokens: int) -> tuple[int, int]:
        """``(kv_tokens, slots)``: the expert slots after the KV pool (the default KV floor gives way to one
        decode step's slots; what all experts leave goes back to the KV pool). Fails below the step's slots."""
        p, ex, per_tok, ps = self.p, self.ex, self.p.kv_bytes_per_token, self.p.page_size
        if ex is None:
            return kv_tokens, 0
        rest = self.rest
        if self.slots_explicit is not None:
            slots = self.slots_explicit
        else:
            slots = min(ex.total_experts, max(0, (rest - kv_tokens * per_tok - ex.fixed_bytes) // ex.slot_bytes))
            need = min(ex.total_experts, max(ex.min_slots, ex.step_slots))
            if slots < need and self.kv_explicit is None and p.kv_reserve_tokens is None:
                # the default KV floor gives way to the slots one decode step needs, down to its minimum
                kv_tokens = max(self.min_kv, _pages(min(kv_tokens, (rest - ex.bytes_for(need)) // per_tok), ps) * ps)
                slots = min(ex.total_experts, max(0, (rest - kv_tokens * per_tok - ex.fixed_bytes) // ex.slot_bytes))
            if slots < need:
                self.err.fail(f"the {ex.backend} backend needs >= {need} expert slot(s) of "
                              f"{gib(ex.slot_bytes)} + {gib(ex.fixed_bytes)} prefill buffers after a KV pool of "
                              f"{kv_tokens} tokens ({gib(kv_tokens * per_tok)})", left=self._left(),
                              smaller="--num-tokens / --kv-reserve-tokens")
        if self.kv_explicit is None and slots == ex.total_experts:
            # every expert fits: what they leave goes back to the KV pool (up to what it can use)
            room_tokens = (rest - ex.bytes_for(slots)) // per_tok
            if p.host_kv_fraction is not None:
                room_tokens = min(room_tokens, int(p.budget.free_at_boot_bytes * p.host_kv_fraction) // per_tok)
            kv_tokens = max(kv_tokens, _pages(min(room_tokens, p.max_running_requests * p.max_model_len), ps) * ps)
        return kv_tokens, slots


def minimum_bytes(p: PlanInputs) -> int:
    """The least budget this configuration can serve in: the weights, the workspace measured (at the chunk the
    inputs name), the CUDA graphs, the KV floor and, with an expert cache, the slots of one decode step (or the
    explicit sizes)."""
    kv = _explicit_kv(p)
    kv = kv if kv is not None else _kv_floor(p)
    ex = p.experts
    slots = 0
    if ex is not None:
        slots = (min(p.moe_cache_size, ex.total_experts) if p.moe_cache_size is not None
                 else min(ex.total_experts, max(ex.min_slots, ex.step_slots)))
    return (p.weights_bytes + p.workspace_bytes + p.graph_bytes + p.state_bytes + p.allocator_slack_bytes
            + kv * p.kv_bytes_per_token + (ex.bytes_for(slots) if ex is not None else 0))


def kv_floor_tokens(p: PlanInputs, rest: int, min_kv: int) -> int:
    """The KV pool's share when an expert cache takes the rest (module docstring, step 4), in tokens: the explicit
    ``--kv-reserve-tokens``; else the model context if the slots left after it (``rest`` bytes less its KV and the
    prefill buffers) are at least a tenth of all experts and the backend's minimum; else one full chunk plus
    ``max_running_requests`` short requests. Never below ``min_kv``."""
    if p.kv_reserve_tokens is not None:
        return max(p.kv_reserve_tokens, min_kv)
    ex = p.experts
    want = p.max_running_requests * p.max_model_len
    short = max(min_kv, min(want, p.max_prefill_length + p.max_running_requests * SHORT_REQUEST_TOKENS))
    context = max(short, p.max_model_len)
    slots_left = (rest - context * p.kv_bytes_per_token - ex.fixed_bytes) // max(1, ex.slot_bytes)
    return context if slots_left >= max(ex.min_slots, ex.total_experts // 10) else short


def boot_failure(p: MemoryBudget | PlanInputs, what: str, smaller: str = "") -> MemoryPlanError:
    """The boot error for a failure outside :func:`plan_memory`: ``what`` happened, the budget's derivation, who
    holds the memory, what to change (with complete inputs: the least budget this configuration needs too)."""
    b = p.budget if isinstance(p, PlanInputs) else p
    reserve, budget, binding, _ = budget_cut(b)
    minimum = minimum_bytes(p) if isinstance(p, PlanInputs) else 0
    try:
        PlanExplainer(b, reserve, budget, binding, minimum).fail(what, smaller=smaller)
    except MemoryPlanError as e:
        return e
    raise AssertionError("unreachable")
