"""The boot's expert-backend step: the ``--moe-*`` flags as :class:`ExpertOptions`, the one resolver of
``--moe-backend auto`` (:func:`resolve_expert_backend`), and the host-memory check of what the chosen backend keeps
in host RAM. All from the model's config alone, before anything loads."""

from __future__ import annotations

import logging
from dataclasses import replace

import psutil
import torch

from ferrylm.checkpoints.quant import planned_expert_quant
from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.experts import ExpertOptions, backend_name
from ferrylm.experts.auto import choose_backend, estimate_non_expert_bytes
from ferrylm.experts import bandwidth, banks
from ferrylm.experts.executor import ExpertLayout
from ferrylm.memory.budget import check_host_fits
from ferrylm.models.registry import get_model_class
from ferrylm.models.tensor_parallel import TPShard, shard_config

log = logging.getLogger("ferrylm.engine")

# device memory kept free for activations until the memory plan measures the workspace
WORKSPACE_RESERVE = 1 << 30
STREAM_BUDGET_SHARE = 0.5  # the prefill double buffer may take at most this share of the experts' device budget
NO_GPU_OFFLOAD_WARNING = (
    "--moe-backend %s on a machine without a GPU: host memory stands in for the GPU here, so the experts are kept a "
    "second time as a slot cache in host memory and its hits run through torch: more memory, a smaller KV pool and "
    "a slower decode than the default (--moe-backend auto serves resident: the experts computed where they lie by "
    "the native CPU kernels)")


def expert_options(config: EngineConfig) -> ExpertOptions:
    """The ``--moe-*`` flags as :class:`ExpertOptions` (``fused`` -> ``resident``)."""
    return ExpertOptions(backend=backend_name(config.moe_backend), cache_size=config.moe_cache_size,
                         cpu_threads=config.moe_cpu_threads, cpu_kernel=config.moe_cpu_kernel,
                         cpu_share=config.moe_cpu_share, cache_policy=config.moe_cache_policy,
                         decode_table=config.moe_decode_table).validate()


def expert_budget(device: torch.device, gpu_memory_limit: float | None) -> int | None:
    """Device bytes an expert cache may take now: the limit (or the free memory) minus what is allocated and
    ``WORKSPACE_RESERVE``. None on the CPU (no budget: host memory)."""
    if device.type != "cuda":
        return None
    device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if gpu_memory_limit is not None:
        return int(gpu_memory_limit * 2**30) - torch.cuda.memory_allocated(device) - WORKSPACE_RESERVE
    return torch.cuda.mem_get_info(device)[0] - WORKSPACE_RESERVE


def resolve_expert_backend(mcfg: ModelConfig, config: EngineConfig, device: torch.device,
                           dtype: torch.dtype) -> ExpertOptions:
    """The ``--moe-*`` flags with ``auto`` replaced by a concrete backend: resident on the CPU or for a dense
    model, else :func:`ferrylm.experts.auto.choose_backend` from the model's shapes, the device budget and (only
    when the experts do not fit) the machine's bandwidths (its ``ferry bench bw`` profile, else measured now). For
    every offloading backend on CUDA, prefill streaming is kept only when it fits (:func:`fit_prefill_stream`).
    ``mcfg``: the whole model's config (a rank's shard is derived here under ``--tensor-parallel-size``)."""
    options = expert_options(config)
    name = backend_name(options)
    if name not in ("auto", "offload", "hybrid", "cpu"):
        return options
    if device.type != "cuda" or not mcfg.is_moe:
        if name != "auto":
            if mcfg.is_moe:
                log.warning(NO_GPU_OFFLOAD_WARNING, name)
            return options
        if options.cpu_share is not None:
            log.warning("--moe-cpu-share %d ignored: --moe-backend auto chose resident", options.cpu_share)
        return replace(options, backend="resident", cpu_share=None)
    if config.tensor_parallel_size > 1:   # a rank's experts: the shard's widths
        mcfg = shard_config(mcfg, TPShard(0, config.tensor_parallel_size))
    moe_layers = get_model_class(mcfg.architecture).moe_layer_indices(mcfg)
    layout = ExpertLayout(mcfg.hidden_size, mcfg.moe_intermediate_size, dtype, quant=planned_expert_quant(mcfg.raw))
    cap = (int(config.gpu_memory_limit * 2**30) if config.gpu_memory_limit is not None
           else torch.cuda.mem_get_info(device)[0])
    kv = 0 if (config.num_pages or config.num_tokens) else int(cap * config.kv_memory_fraction)
    elem = torch.empty((), dtype=dtype).element_size()
    budget = cap - estimate_non_expert_bytes(mcfg, moe_layers, elem) - kv - WORKSPACE_RESERVE
    stream = 2 * mcfg.num_experts * layout.nbytes
    options = fit_prefill_stream(options, stream, budget)
    if name != "auto":
        return options
    measured: list = []

    def measure():
        measured.append(bandwidth.machine_bandwidths(device, layout, pinned=banks.probe_pinning() is None,
                                                     threads=options.cpu_threads))
        return measured[0]

    choice = choose_backend(expert_bytes_total=len(moe_layers) * mcfg.num_experts * layout.nbytes,
                            budget_bytes=budget, expert_bytes=layout.nbytes, num_layers=len(moe_layers),
                            num_experts=mcfg.num_experts, top_k=mcfg.num_experts_per_tok,
                            stream_bytes=stream if options.stream_prefill else 0, bandwidths=measure)
    log.info("--moe-backend auto -> %s: %s", choice.backend, choice.reason)
    if options.cpu_share is not None and choice.backend != "hybrid":
        log.warning("--moe-cpu-share %d ignored: --moe-backend auto chose %s", options.cpu_share, choice.backend)
    return replace(options, backend=choice.backend, bandwidths=measured[0] if measured else options.bandwidths,
                   cpu_share=options.cpu_share if choice.backend == "hybrid" else None)


def fit_prefill_stream(options: ExpertOptions, stream_bytes: int, budget_bytes: int) -> ExpertOptions:
    """Turn prefill layer streaming off when its double buffer (two whole expert layers, ``stream_bytes``) would
    take more than ``STREAM_BUDGET_SHARE`` of the experts' device budget (``budget_bytes``, estimated before
    loading): the slots it would displace serve every decode step, while a prefill without it still runs.

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
    """``(bytes, what)`` of the model that will live in host memory, from config.json alone: every weight on a
    CPU device (routed experts at their quantized size), the routed experts' host banks on a GPU with an
    offloading backend, nothing otherwise."""
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


def check_host_memory(mcfg: ModelConfig, device: torch.device, dtype: torch.dtype, backend: str) -> None:
    """Refuse, before loading, a model whose host part exceeds the host's available memory (both sizes named).

    Raises:
        MemoryPlanError: it does not fit.
    """
    need, what = model_host_bytes(mcfg, device, dtype, backend)
    if need:
        vm = psutil.virtual_memory()
        check_host_fits(need, int(vm.available), int(vm.total), what)
