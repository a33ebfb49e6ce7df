"""``ferry bench decode``: decode speed of the MoE backends, side by side in one process.

For each backend: one warm-up request, then ``--batch`` requests of ``--prompt-len`` random prompt tokens decoding
``--tokens`` tokens each (EOS ignored; greedy, or ``--temperature`` sampling seeded per request). NOTE: greedy
decoding of a random-weight ``synthetic:`` model soon repeats itself, so each layer keeps routing to the same
experts and the hit rate climbs towards 100 %; sampling (``--temperature 1``) keeps the routing moving. That holds for
``routing=router`` only: with a routing profile (``synthetic:<preset>:routing=<profile>``, the default for the
Qwen-MoE and OLMoE presets) the experts follow the profile's calibrated locality whatever the tokens are
(docs/ROUTING.md); without per-request sequence keys all requests of a batch share their routing there. Decode time runs
from the end of the step that finished every prefill to the last token. Printed per backend: tok/s, hit rate, bytes
over PCIe per token (expert copies plus CPU-expert activations), CPU expert bytes per token, the roofline tok/s for
the measured hit rate, achieved / roofline, and a checksum of the generated token ids (equal checksums: identical
tokens).

Roofline (per decode step of ``B`` tokens; ``S`` bytes per expert; per-step averages of the executor's counters;
``W`` the non-expert weight bytes a step reads, i.e. every weight but the embedding table, which is read in full
only when tied to the output layer):
  * resident: ``t >= (W + needed * S) / B_hbm``
  * offload:  ``t >= (W + needed * S) / B_hbm + (misses + prefetch_hits) * S / B_pcie``
  * cpu:      ``t >= (W + hits * S) / B_hbm + cpu_experts * S / B_cpu``
  * hybrid:   ``t >= (W + (needed - cpu_experts) * S) / B_hbm + max(fetched_needed * S / B_pcie,
    cpu_experts * S / B_cpu)`` (the two sides run concurrently)
and roofline tok/s = ``B / t``. Rates are measured at start (:func:`ferrylm.experts.bandwidth.measure_bandwidths`).

All backends share one host copy of the experts (:class:`~ferrylm.experts.banks.HostBanks`) and one engine; the
expert executor is swapped between runs. ``--gpu-memory-limit`` caps the offloading backends (the caching
allocator is capped too, so exceeding it fails loudly); ``resident`` runs without the cap, last. On CUDA the cuDNN
SDPA kernel is left out, as everywhere (``engine/attention/torch_backend.py``).
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ferrylm.bench.common import bench_prompts, sync, token_checksum
from ferrylm.bench.report import report
from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.errors import FerryError
from ferrylm.experts import ExpertOptions, backend_name, build_from_banks
from ferrylm.experts.options import Bandwidths
from ferrylm.models.moe import SparseMoeBlock, hand_routers
from ferrylm.models.sizes import non_expert_step_bytes
from ferrylm.synthetic.spec import is_synthetic_folder

log = logging.getLogger("ferrylm.bench")

BACKEND_ORDER = ("offload", "offload-host", "cpu", "hybrid", "resident")  # offload-host: the table off (A/B)
_COUNTERS = ("steps", "tokens", "needed", "hits", "misses", "prefetched", "prefetch_hits", "prefetch_wasted",
             "fetched", "streamed", "bytes_copied", "bytes_activations", "cpu_experts", "cpu_expert_time_s",
             "copy_time_s", "copy_exposed_s", "mapped", "bytes_mapped")


def swap_executor(model, executor):
    """Point every MoE block of ``model`` at ``executor`` and hand it their routers. Returns ``model``."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for m in blocks:
        m.executor = executor
    hand_routers(blocks)
    return model


@dataclass
class DecodeResult:
    """One backend's run (rates in tokens/s, bytes per generated token)."""

    backend: str
    batch: int = 1
    tok_s: float = 0.0
    decode_s: float = 0.0
    tokens: int = 0
    hit_rate: float = 0.0
    pcie_bytes_per_token: float = 0.0
    cpu_bytes_per_token: float = 0.0
    roofline_tok_s: float = 0.0
    achieved_over_roofline: float = 0.0
    checksum: str = ""
    num_slots: int = 0
    counters: dict = field(default_factory=dict)
    decode_graphs: dict = field(default_factory=dict)  # the engine's decode graph stats after this backend's run
    cpu_share: dict | None = None  # hybrid: per step size, the CPU share its tuner uses / settled on
    error: str | None = None


def roofline_seconds(backend: str, per_step: dict, expert_bytes: int, base_bytes: int, bw: Bandwidths) -> float:
    """Lower bound on one decode step's seconds (module docstring); ``per_step`` holds per-step averages."""
    s = expert_bytes
    needed, hits, misses = per_step["needed"], per_step["hits"], per_step["misses"]
    cpu, pf = per_step["cpu_experts"], per_step["prefetch_hits"]
    if backend == "resident":
        return (base_bytes + needed * s) / bw.hbm
    if backend == "offload":
        mapped = per_step.get("mapped", 0)
        if mapped:  # the device table: misses read by the kernel over PCIe, installs copied for later steps
            return (base_bytes + hits * s) / bw.hbm + (mapped + per_step.get("fetched", 0)) * s / bw.pcie
        return (base_bytes + needed * s) / bw.hbm + (misses + pf) * s / bw.pcie
    if backend == "cpu":
        return (base_bytes + hits * s) / bw.hbm + cpu * s / bw.cpu
    fetched = misses - cpu + pf
    return (base_bytes + (needed - cpu) * s) / bw.hbm + max(fetched * s / bw.pcie, cpu * s / bw.cpu)


def _counters(ex) -> dict:
    ex.sync_stats()
    st = ex.stats().as_dict()
    return {k: st.get(k, 0) for k in _COUNTERS}


def _generate(engine, prompts: list[list[int]], new_tokens: int, tag: str, ex, device, temperature: float = 0.0,
              decode_context=None):
    """Run ``prompts`` to ``new_tokens + 1`` tokens each (greedy, or sampled with a per-prompt seed so equal logits
    still give equal tokens); ``decode_context`` (e.g. a profiler) is entered once every prompt has its first token
    and left after the last step. Returns (token lists, decode seconds, counters at the end of prefill, counters at
    the end).

    Raises:
        RuntimeError: a request ended with an error."""
    import contextlib

    from ferrylm.engine.sampling_params import SamplingParams

    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        outs[rid] = []
        engine.add_request(rid, p, SamplingParams(temperature=temperature, seed=i, max_tokens=new_tokens + 1,
                                                  ignore_eos=True))
    t0 = c0 = None
    with contextlib.ExitStack() as stack:
        while engine.has_work():
            for o in engine.step():
                if o.error_code is not None:
                    raise RuntimeError(f"request {o.request_id} failed: {o.error_code}: {o.error_message}")
                outs[o.request_id].extend(o.new_token_ids)
            if t0 is None and all(outs.values()):
                sync(device)
                if decode_context is not None:
                    stack.enter_context(decode_context)
                c0, t0 = _counters(ex), time.perf_counter()
        sync(device)
        t1 = time.perf_counter()
    return list(outs.values()), t1 - t0, c0, _counters(ex)


def run_decode_bench(*, model: str, backends: list[str], engine_config, batch: int | list[int], tokens: int,
                     prompt_len: int, prefetch: bool | None = None, temperature: float = 0.0,
                     profile_steps: int = 0, progress=print) -> dict:
    """Run the benchmark (see the module docstring). ``engine_config``: an EngineConfig carrying ``device``,
    ``dtype``, ``moe_cache_size``, ``moe_cpu_threads``, ``gpu_memory_limit`` and the KV settings.
    ``profile_steps`` > 0: after each backend's timed run, decode that many more tokens under ``torch.profiler``
    and print (through ``progress``) the ops with the most host time and the most device time, and the count of
    device kernels per decode step.

    ``batch``: one batch size or several (each a fresh engine over the same loaded model and measured bandwidths).

    Returns:
        ``{"model", "device", "batch", "tokens", "bandwidths" (bytes/s), "expert_bytes", "non_expert_bytes",
        "results": [DecodeResult as dict, ...]}``.
    """
    ec = engine_config
    s = _setup(model, ec, progress)
    batches = [batch] if isinstance(batch, int) else list(batch)
    results = []
    for batch in batches:
        engine = _engine_for_batch(s, ec, batch, prompt_len, tokens)
        # as many warm-up prompts as the batch: decode graphs for the batch size are captured before the timed run
        prompts, warm = bench_prompts(s.loaded.config.vocab_size, batch, prompt_len, ec.seed, num_warm=batch)
        run = _Run(s, ec, engine, batch, tokens, prefetch, temperature, progress)
        for name in backends:
            res = run.backend(name, prompts, warm, profile_steps)
            results.append(res)
        engine.runner.close()
        del engine
    graph_mode = "off"
    for res in results:
        graph_mode = res.decode_graphs.get("mode", graph_mode)
    return {"model": model, "device": str(s.device), "dtype": str(s.dtype).removeprefix("torch."),
            "batch": batches[0] if len(batches) == 1 else batches,
            "tokens": tokens, "temperature": temperature, "prompt_len": prompt_len,
            "gpu_memory_limit_gib": ec.gpu_memory_limit,
            "decode_graphs": graph_mode,
            "bandwidths": s.bw.as_dict(), "cpu_latency_s": s.bw.cpu_latency, "cpu_kernel": s.cpu_kernel,
            "expert_bytes": s.banks.expert_bytes, "non_expert_bytes": s.base,
            "results": [asdict(r) for r in results]}


@dataclass
class _Setup:
    """What every run shares: the loaded model and its host banks, the device and dtype, the measured rates (and
    the CPU kernel they were measured with), and ``base``: the non-expert bytes a decode step reads."""

    loaded: object
    banks: object
    device: torch.device
    dtype: torch.dtype
    bw: Bandwidths
    cpu_kernel: str
    base: int


def _setup(model: str, ec, progress) -> _Setup:
    """Load ``model`` with its experts in host banks and measure the bandwidths. Raises ValueError for a dense
    model, MemoryPlanError (before loading) for one the host's available memory cannot hold."""
    from ferrylm.checkpoints.loader import load_model
    from ferrylm.checkpoints.resolve import resolve_model
    from ferrylm.engine.engine import resolve_device, resolve_dtype
    from ferrylm.engine.expert_choice import check_host_memory
    from ferrylm.experts.bandwidth import measure_bandwidths
    from ferrylm.experts.cpu_pool import CpuExpertPool

    device = resolve_device(ec.device)
    dtype = resolve_dtype(ec.dtype, device)
    path = resolve_model(model).path
    if ec.dtype == "auto" and is_synthetic_folder(path):
        dtype = torch.bfloat16
    check_host_memory(ModelConfig.from_folder(path), device, dtype, "offload")  # the banks hold every expert
    t = time.perf_counter()
    loaded = load_model(path, device=device, dtype=dtype, moe_backend=ExpertOptions("offload"), expert_device="cpu")
    if loaded.executor is None:
        raise ValueError(f"{model} is not a MoE model")
    banks = loaded.executor.banks
    loaded.executor.close()
    progress(f"loaded {model} in {time.perf_counter() - t:.1f} s: {len(banks.layers)} MoE layers x "
             f"{banks.num_experts} experts x {banks.expert_bytes / 2**20:.2f} MiB = {banks.total_bytes / 2**30:.2f} "
             f"GiB of experts in {'pinned' if banks.pinned else 'pageable'} host memory")
    pool = CpuExpertPool(banks.layout, ec.moe_cpu_threads, ec.moe_cpu_kernel)
    bw = measure_bandwidths(device, banks.layout, pinned=banks.pinned, pool=pool)
    pool.close()
    progress("bandwidths GB/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.as_dict().items())
             + f" (cpu: {pool.kernel_name} kernel, {torch.get_num_threads()} threads; CPU job latency "
               f"{bw.cpu_latency * 1e6:.0f} us)")
    return _Setup(loaded, banks, device, dtype, bw, pool.kernel_name, non_expert_step_bytes(loaded.model))


def _engine_for_batch(s: _Setup, ec, batch: int, prompt_len: int, tokens: int):
    """A fresh engine over the loaded model whose KV pool holds ``batch`` requests of the run's length."""
    from ferrylm.engine.boot import engine_for_model

    page = ec.page_size
    pages = batch * -(-(prompt_len + tokens + 8) // page) + 4
    cfg = EngineConfig(device=str(s.device), dtype=str(s.dtype).removeprefix("torch."), page_size=page,
                       num_pages=pages, max_running_requests=batch, max_prefill_length=max(64, batch * prompt_len),
                       moe_backend="resident", decode_graphs=ec.decode_graphs,
                       cuda_graph_max_batch=ec.cuda_graph_max_batch, cuda_graph_max_len=ec.cuda_graph_max_len)
    return engine_for_model(s.loaded.model, s.loaded.config, cfg, device=s.device, dtype=s.dtype)


@dataclass
class _Run:
    """One batch size's engine and settings; :meth:`backend` runs one backend on it."""

    s: _Setup
    ec: object
    engine: object
    batch: int
    tokens: int
    prefetch: bool | None
    temperature: float
    progress: Callable

    def executor(self, name: str):
        """Backend ``name``'s executor over the shared banks (``offload-host``: offload without the device table);
        the offloading ones under ``--gpu-memory-limit``, resident without it."""
        from ferrylm.engine.boot import apply_memory_limit

        s, ec = self.s, self.ec
        if name == "resident":
            if s.device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
            return build_from_banks("resident", s.banks, s.device)
        apply_memory_limit(s.device, ec.gpu_memory_limit)
        base_name = name.removesuffix("-host")  # offload-host: the host-planned offload path (A/B)
        return build_from_banks(base_name, s.banks, s.device, ExpertOptions(
            backend=base_name, decode_table=not name.endswith("-host"), cache_size=ec.moe_cache_size,
            cpu_threads=ec.moe_cpu_threads, cpu_kernel=ec.moe_cpu_kernel,
            cpu_share=ec.moe_cpu_share if name == "hybrid" else None, prefetch=self.prefetch, bandwidths=s.bw,
            cache_policy=ec.moe_cache_policy))

    def backend(self, name: str, prompts, warm, profile_steps: int) -> DecodeResult:
        """Warm up and time backend ``name``; a backend that fails (OOM under the cap, cannot fit) is a result with
        ``error``."""
        from ferrylm.engine.expert_choice import expert_budget

        res = DecodeResult(backend=name, batch=self.batch)
        ex = None
        device = self.s.device
        try:
            ex = self.executor(name)
            if name != "resident":
                res.num_slots = ex.reserve(expert_budget(device, self.ec.gpu_memory_limit))
            swap_executor(self.s.loaded.model, ex)  # the engine's runner drops the old executor's graphs next step
            _generate(self.engine, warm, 4, f"{name}-warm", ex, device)
            toks, secs, c0, c1 = _generate(self.engine, prompts, self.tokens, name, ex, device, self.temperature)
        except (RuntimeError, ValueError, FerryError) as e:  # OOM under the cap, a backend that cannot fit
            res.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            self.progress(f"{name}: {res.error}")
            _release(ex, device)
            return res
        self.score(res, {k: c1[k] - c0[k] for k in _COUNTERS}, toks, secs)
        res.decode_graphs = self.engine.runner.stats() or {}
        res.cpu_share = ex.stats().cpu_share
        self.progress(format_row(res, device.type != "cpu"))
        if profile_steps > 0:
            self.progress(profile_decode(self.engine, prompts, profile_steps, f"{name}-profile", ex, device,
                                         self.temperature))
        _release(ex, device)
        return res

    def score(self, res: DecodeResult, diff: dict, toks: list[list[int]], secs: float) -> None:
        """Fill ``res``'s rates, traffic per token and roofline from the counters' ``diff`` over the timed run."""
        s = self.s
        steps = max(1, diff["steps"])
        n = self.batch * self.tokens
        res.tokens, res.decode_s, res.tok_s = n, secs, n / secs
        res.hit_rate = diff["hits"] / diff["needed"] if diff["needed"] else 1.0
        res.pcie_bytes_per_token = (diff["bytes_copied"] + diff["bytes_activations"] + diff["bytes_mapped"]) / n
        res.cpu_bytes_per_token = diff["cpu_experts"] * s.banks.expert_bytes / n
        per_step = {k: diff[k] / steps for k in ("needed", "hits", "misses", "cpu_experts", "prefetch_hits",
                                                 "mapped", "fetched")}
        roof = roofline_seconds(res.backend.removesuffix("-host"), per_step, s.banks.expert_bytes, s.base, s.bw)
        res.roofline_tok_s = self.batch / roof
        res.achieved_over_roofline = res.tok_s / res.roofline_tok_s
        res.checksum = token_checksum(toks)
        res.counters = diff


def profile_decode(engine, prompts: list[list[int]], steps: int, tag: str, ex, device: torch.device,
                   temperature: float) -> str:
    """Prefill ``prompts``, then decode ``steps`` tokens per prompt under ``torch.profiler`` (decode steps only).
    Returns a text report: top ops by self host time and by self device time, and device kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=acts)
    _generate(engine, prompts, steps, tag, ex, device, temperature, decode_context=prof)
    n = steps  # one token per prompt per decode step
    avg = prof.key_averages()
    lines = [f"--- profile {tag}: {n} decode steps, batch {len(prompts)} ---",
             avg.table(sort_by="self_cpu_time_total", row_limit=30)]
    if device.type == "cuda":
        lines.append(avg.table(sort_by="self_device_time_total", row_limit=15))
        kernels = sum(e.count for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
        lines.append(f"device kernels + copies: {kernels} total, {kernels / max(1, n):.0f} per decode step")
    return "\n".join(lines)


def _release(ex, device: torch.device):
    if ex is not None:
        ex.close()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return None


#: the table's columns: (title, width, cell of a result, shown on a CPU-only run). The device columns (PCIe, slots,
#: copy time exposed) mean nothing without a GPU.
_COLUMNS: tuple[tuple[str, int, Callable[[DecodeResult], str], bool], ...] = (
    ("tok/s", 8, lambda r: f"{r.tok_s:.2f}", True),
    ("hit%", 6, lambda r: f"{100 * r.hit_rate:.1f}", False),
    ("PCIe MB/tok", 12, lambda r: f"{r.pcie_bytes_per_token / 1e6:.1f}", False),
    ("CPU MB/tok", 11, lambda r: f"{r.cpu_bytes_per_token / 1e6:.1f}", True),
    ("slots", 6, lambda r: f"{r.num_slots:d}", False),
    ("roofline", 9, lambda r: f"{r.roofline_tok_s:.2f}", True),
    ("ach/roof", 9, lambda r: f"{r.achieved_over_roofline:.2f}", True),
    ("exposed", 8, lambda r: f"{100 * r.counters.get('copy_exposed_s', 0.0) / r.decode_s if r.decode_s else 0.0:.0f}%",
     False),
)
_DEVICE_BANDWIDTHS = ("pcie", "hbm")


def _columns(on_gpu: bool) -> list[tuple[str, int, Callable[[DecodeResult], str], bool]]:
    return [c for c in _COLUMNS if on_gpu or c[3]]


def format_header(on_gpu: bool = True) -> str:
    return f"{'batch':>5} {'backend':<9} " + " ".join(f"{t:>{w}}" for t, w, _, _ in _columns(on_gpu)) + "  checksum"


def format_row(r: DecodeResult, on_gpu: bool = True) -> str:
    """One aligned row; a failed run shows ``-`` in every column, then its error."""
    cells = [("-" if r.error else cell(r), w) for _, w, cell, _ in _columns(on_gpu)]
    tail = r.error if r.error else r.checksum
    return f"{r.batch:>5} {r.backend:<9} " + " ".join(f"{c:>{w}}" for c, w in cells) + f"  {tail}"


def format_table(summary: dict) -> str:
    """The decode table; on a CPU-only run (``device`` cpu) without the device columns and bandwidths."""
    on_gpu = not str(summary["device"]).startswith("cpu")
    bw = {k: v for k, v in summary["bandwidths"].items() if on_gpu or k not in _DEVICE_BANDWIDTHS}
    lines = [f"model {summary['model']}  device {summary['device']} {summary['dtype']}  batch {summary['batch']}  "
             f"tokens {summary['tokens']}  gpu limit {summary['gpu_memory_limit_gib']} GiB  "
             f"decode graphs {summary.get('decode_graphs', 'off')}",
             "measured GB/s: " + "  ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items()), format_header(on_gpu)]
    lines += [format_row(DecodeResult(**r), on_gpu) for r in summary["results"]]
    return "\n".join(lines)


def main(args) -> int:
    """``ferry bench decode`` (arguments: the serve model flags plus ``--batch``, ``--tokens``, ``--prompt-len``,
    ``--no-prefetch``, ``--output-json``)."""
    from ferrylm.cli import engine_config_from_args

    try:
        batches = [int(b) for b in str(args.batch).split(",")]
    except ValueError:
        print(f"ferry bench decode: --batch must be a number or a comma list of numbers, got {args.batch!r}",
              file=sys.stderr)
        return 2
    for flag, v in [("--batch", b) for b in batches] + [("--tokens", args.tokens), ("--prompt-len", args.prompt_len)]:
        if v < 1:
            print(f"ferry bench decode: {flag} must be >= 1", file=sys.stderr)
            return 2
    if not args.temperature >= 0:
        print(f"ferry bench decode: --temperature must be >= 0, got {args.temperature}", file=sys.stderr)
        return 2
    if args.moe_backend == "all":
        backends = list(BACKEND_ORDER)
    elif backend_name(args.moe_backend) == "auto":
        print("ferry bench decode: --moe-backend auto is decided by `ferry serve`; pick a backend or 'all' "
              "(the default)", file=sys.stderr)
        return 2
    else:
        backends = [backend_name(args.moe_backend)]
    try:
        ec = engine_config_from_args(args)
    except ValueError as e:
        print(f"ferry bench decode: {e}", file=sys.stderr)
        return 2
    try:
        summary = run_decode_bench(model=args.model, backends=backends, engine_config=ec, batch=batches,
                                   tokens=args.tokens, prompt_len=args.prompt_len,
                                   prefetch=False if args.no_prefetch else None, temperature=args.temperature,
                                   profile_steps=args.profile_steps,
                                   progress=lambda s: print(s, file=sys.stderr, flush=True))
    except (FerryError, ValueError) as e:  # a bad --model spec or folder, a device that is not there
        print(f"ferry bench decode: {e}", file=sys.stderr)
        return 2
    report(format_table(summary), summary, args.output_json)
    return 0 if all(r["error"] is None for r in summary["results"]) else 1
