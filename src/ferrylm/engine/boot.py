"""Boot: a model folder and an EngineConfig in, a sized :class:`Engine` out, as one pipeline:

probe (device, dtype, the memory budget) -> the model's config (read once) -> the expert backend (the one
``auto`` resolver, ``engine/expert_choice.py``) -> load the weights (measured) -> profile the workspace on a model
runner (``engine/profile.py``) -> the memory plan from complete inputs (``memory/plan.py``; a default prefill
chunk that does not fit is halved down to ``MIN_PREFILL_CHUNK``; without ``--max-running-requests`` the number the
plan carries, ``memory/concurrency.py``) -> the Engine from its parts -> on CUDA the
warmup again (the allocator keeps the workspace blocks) and the graph capture.

A tensor-parallel follower (``engine/parallel/follower_runner.py``) runs the same steps up to loading.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ferrylm.checkpoints.assemble import LoadedModel
from ferrylm.checkpoints.loader import load_model
from ferrylm.engine.ple_choice import resolve_ple_backend
from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.cache.kv_pool import KVLayout
from ferrylm.engine.cache.state_pool import StateLayout
from ferrylm.engine.engine import (Engine, EngineLimits, limits_with_pages, resolve_device, resolve_dtype,
                                   state_snapshot_count)
from ferrylm.engine.expert_choice import check_host_memory, resolve_expert_backend
from ferrylm.engine.profile import WarmupShape, Workspace, profile_workspace, warm_up
from ferrylm.experts import ExpertOptions, backend_name
from ferrylm.experts.executor import ExpertNeeds
from ferrylm.faults import FaultInjector
from ferrylm.memory.concurrency import RunningChoice, choose_running_requests, requests_in_pool
from ferrylm.memory.guard import is_oom
from ferrylm.memory.budget import MemoryBudget, MemoryPlanError, check_budget, gib
from ferrylm.memory.plan import MemoryPlan, PlanInputs, boot_failure, plan_memory, short_pool_warning
from ferrylm.memory.probe import allocator_slack, bytes_in_use, mapped_file_bytes, other_processes, read_memory
from ferrylm.models.tensor_parallel import TPShard, attach_reduce
from ferrylm.synthetic.spec import is_synthetic_folder

log = logging.getLogger("ferrylm.engine")

MIN_PREFILL_CHUNK = 1024  # tokens: the plan lowers a default chunk that does not fit down to this, no further
PHASES = ("reading weights", "warming up", "capturing graphs")   # the boot's phases, as the frontend shows them


@dataclass(frozen=True)
class Sizing:
    """The plan's outcome: the ``plan``, the engine's ``limits`` at its sizes, the ``workspace`` profiled and the
    ``inputs`` it was planned from."""

    plan: MemoryPlan
    limits: EngineLimits
    workspace: Workspace
    inputs: PlanInputs


@dataclass(frozen=True)
class BootTarget:
    """Where and how the model runs: ``device``, ``dtype`` and the config (``--gpu-memory-limit`` dropped on a host
    without a GPU)."""

    device: torch.device
    dtype: torch.dtype
    config: EngineConfig


def build_engine(model_path: str | Path, config: EngineConfig, tp=None,
                 on_phase: Callable[[str], None] | None = None) -> Engine:
    """Load the model at ``model_path`` and size the engine with the memory plan (module docstring); the plan is
    logged as a table and kept on the engine (``engine.memory_plan``).

    ``tp``: rank 0's :class:`~ferrylm.engine.parallel.step_sync.StepBroadcaster` under ``--tensor-parallel-size
    N > 1``: the model is rank 0's shard and every forward of the boot is broadcast to the followers.
    ``on_phase``: called with each phase's name as it starts (``PHASES``; the engine process forwards them to the
    frontend, which shows them while the model loads).

    Raises:
        ModelLoadError / UnsupportedArchitecture: the folder cannot be served.
        ValueError: a config value is out of range (message names the flag).
        MemoryPlanError: the plan does not fit (message: the figures, who holds the memory, the flag to change).
    """
    config.validate()
    if config.tensor_parallel_size > 1 and tp is None:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} runs one engine process per rank: "
                         f"use `ferry serve` (the offline engine is one process)")
    group = tp.group if tp is not None else None
    target = resolve_target(model_path, config, group.device if group is not None else resolve_device(config.device))
    budget = probe_budget(target)
    mcfg = ModelConfig.from_folder(model_path)
    target = replace(target, config=fit_page_size(target.config, mcfg))
    options = resolve_expert_backend(mcfg, target.config, target.device, target.dtype)
    check_host_memory(mcfg, target.device, target.dtype, backend_name(options))
    ple = resolve_ple_backend(mcfg, target.config, target.device, target.dtype)
    phase = on_phase or (lambda name: None)
    phase(PHASES[0])
    loaded, weights = load_weights(model_path, target, options, group.shard if group is not None else None, budget,
                                   ple_backend=ple.backend if ple is not None else "gpu")
    if group is not None:
        attach_reduce(loaded.model, group.all_reduce)
    phase(PHASES[1])
    sized = plan_engine(loaded, target, budget, weights, tp)
    if target.device.type == "cpu":
        sized = replace(sized, plan=replace(sized.plan, mapped_bytes=mapped_file_bytes(model_path)))
    faults = FaultInjector.from_config(target.config.faults)
    if target.device.type == "cuda":
        phase(PHASES[2])
    engine = place_engine(loaded, target, sized, tp,
                          lambda s: Engine(loaded.model, loaded.config, target.config, device=target.device,
                                           dtype=target.dtype, limits=s.limits, expert_executor=loaded.executor,
                                           faults=faults, memory_plan=s.plan, tokenizer_path=str(model_path),
                                           model_id=str(model_path), tp=tp))
    _log_ready(engine, engine.memory_plan, options, faults)
    return engine


def resolve_target(model_path: str | Path, config: EngineConfig, device: torch.device) -> BootTarget:
    """The dtype (``auto``: float32 on the CPU, bfloat16 on CUDA and for a synthetic model, which is built in it)
    and the config this device honours; caps the CUDA allocator at ``--gpu-memory-limit``."""
    dtype = resolve_dtype(config.dtype, device)
    if config.dtype == "auto" and is_synthetic_folder(model_path):  # load_model builds it; bf16 halves its bytes
        dtype = torch.bfloat16
        if device.type == "cpu" and cpu_has_native_bf16() is False:
            log.warning("--dtype auto: a synthetic model is built in bfloat16, and this CPU has no bfloat16 "
                        "instructions (avx512_bf16 / amx_bf16): its matmuls run several times slower than in float32 "
                        "(a long prefill chunk can take minutes); --dtype float32 if host memory holds twice the "
                        "weights")
    if device.type != "cuda" and config.gpu_memory_limit is not None:
        log.warning("--gpu-memory-limit %g GiB is ignored: there is no GPU (device %s); the memory plan uses host "
                    "memory", config.gpu_memory_limit, device)
        config = replace(config, gpu_memory_limit=None)
    apply_memory_limit(device, config.gpu_memory_limit)
    return BootTarget(device, dtype, config)


def fit_page_size(config: EngineConfig, mcfg: ModelConfig) -> EngineConfig:
    """``config`` with its page size raised to the model's next multiple where the model's per-block caches need
    whole blocks per page (DeepSeek-V4's compression rate of 128: ``KVLayout.align``); logged when it changes."""
    align = math.lcm(*(b.rate for b in KVLayout.of(mcfg).blocks), 1)
    if config.page_size % align == 0:
        return config
    page = math.lcm(config.page_size, align)
    log.warning("--page-size %d raised to %d: this model's compressed KV blocks of %d tokens must fill whole pages",
                config.page_size, page, align)
    return replace(config, page_size=page)


def probe_budget(target: BootTarget) -> MemoryBudget:
    """Read the device's memory and who else holds it; fail now when nothing is left for the weights.

    Raises:
        MemoryPlanError: the reading leaves no budget.
    """
    reading, config = read_memory(target.device), target.config
    budget = MemoryBudget(kind=reading.kind, total_bytes=reading.total_bytes, free_at_boot_bytes=reading.free_bytes,
                          memory_ratio=config.memory_ratio, gpu_memory_limit_bytes=_gib(config.gpu_memory_limit),
                          memory_reserve_bytes=_gib(config.memory_reserve),
                          other_processes=tuple(other_processes(target.device)))
    check_budget(budget)
    return budget


def load_weights(model_path: str | Path, target: BootTarget, options: ExpertOptions, shard: TPShard | None,
                 budget: MemoryBudget | None = None, ple_backend: str = "gpu") -> tuple[LoadedModel, int]:
    """Load the model (this rank's shard) and return it with the device bytes its weights took (``ple_backend``:
    the resolved placement of per-layer embedding tables, ``engine/ple_choice.py``).

    Raises:
        MemoryPlanError: loading ran out of memory (with ``budget``: its derivation and what to change).
    """
    in_use = bytes_in_use(target.device)
    torch.manual_seed(target.config.seed)
    try:
        loaded = load_model(model_path, device=target.device, dtype=target.dtype, moe_backend=options, tp=shard,
                            ple_backend=ple_backend)
    except Exception as e:
        if not is_oom(e) or budget is None:
            raise
        what = f"loading the weights ran out of memory ({str(e).splitlines()[0][:200]})"
        del e
        raise boot_failure(budget, what, smaller="the model size: --moe-backend offload keeps the experts off "
                                                 "the device") from None
    return loaded, max(0, bytes_in_use(target.device) - in_use)


def plan_engine(loaded: LoadedModel, target: BootTarget, budget: MemoryBudget, weights: int,
                tp=None) -> Sizing:
    """Profile the workspace and plan; when the plan does not fit and the chunk is the default (no
    ``--max-prefill-length``), halve the chunk and profile again, down to ``MIN_PREFILL_CHUNK``. Without
    ``--max-running-requests`` the number is the plan's (``memory/concurrency.py``): a preflight without workspace
    bounds it, the warmup (decode batch, CUDA graphs, state slots) runs at that bound, and the plan with the
    measured workspace picks it within. Sizes the expert cache to the plan. The plan's table says when the chunk
    was lowered and where the number of running requests comes from.

    Raises:
        MemoryPlanError: the plan does not fit at the floor (or at the explicit chunk).
    """
    config, mcfg, executor = target.config, loaded.config, loaded.executor
    base = limits_with_pages(config, mcfg, target.device, 0, config.max_running_requests or 1)
    needs = executor.slot_needs() if executor is not None else None
    first = base.max_prefill_length
    floor = first if config.max_prefill_length is not None else min(first, MIN_PREFILL_CHUNK)

    def inputs_at(chunk: int, workspace: Workspace | None, slack: int = 0) -> Callable[[int], PlanInputs]:
        return lambda n: replace(plan_inputs(budget, target, mcfg, replace(base, max_prefill_length=chunk,
                                                                           max_running_requests=n),
                                             needs, weights, workspace), allocator_slack_bytes=slack)

    # preflight: sizes that cannot fit even without a workspace, at the smallest chunk, fail before the warmup
    plan_memory(inputs_at(floor, None)(base.max_running_requests))
    bound = config.max_running_requests or choose_running_requests(inputs_at(first, None)).n
    if needs is not None:  # the warmup's expert cache: the explicit size, else the backend's minimum
        _reserve_experts(executor, tp, needs.bytes_for(min(config.moe_cache_size, needs.total_experts)
                                                       if config.moe_cache_size is not None
                                                       else max(1, needs.min_slots)))
    chunk = first
    while True:
        shape = WarmupShape(chunk, bound, base.max_model_len, bound)
        try:
            workspace = profile_workspace(loaded.model, executor, mcfg, config, target.device, target.dtype, shape,
                                          weights, tp)
            slack = allocator_slack(target.device)
            choice = (RunningChoice(config.max_running_requests, "--max-running-requests") if config.max_running_requests
                      else choose_running_requests(inputs_at(chunk, workspace, slack), bound))
            inputs = inputs_at(chunk, workspace, slack)(choice.n)
            plan = plan_memory(inputs)
            break
        except MemoryPlanError as e:
            if chunk <= floor:
                raise
            lower = max(floor, chunk // 2)
            log.warning("memory plan: a prefill chunk of %d tokens does not fit (%s); trying %d tokens", chunk,
                        str(e).split(". To fix")[0][:300], lower)
            chunk = lower
    plan = replace(plan, running_note=choice.note,
                   graph_max_batch=(config.cuda_graph_max_batch or bound) if workspace.graph_bytes else 0)
    if chunk < first:
        plan = replace(plan, prefill_note=f"lowered from {first}: the default chunk did not fit")
        log.warning("memory plan: prefill chunk lowered from %d to %d tokens to fit (set --max-prefill-length to "
                    "choose it)", first, chunk)
    limits = replace(base, max_prefill_length=chunk, num_pages=plan.kv_pages, max_running_requests=choice.n)
    return Sizing(plan, limits, workspace, inputs)


def plan_inputs(budget: MemoryBudget, target: BootTarget, mcfg: ModelConfig, limits: EngineLimits,
                needs: ExpertNeeds | None, weights: int, workspace: Workspace | None) -> PlanInputs:
    """The plan's inputs at ``limits`` (its ``max_running_requests`` sizes the state slots and one decode step's
    expert slots): the budget, the model's figures, the weights measured and the workspace profiled (None: the
    preflight's lower bound, no workspace)."""
    config, dtype = target.config, target.dtype
    state = StateLayout.of(mcfg)   # hybrid models: one recurrent-state slot per running request
    if needs is not None and needs.backend in ("offload", "hybrid"):
        # the GPU computes every expert it routes to: a decode step of R sequences needs up to R * k of a layer at
        # once, the floor of an automatically sized cache (an explicit --moe-cache-size below it runs in waves)
        needs = replace(needs, step_slots=min(limits.max_running_requests * mcfg.num_experts_per_tok,
                                              mcfg.num_experts))
    return PlanInputs(
        budget, weights_bytes=weights, workspace_bytes=workspace.bytes if workspace else 0,
        workspace_source=workspace.source if workspace else "none (preflight)",
        graph_bytes=workspace.graph_bytes if workspace else 0,
        kv_bytes_per_token=max(1, KVLayout.of(mcfg).bytes_per_token(dtype, config.kv_cache_dtype)),
        page_size=config.page_size,
        max_model_len=limits.max_model_len, max_running_requests=limits.max_running_requests,
        max_prefill_length=limits.max_prefill_length, num_pages=config.num_pages, num_tokens=config.num_tokens,
        moe_cache_size=config.moe_cache_size, moe_cache_auto=config.moe_cache_auto,
        kv_reserve_tokens=config.kv_reserve_tokens, experts=needs,
        # CPU ranks of a tensor-parallel group share the host's memory: each rank's pool takes its share
        host_kv_fraction=(config.kv_memory_fraction / config.tensor_parallel_size
                          if target.device.type == "cpu" else None),
        state_slot_bytes=state.bytes_per_slot(dtype) if state is not None else 0,
        state_snapshots=(state_snapshot_count(limits) if state is not None and config.enable_prefix_caching
                         else 0))


#: placements tried before the boot gives up: each retry re-plans with the allocator's slack measured
PLACE_TRIES = 3


def place_engine(loaded: LoadedModel, target: BootTarget, sized: Sizing, tp,
                 make_engine: Callable[[Sizing], Engine]) -> Engine:
    """Place the plan's pools (expert slots, then the engine and its KV pool) and settle them on the device. When
    that runs out of memory (the allocator's fragments the plan could not see), everything placed is dropped and
    the plan is made again with the slack measured now, plus a twentieth of the budget each time: slots and KV
    give way, up to :data:`PLACE_TRIES` placements.

    Raises:
        MemoryPlanError: the last placement ran out of memory, or the re-plan does not fit.
    """
    device, needs = target.device, sized.inputs.experts
    for attempt in range(1, PLACE_TRIES + 1):
        engine = None
        try:
            if needs is not None:
                _reserve_experts(loaded.executor, tp, sized.plan.expert_bytes)
            engine = make_engine(sized)
            engine.progress.seed_from(sized.workspace.step_times)   # the watchdog's estimates before any request
            if device.type == "cuda":
                settle_on_device(engine)
            return engine
        except Exception as e:
            if not is_oom(e):
                raise
            msg = str(e).splitlines()[0][:200]
            del e
        if engine is not None:
            engine.runner.close()
        del engine
        plan = sized.plan
        what = (f"placing the KV pool ({plan.kv_tokens} tokens) and the expert slots ({plan.expert_slots}) then "
                f"warming up ran out of memory {attempt} time(s) ({msg})")
        slack = allocator_slack(device)
        if attempt == PLACE_TRIES:
            raise boot_failure(sized.inputs, what, smaller="--num-tokens / --moe-cache-size, or raise "
                                                          "--memory-reserve") from None
        sized = _replan(sized, slack + sized.plan.budget_bytes // 20 * attempt)
        log.warning("memory plan: %s; planned again with %s of allocator slack: %d expert slots, %d KV tokens",
                    what, gib(sized.plan.allocator_slack_bytes), sized.plan.expert_slots, sized.plan.kv_tokens)
    raise AssertionError("unreachable")


def _replan(sized: Sizing, slack: int) -> Sizing:
    """``sized`` planned again with ``slack`` bytes of allocator slack (its notes and limits carried over).

    Raises:
        MemoryPlanError: the plan does not fit with that slack.
    """
    inputs = replace(sized.inputs, allocator_slack_bytes=slack)
    old = sized.plan
    plan = replace(plan_memory(inputs), running_note=old.running_note, graph_max_batch=old.graph_max_batch,
                   prefill_note=old.prefill_note, max_prefill_length=old.max_prefill_length,
                   slack_note="measured when the placement ran out of memory, plus a margin")
    return replace(sized, plan=plan, inputs=inputs, limits=replace(sized.limits, num_pages=plan.kv_pages))


def settle_on_device(engine: Engine) -> None:
    """CUDA: the warmup again on the engine's own pools (the allocator keeps these blocks: request-time steps
    reuse them), then the graph capture at the sizes the plan counted.

    Raises:
        torch.OutOfMemoryError: the warmup ran out of memory after the pool and the slots were placed.
    """
    lim = engine.limits
    shape = WarmupShape(lim.max_prefill_length, lim.max_running_requests, lim.max_model_len,
                        lim.max_running_requests)
    warm_up(engine.runner, engine.pool, engine.state_pool, shape, engine.mcfg.vocab_size, engine.progress)
    engine.runner.capture_graphs()  # sizes the plan counted; one that runs short now is retried later


def _reserve_experts(executor, tp, nbytes: int) -> None:
    """Size the expert slot cache to ``nbytes`` (and tell the tensor-parallel followers the same budget)."""
    executor.reserve(nbytes)
    if tp is not None:
        tp.expert_budget = int(nbytes)


def _log_ready(engine: Engine, plan: MemoryPlan, options: ExpertOptions, faults: FaultInjector) -> None:
    log.info("memory plan (%s):\n%s", engine.device, plan.format_table())
    for w in plan.warnings:
        log.warning("memory plan: %s", w)
    if faults.enabled:
        log.warning("fault injection is ON: %s", faults)
    lim = engine.limits
    log.info("engine ready: device=%s dtype=%s max_model_len=%d kv_pool=%d pages x %d tokens = %d tokens (%s), "
             "max_running_requests=%d, max_prefill_length=%d, moe_backend=%s", engine.device,
             str(engine.runner.dtype).removeprefix("torch."), lim.max_model_len, lim.num_pages, lim.page_size,
             lim.pool_tokens, str(engine.pool.storage_dtype).removeprefix("torch."), lim.max_running_requests,
             lim.max_prefill_length, backend_name(options))


def engine_for_model(model, mcfg: ModelConfig, config: EngineConfig, *, device: torch.device, dtype: torch.dtype,
               **parts) -> Engine:
    """An Engine over an already-loaded model, sized without the boot's profile (tests, tools): explicit
    ``--num-pages`` / ``--num-tokens`` win; otherwise the plan over a reading taken now (the weights are already
    in it; no workspace). Without ``--max-running-requests``: the typical requests the pool holds
    (``memory/concurrency.py``). ``parts``: the other :class:`Engine` arguments.

    Raises:
        MemoryPlanError: the pool cannot get its minimum.
    """
    running = config.max_running_requests
    if config.num_pages is not None or config.num_tokens is not None:
        pages = config.num_pages or -(-config.num_tokens // config.page_size)
        base = limits_with_pages(config, mcfg, device, pages, 1)
        limits = replace(base, max_running_requests=running or requests_in_pool(base.pool_tokens, base.max_model_len))
    else:
        target = BootTarget(device, dtype, config)
        budget = probe_budget(target)
        base = limits_with_pages(config, mcfg, device, 0, running or 1)

        def inputs_at(n: int) -> PlanInputs:
            return plan_inputs(budget, target, mcfg, replace(base, max_running_requests=n), None, 0, None)

        running = running or choose_running_requests(inputs_at).n
        plan = plan_memory(inputs_at(running))
        limits = replace(base, num_pages=plan.kv_pages, max_running_requests=running)
        warning = short_pool_warning(limits.pool_tokens, limits.max_model_len)
        if warning:
            log.warning("%s", warning)
    return Engine(model, mcfg, config, device=device, dtype=dtype, limits=limits, **parts)


def apply_memory_limit(device: torch.device, gpu_memory_limit: float | None) -> None:
    """Cap this process's CUDA caching allocator at ``gpu_memory_limit`` GiB (``--gpu-memory-limit``), so a
    run measured under the cap cannot exceed it silently. No-op on the CPU or without a limit."""
    if device.type != "cuda" or gpu_memory_limit is None:
        return
    device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_memory_limit * 2**30 / total), device)


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """True when the host CPU lists ``avx512_bf16`` or ``amx_bf16`` among its flags (Linux ``/proc/cpuinfo``),
    False when it lists neither, None when that cannot be read (not Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[-1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        return None
    return None


def _gib(v: float | None) -> int | None:
    return None if v is None else int(v * (1 << 30))
