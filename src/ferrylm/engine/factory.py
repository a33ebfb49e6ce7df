"""Build an :class:`Engine` from a model folder and an EngineConfig (used by the engine process and ``LLM``)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.engine import Engine, EngineLimits, limits_with_pages, resolve_device, resolve_dtype
from ferrylm.engine.cache.kv_pool import KVLayout
from ferrylm.engine.progress import StepProgress
from ferrylm.experts import ExpertOptions, backend_name

log = logging.getLogger("ferrylm.engine")

# NOTE: device memory kept free for activations until the memory plan measures the workspace (memory-plan issue).
WORKSPACE_RESERVE = 1 << 30


def expert_options(config: EngineConfig) -> ExpertOptions:
    """The ``--moe-*`` flags as :class:`ExpertOptions` (``fused`` -> ``resident``)."""
    return ExpertOptions(backend=backend_name(config.moe_backend), cache_size=config.moe_cache_size,
                         cpu_threads=config.moe_cpu_threads, cpu_kernel=config.moe_cpu_kernel,
                         cpu_share=config.moe_cpu_share, cache_policy=config.moe_cache_policy,
                         decode_table=config.moe_decode_table).validate()


def apply_memory_limit(device: torch.device, gpu_memory_limit: float | None) -> None:
    """Cap this process's CUDA caching allocator at ``gpu_memory_limit`` GiB (``--gpu-memory-limit``), so a
    run measured under the cap cannot exceed it silently. No-op on the CPU or without a limit."""
    if device.type != "cuda" or gpu_memory_limit is None:
        return
    device = _indexed(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_memory_limit * 2**30 / total), device)


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>`` (the allocator's per-device calls need an index)."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def expert_budget(device: torch.device, gpu_memory_limit: float | None) -> int | None:
    """Device bytes the expert cache may take now that weights and the KV pool are placed: the limit (or the
    free memory) minus what is allocated and ``WORKSPACE_RESERVE``. None on the CPU (no budget: host memory)."""
    if device.type != "cuda":
        return None
    device = _indexed(device)
    if gpu_memory_limit is not None:
        return int(gpu_memory_limit * 2**30) - torch.cuda.memory_allocated(device) - WORKSPACE_RESERVE
    return torch.cuda.mem_get_info(device)[0] - WORKSPACE_RESERVE


def resolve_auto(model_path: str | Path, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 options: ExpertOptions) -> ExpertOptions:
    """Replace ``auto`` by a concrete backend (:func:`ferrylm.experts.auto.choose_backend`) from the model's
    shapes, the device budget and, only when the experts do not fit, measured bandwidths. For every offloading
    backend on CUDA (chosen or named), prefill streaming is kept only when it fits (:func:`fit_prefill_stream`)."""
    name = backend_name(options)
    if name not in ("auto", "offload", "hybrid", "cpu"):
        return options
    mcfg = ModelConfig.from_folder(model_path)
    if config.tensor_parallel_size > 1:   # a rank's experts: the shard's widths
        from ferrylm.models.tensor_parallel import TPShard, shard_config

        mcfg = shard_config(mcfg, TPShard(0, config.tensor_parallel_size))
    if name != "auto" and (device.type != "cuda" or not mcfg.is_moe):
        return options
    if device.type != "cuda" or not mcfg.is_moe:
        if options.cpu_share is not None:
            log.warning("--moe-cpu-share %d ignored: --moe-backend auto chose resident", options.cpu_share)
        return replace(options, backend="resident", cpu_share=None)
    from ferrylm.experts.auto import choose_backend, estimate_non_expert_bytes
    from ferrylm.experts.banks import ExpertLayout, probe_pinning
    from ferrylm.experts.bandwidth import measure_bandwidths
    from ferrylm.models.registry import get_model_class

    from ferrylm.checkpoints.quant import planned_expert_quant

    moe_layers = get_model_class(mcfg.architecture).moe_layer_indices(mcfg)
    layout = ExpertLayout(mcfg.hidden_size, mcfg.moe_intermediate_size, dtype, quant=planned_expert_quant(mcfg.raw))
    cap = (int(config.gpu_memory_limit * 2**30) if config.gpu_memory_limit is not None
           else torch.cuda.mem_get_info(device)[0])
    kv = 0 if (config.num_pages or config.num_tokens) else int(cap * config.kv_memory_fraction)
    elem = torch.empty((), dtype=dtype).element_size()
    budget = cap - estimate_non_expert_bytes(mcfg, moe_layers, elem) - kv - WORKSPACE_RESERVE
    options = fit_prefill_stream(options, 2 * mcfg.num_experts * layout.nbytes, budget)
    if name != "auto":
        return options
    measured: list = []

    def measure():
        measured.append(measure_bandwidths(device, layout, pinned=probe_pinning() is None))
        return measured[0]

    choice = choose_backend(expert_bytes_total=len(moe_layers) * mcfg.num_experts * layout.nbytes,
                            budget_bytes=budget, expert_bytes=layout.nbytes, num_layers=len(moe_layers),
                            num_experts=mcfg.num_experts, top_k=mcfg.num_experts_per_tok,
                            stream_bytes=2 * mcfg.num_experts * layout.nbytes if options.stream_prefill else 0,
                            bandwidths=measure)
    log.info("--moe-backend auto -> %s: %s", choice.backend, choice.reason)
    if options.cpu_share is not None and choice.backend != "hybrid":
        log.warning("--moe-cpu-share %d ignored: --moe-backend auto chose %s", options.cpu_share, choice.backend)
    return replace(options, backend=choice.backend, bandwidths=measured[0] if measured else options.bandwidths,
                   cpu_share=options.cpu_share if choice.backend == "hybrid" else None)


STREAM_BUDGET_SHARE = 0.5  # the prefill double buffer may take at most this share of the experts' device budget


def fit_prefill_stream(options: ExpertOptions, stream_bytes: int, budget_bytes: int) -> ExpertOptions:
    """Turn prefill layer streaming off when its double buffer (two whole expert layers, ``stream_bytes``) would
    take more than ``STREAM_BUDGET_SHARE`` of the experts' device budget (``budget_bytes``, estimated before
    loading): the slots it would displace serve every decode step, while a prefill without it still runs
    (offload and hybrid copy a chunk's misses into the slots in waves, cpu computes them on the host).
    DeepSeek-V3 (256 experts of 42 MiB at fp8): 21.7 GiB of buffers, more than a 24 GiB cap leaves for experts.

    Args:
        options: the backend's options; stream_bytes, budget_bytes: bytes.

    Returns:
        ``options``, with ``stream_prefill`` False when the buffer does not fit its share (logged).
    """
    if not options.stream_prefill or stream_bytes <= STREAM_BUDGET_SHARE * budget_bytes:
        return options
    log.info("prefill layer streaming off: its double buffer (%s) would take more than %d%% of the %s the experts "
             "may use on the device; prefill chunks use the slot cache", gib_text(stream_bytes),
             round(STREAM_BUDGET_SHARE * 100), gib_text(max(0, budget_bytes)))
    return replace(options, stream_prefill=False)


def model_host_bytes(mcfg: ModelConfig, device: torch.device, dtype: torch.dtype, backend: str) -> tuple[int, str]:
    """``(bytes, what)`` of the model that will live in host memory, from config.json alone (before anything
    loads; a synthetic preset's config is its size): every weight on a CPU device (routed experts at their
    quantized size), the routed experts' host banks on a GPU with an offloading backend, nothing otherwise."""
    from ferrylm.experts.auto import estimate_non_expert_bytes
    from ferrylm.experts.banks import ExpertLayout
    from ferrylm.checkpoints.quant import planned_expert_quant
    from ferrylm.models.registry import get_model_class

    elem = torch.empty((), dtype=dtype).element_size()
    moe_layers = get_model_class(mcfg.architecture).moe_layer_indices(mcfg) if mcfg.is_moe else ()
    experts = 0
    if moe_layers:
        layout = ExpertLayout(mcfg.hidden_size, mcfg.moe_intermediate_size, dtype,
                              quant=planned_expert_quant(mcfg.raw))
        experts = len(moe_layers) * mcfg.num_experts * layout.nbytes
    dense = estimate_non_expert_bytes(mcfg, moe_layers, elem)   # dense MLPs of non-MoE layers included
    if device.type != "cuda":
        return dense + experts, (f"its weights ({gib_text(dense)} dense + {gib_text(experts)} routed experts, "
                                 f"{str(dtype).removeprefix('torch.')})")
    if moe_layers and backend != "resident":
        return experts, f"the routed experts' host banks ({backend} backend)"
    return 0, ""


def gib_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_host_memory(model_path: str | Path, device: torch.device, dtype: torch.dtype, backend: str) -> None:
    """Refuse, before loading, a model whose host part exceeds the host's available memory (both sizes named)."""
    import psutil

    from ferrylm.memory.plan import check_host_fits

    need, what = model_host_bytes(ModelConfig.from_folder(model_path), device, dtype, backend)
    if need:
        vm = psutil.virtual_memory()
        check_host_fits(need, int(vm.available), int(vm.total), what)


def build_engine(model_path: str | Path, config: EngineConfig, tp=None) -> Engine:
    """Load the model at ``model_path`` (a HF folder) and size the engine with the memory plan.

    Boot sequence: read the device's free/total memory (and who else holds it) → load the weights (measured) →
    warm up with a minimal expert cache and a small KV pool: a prefill at the maximum chunk through every layer
    and a decode step at the maximum batch (its peak is the workspace; on the CPU a short warmup runs and the
    workspace is estimated) → :func:`ferrylm.memory.plan.plan_memory` → the KV pool and the expert slots at their
    planned sizes → on CUDA the warmup again, so the allocator keeps the workspace blocks. The plan is logged as
    a table and kept on the engine (``engine.memory_plan``).

    ``tp``: rank 0's :class:`~ferrylm.engine.parallel.step_sync.StepBroadcaster` (over its
    :class:`~ferrylm.engine.parallel.group.TPGroup`) under ``--tensor-parallel-size N > 1`` (the
    followers, ``engine/parallel/follower.py``, run every forward of this boot with it, warmups included): the model
    is loaded as rank 0's shard, its layers sum over the group, every step is broadcast before it runs; the plan is
    rank 0's (the ranks hold equal shares).

    Raises:
        ModelLoadError / UnsupportedArchitecture: the folder cannot be served.
        ValueError: a config value is out of range (message names the flag).
        MemoryPlanError: the plan does not fit (message: the figures, who holds the memory, the flag to change).
        InsufficientMemory: the budget cannot hold the expert slots the backend needs.
    """
    from ferrylm.faults import FaultInjector
    from ferrylm.memory.guard import is_oom
    from ferrylm.memory.plan import PlanInputs, boot_failure, check_budget, expert_needs, plan_memory
    from ferrylm.memory.probe import bytes_in_use, other_processes, read_memory
    from ferrylm.checkpoints.loader import load_model
    from ferrylm.synthetic.spec import is_synthetic_folder

    config.validate()
    if config.tensor_parallel_size > 1 and tp is None:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} runs one engine process per rank: "
                         f"use `ferry serve` (the offline engine is one process)")
    faults = FaultInjector.from_config(config.faults)
    broadcaster = tp
    group = tp.group if tp is not None else None
    device = resolve_device(config.device) if group is None else group.device
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
    boot = read_memory(device)
    gib_bytes = (lambda v: None if v is None else int(v * (1 << 30)))
    inputs = PlanInputs(
        kind=boot.kind, total_bytes=boot.total_bytes, free_at_boot_bytes=boot.free_bytes,
        memory_ratio=config.memory_ratio, gpu_memory_limit_bytes=gib_bytes(config.gpu_memory_limit),
        memory_reserve_bytes=gib_bytes(config.memory_reserve), weights_bytes=0, workspace_bytes=0,
        workspace_source="not measured yet", kv_bytes_per_token=1, page_size=config.page_size, max_model_len=1,
        max_running_requests=config.max_running_requests, max_prefill_length=1, num_pages=config.num_pages,
        num_tokens=config.num_tokens, moe_cache_size=config.moe_cache_size, moe_cache_auto=config.moe_cache_auto,
        kv_reserve_tokens=config.kv_reserve_tokens,
        # NOTE: CPU ranks of a tensor-parallel group share the host's memory: each rank's pool (the same size on
        # every rank) takes its share of the fraction
        host_kv_fraction=config.kv_memory_fraction / config.tensor_parallel_size if device.type == "cpu" else None,
        other_processes=tuple(other_processes(device)))
    check_budget(inputs)
    in_use = bytes_in_use(device)
    options = resolve_auto(model_path, config, device, dtype, expert_options(config))
    check_host_memory(model_path, device, dtype, backend_name(options))
    torch.manual_seed(config.seed)
    try:
        loaded = load_model(model_path, device=device, dtype=dtype, moe_backend=options,
                            tp=group.shard if group is not None else None)
    except Exception as e:
        if not is_oom(e):
            raise
        what = f"loading the weights ran out of memory ({str(e).splitlines()[0][:200]})"
        del e
        raise boot_failure(inputs, what, smaller="the model size: --moe-backend offload keeps the experts off "
                                                 "the device") from None
    weights = max(0, bytes_in_use(device) - in_use)
    mcfg, executor = loaded.config, loaded.executor   # under tensor parallel: rank 0's shard
    if group is not None:
        from ferrylm.models.tensor_parallel import attach_reduce

        attach_reduce(loaded.model, group.all_reduce)
    needs = expert_needs(executor)
    base = limits_with_pages(config, mcfg, device, 0)
    from ferrylm.engine.cache.state_pool import StateLayout

    state = StateLayout.of(mcfg)   # hybrid models: one recurrent-state slot per running request (the plan counts it)
    inputs = replace(inputs, weights_bytes=weights, experts=needs, max_model_len=base.max_model_len,
                     max_prefill_length=base.max_prefill_length,
                     kv_bytes_per_token=KVLayout.of(mcfg).bytes_per_token(dtype),
                     state_slot_bytes=state.bytes_per_slot(dtype) if state is not None else 0,
                     state_snapshots=(base.max_running_requests if state is not None and config.enable_prefix_caching
                                      else 0))
    if needs is not None and needs.backend in ("offload", "hybrid"):
        # the GPU computes every expert it routes to: a decode step of R sequences needs up to R * k of a layer at
        # once, the floor of an automatically sized cache (an explicit --moe-cache-size below it runs in waves)
        needs = replace(needs, step_slots=min(config.max_running_requests * mcfg.num_experts_per_tok,
                                              mcfg.num_experts))
        inputs = replace(inputs, experts=needs)
    explicit_chunk = config.max_prefill_length is not None
    floor = base.max_prefill_length if explicit_chunk else min(base.max_prefill_length, MIN_PREFILL_CHUNK)
    # preflight: sizes that cannot fit even without a workspace, at the smallest chunk, fail now, before the warmup
    plan_memory(replace(inputs, max_prefill_length=floor))
    if needs is not None:  # the warmup's expert cache: the explicit size, else the backend's minimum
        warm_slots = (min(config.moe_cache_size, needs.total_experts) if config.moe_cache_size is not None
                      else max(1, needs.min_slots))
        executor.reserve(needs.bytes_for(warm_slots))
        if broadcaster is not None:
            broadcaster.expert_budget = int(needs.bytes_for(warm_slots))
    plan, base, step_times = _plan_with_chunk(loaded, config, device, dtype, base, weights, inputs, floor,
                                              broadcaster)
    if needs is not None:
        executor.reserve(plan.expert_bytes)
        if broadcaster is not None:
            broadcaster.expert_budget = int(plan.expert_bytes)
    engine = Engine(loaded.model, mcfg, config, device=device, dtype=dtype,
                    limits=replace(base, num_pages=plan.kv_pages), expert_executor=executor, faults=faults,
                    memory_plan=plan, tokenizer_path=str(model_path), model_id=str(model_path), tp=broadcaster)
    engine.progress.seed_from(step_times)   # the watchdog's step-time estimates before the first request
    workspace = plan.workspace_bytes
    if device.type == "cuda":
        try:  # the allocator keeps these blocks: request-time steps reuse them
            engine.warmup(base.max_prefill_length, base.max_running_requests)
        except Exception as e:
            if not is_oom(e):
                raise
            what = (f"the warmup after placing the KV pool ({plan.kv_tokens} tokens) and the expert slots "
                    f"({plan.expert_slots}) ran out of memory ({str(e).splitlines()[0][:200]})")
            del e, engine
            raise boot_failure(replace(inputs, workspace_bytes=workspace), what,
                               smaller="--num-tokens / --moe-cache-size, or raise --memory-reserve") from None
        engine.runner.capture_graphs()  # sizes the plan counted; one that runs short now is retried later
    log.info("memory plan (%s):\n%s", device, plan.format_table())
    for w in plan.warnings:
        log.warning("memory plan: %s", w)
    if faults.enabled:
        log.warning("fault injection is ON: %s", faults)
    lim = engine.limits
    log.info("engine ready: device=%s dtype=%s max_model_len=%d kv_pool=%d pages x %d tokens = %d tokens, "
             "max_running_requests=%d, max_prefill_length=%d, moe_backend=%s", device,
             str(dtype).removeprefix("torch."), lim.max_model_len, lim.num_pages, lim.page_size, lim.pool_tokens,
             lim.max_running_requests, lim.max_prefill_length, backend_name(options))
    return engine


MIN_PREFILL_CHUNK = 1024  # tokens: the plan lowers a default chunk that does not fit down to this, no further


def _plan_with_chunk(loaded, config: EngineConfig, device: torch.device, dtype: torch.dtype, base: EngineLimits,
                     weights: int, inputs, floor: int, tp=None):
    """Measure the workspace at the prefill chunk and plan; when the plan does not fit and the chunk is the default
    (no ``--max-prefill-length``), halve the chunk and measure again, down to ``floor`` tokens. An explicit chunk is
    never changed. Returns ``(plan, limits with the chunk used, the warmup's StepProgress)``; the plan's table says
    when the chunk was lowered.

    Raises:
        MemoryPlanError: the plan does not fit at the floor (or at the explicit chunk).
    """
    from ferrylm.memory.plan import MemoryPlanError, plan_memory

    chunk, first = base.max_prefill_length, base.max_prefill_length
    while True:
        limits = replace(base, max_prefill_length=chunk)
        try:
            workspace, source, graph_bytes, step_times = _measure_workspace(loaded, config, device, dtype, limits,
                                                                            weights, tp)
            plan = plan_memory(replace(inputs, max_prefill_length=chunk, workspace_bytes=workspace,
                                       workspace_source=source, graph_bytes=graph_bytes))
        except MemoryPlanError as e:
            if chunk <= floor:
                raise
            lower = max(floor, chunk // 2)
            log.warning("memory plan: a prefill chunk of %d tokens does not fit (%s); trying %d tokens", chunk,
                        str(e).split(". To fix")[0][:300], lower)
            chunk = lower
            continue
        if chunk < first:
            plan = replace(plan, prefill_note=f"lowered from {first}: the default chunk did not fit")
            log.warning("memory plan: prefill chunk lowered from %d to %d tokens to fit (set --max-prefill-length to "
                        "choose it)", first, chunk)
        return plan, limits, step_times


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


# NOTE: on the CPU no peak can be measured; a short warmup still runs every path, the workspace is estimated.
CPU_WARMUP_PREFILL = 64
CPU_WARMUP_DECODE = 4


def _measure_workspace(loaded, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                       base: EngineLimits, weights: int, tp=None) -> tuple[int, str, int, StepProgress]:
    """Warm up a throwaway engine with a pool just large enough and return ``(workspace bytes, "measured" |
    "estimated", CUDA graph bytes, its step times)``: the step times (seconds per prefill token, per decode step)
    seed the real engine's watchdog estimates, so a long first prefill on a slow host is not taken for a hang; on CUDA the throwaway engine also captures its decode graphs, whose pool is
    measured (it stays allocated in the real engine, beside the workspace). Raises MemoryPlanError when the warmup
    itself runs out of memory."""
    from ferrylm.memory.guard import is_oom
    from ferrylm.memory.plan import MemoryPlanError, gib
    from ferrylm.memory.probe import estimate_workspace, free_bytes, measure_peak, release_cached

    mcfg = loaded.config
    prefill, decode = base.max_prefill_length, base.max_running_requests
    if device.type != "cuda":
        prefill, decode = min(prefill, CPU_WARMUP_PREFILL), min(decode, CPU_WARMUP_DECODE)
    per = max(1, min(prefill, base.max_model_len - 1))
    n_pref = max(1, min(base.max_running_requests, -(-prefill // per)))
    ps = base.page_size
    pages = n_pref * -(-(per + 1) // ps) + max(1, decode) * -(-3 // ps) + 1
    warm = Engine(loaded.model, mcfg, config, device=device, dtype=dtype, limits=replace(base, num_pages=pages),
                  expert_executor=loaded.executor, tp=tp)
    try:
        peak = measure_peak(device, lambda: warm.warmup(prefill, decode))
    except Exception as e:
        if not is_oom(e):
            raise
        msg = str(e).split("\n")[0][:200]
        del e, warm
        release_cached(device)
        raise MemoryPlanError(
            f"memory plan does not fit: the warmup (a prefill of {prefill} tokens, a decode of {decode} requests) "
            f"ran out of memory after the weights ({gib(weights)}) were loaded ({msg}); {gib(free_bytes(device))} "
            f"free now. To fix: lower --max-prefill-length / --max-running-requests, or free device memory, or "
            f"--moe-backend offload.") from None
    graph_bytes = 0
    if device.type == "cuda":
        warm.runner.capture_graphs()
        graph_bytes = warm.runner.graph_bytes
        warm.runner.close()
    step_times = warm.progress
    del warm
    release_cached(device)
    if peak is not None:
        return peak, "measured", graph_bytes, step_times
    est = estimate_workspace(hidden_size=mcfg.hidden_size, intermediate_size=mcfg.moe_intermediate_size
                             if mcfg.is_moe else mcfg.intermediate_size, num_heads=mcfg.num_heads,
                             num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim, vocab_size=mcfg.vocab_size,
                             num_experts_per_tok=mcfg.num_experts_per_tok, prefill_tokens=base.max_prefill_length,
                             decode_seqs=base.max_running_requests, max_model_len=base.max_model_len,
                             dtype_bytes=torch.empty((), dtype=dtype).element_size())
    from ferrylm.models.registry import get_model_class

    extra = getattr(get_model_class(mcfg.architecture), "workspace_extra_bytes", None)
    if extra is not None:   # e.g. the chunk form's scratch of the Gated DeltaNet layers at the largest chunk
        est += int(extra(mcfg, base.max_prefill_length))
    return est, "estimated", graph_bytes, step_times
