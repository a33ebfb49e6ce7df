"""``ferry bench accelerate``: the comparison baseline: the same architecture and GPU cap through
transformers + accelerate offload (``device_map`` with ``max_memory``), greedy decode tok/s.

How the model is made and placed: :mod:`ferrylm.bench.accelerate_model` (transformers builds the synthetic
preset's architecture; accelerate's ``infer_auto_device_map`` / ``dispatch_model`` place and offload it, whole
decoder layers at a time).

Decode: a warm-up (one prompt, prefill + 2 steps), then ``--batch`` prompts of ``--prompt-tokens`` random ids
(the same ids as ``ferry bench decode --seed S``) are prefilled (the first token, untimed) and decoded for
``--tokens`` greedy steps with ``past_key_values`` — the timing ``ferry bench decode`` uses (``tokens`` timed
steps after the prefill; each sequence ends with ``1 + tokens`` tokens). tok/s = batch * tokens / decode seconds.
EOS is not special (ignore_eos). ``skew`` in the spec is ignored: transformers' router has no bias, and the bytes
accelerate moves do not depend on routing.

``--device cpu``: accelerate offloads to "cpu" only when the main device is an accelerator, so on the CPU the same
hooks are attached by hand (:func:`dispatch`): offloaded modules live in a weights map and are re-attached at each
forward. That exercises the mechanism (and the tokens) in CI; speed means nothing there.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ferrylm.bench.accelerate_model import (GiB, build_empty, describe_placement, dispatch, granularity_line,
                                            hf_config, materialize_, plan_device_map)
from ferrylm.bench.common import bench_prompts, sync, token_checksum
from ferrylm.bench.report import report

INSTALL_HINT = "pip install 'ferrylm[bench]'"


class MissingAccelerate(RuntimeError):
    pass


def require_accelerate():
    """Import accelerate, or raise :class:`MissingAccelerate` naming the extra that installs it."""
    try:
        import accelerate
    except ImportError:
        raise MissingAccelerate(f"the accelerate baseline needs the 'accelerate' package: {INSTALL_HINT}") from None
    return accelerate


def greedy_decode(model, prompts, tokens: int, device, step_times: list[float] | None = None, progress=None):
    """Prefill ``prompts`` ([B, T] ids) for the first token, then ``tokens`` greedy steps with the KV cache
    (``progress`` gets a line every eighth of them). Returns (ids [B, 1 + tokens] on the CPU, prefill seconds,
    decode seconds)."""
    import torch

    with torch.no_grad():
        ids = prompts.to(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        past = out.past_key_values
        got = [nxt.cpu()]
        sync(device)
        t1 = time.perf_counter()
        every = max(1, tokens // 8)
        for i in range(tokens):
            ts = time.perf_counter()
            out = model(input_ids=nxt[:, None].to(device), past_key_values=past, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1)
            past = out.past_key_values
            got.append(nxt.cpu())  # a host sync per step, as a server would have
            if step_times is not None:
                step_times.append(time.perf_counter() - ts)
            if progress is not None and (i + 1) % every == 0:
                progress(f"  step {i + 1}/{tokens}: {1000 * (time.perf_counter() - ts):.0f} ms")
        sync(device)
        t2 = time.perf_counter()
    return torch.stack(got, dim=1), t1 - t0, t2 - t1


def bench_prompt_tensors(vocab_size: int, batch: int, prompt_tokens: int, seed: int):
    """``(prompts [batch, prompt_tokens], warm [1, prompt_tokens])`` int64: the ids ``ferry bench decode --seed
    seed`` uses (:func:`ferrylm.bench.common.bench_prompts`)."""
    import torch

    prompts, warm = bench_prompts(vocab_size, batch, prompt_tokens, seed)
    return torch.tensor(prompts), torch.tensor(warm)


def _ranges(idx: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(idx):
        if start is None:
            start = v
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


@dataclass
class AccelerateResult:
    """One ``ferry bench accelerate`` run. Units: ``tok_s`` generated tokens per second over all prompts;
    ``ms_per_token`` milliseconds per decode step (one token per prompt); ``*_s`` seconds; ``*_bytes`` bytes;
    ``*_gib`` GiB. ``h2d_bytes_per_step`` is derived, not measured: the bytes of every offloaded module (accelerate
    copies each of them once per forward), and ``h2d_gb_s_effective`` those bytes over the decode time.
    ``placement``: :func:`describe_placement`."""

    model: str
    device: str
    dtype: str
    batch: int
    prompt_tokens: int
    tokens: int
    gpu_memory_limit_gib: float | None
    reserve_gib: float
    transformers: str = ""
    accelerate: str = ""
    architecture: str = ""
    attn_implementation: str = ""
    experts_implementation: str = ""
    tok_s: float = 0.0
    ms_per_token: float = 0.0
    ms_per_step_median: float = 0.0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    build_s: float = 0.0
    placement: dict = field(default_factory=dict)
    h2d_bytes_per_step: int = 0
    h2d_gb_s_effective: float = 0.0
    peak_gpu_allocated_bytes: int = 0
    host_rss_bytes: int = 0
    checksum: str = ""
    token_ids: list = field(default_factory=list)
    notes: list = field(default_factory=list)


def run_accelerate_bench(*, model, device: str = "auto", dtype: str = "bfloat16", gpu_memory_limit: float | None,
                         batch: int = 1, tokens: int = 32, prompt_tokens: int = 16, seed: int = 0,
                         reserve: float = 1.0, cpu_memory_limit: float | None = None, progress=print,
                         keep_model: bool = False) -> AccelerateResult | tuple[AccelerateResult, Any]:
    """Run the baseline (module docstring). ``model``: a ``synthetic:`` spec string or a
    :class:`~ferrylm.synthetic.spec.SyntheticSpec`. ``gpu_memory_limit``, ``reserve``, ``cpu_memory_limit``: GiB
    (``gpu_memory_limit`` None = no offload, all on the device). ``batch`` prompts of ``prompt_tokens`` ids, then
    ``tokens`` greedy decode steps. ``keep_model`` also returns the dispatched model (tests).

    Raises:
        MissingAccelerate: accelerate is not installed. ModelLoadError / ValueError: a bad spec.
        RuntimeError: the placement would need disk offload (host budget too small); torch.OutOfMemoryError: the
            placement does not fit after all."""
    accelerate = require_accelerate()
    import torch
    import transformers

    from ferrylm.synthetic.spec import SyntheticSpec, parse_synthetic_spec

    spec = model if isinstance(model, SyntheticSpec) else parse_synthetic_spec(model)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    main = torch.device(device)
    if main.type == "cuda" and main.index is None:
        main = torch.device("cuda", torch.cuda.current_device())
    res = AccelerateResult(model=spec.name, device=str(main), dtype=dtype, batch=batch, prompt_tokens=prompt_tokens,
                           tokens=tokens, gpu_memory_limit_gib=gpu_memory_limit, reserve_gib=reserve,
                           transformers=transformers.__version__, accelerate=accelerate.__version__)
    if spec.skew:
        res.notes.append(f"skew={spec.skew:g} ignored: transformers' router has no bias, and accelerate moves whole "
                         f"layers whatever the routing")
    net = _build(spec, main, getattr(torch, dtype), res, gpu_memory_limit, reserve, cpu_memory_limit, progress)
    prompts, warm = bench_prompt_tensors(net.config.vocab_size, batch, prompt_tokens, seed)
    greedy_decode(net, warm, 2, main)
    progress(f"decoding {batch} x {tokens} tokens ...")
    _decode(net, prompts, main, res, progress)
    return (res, net) if keep_model else res


def _build(spec, main, tdtype, res: AccelerateResult, gpu_memory_limit: float | None, reserve: float,
           cpu_memory_limit: float | None, progress):
    """The dispatched model of ``spec`` on ``main`` under the GPU budget (``res`` gets the placement, the build
    time and the implementations)."""
    import torch

    t = time.perf_counter()
    net = build_empty(hf_config(spec), tdtype)
    res.architecture = type(net).__name__
    budget = None if gpu_memory_limit is None else int((gpu_memory_limit - reserve) * GiB)
    cpu_budget = int((cpu_memory_limit if cpu_memory_limit is not None else 1024) * GiB)
    dm = plan_device_map(net, budget, cpu_budget, tdtype)
    pl = describe_placement(net, dm)
    res.placement = pl
    progress(f"plan: {len(pl['gpu_layers'])} of {pl['num_layers']} decoder layers on {main} "
             f"({pl['gpu_bytes'] / GiB:.2f} GiB), {len(pl['offloaded_layers'])} offloaded to host memory "
             f"({pl['offloaded_bytes'] / GiB:.2f} GiB of host RAM for them); materializing ...")
    materialize_(net, dm, main, seed=spec.seed)
    dispatch(net, dm, main)
    if main.type == "cuda":
        torch.cuda.empty_cache()
        if gpu_memory_limit is not None:  # as ferrylm: the caching allocator itself is capped
            total = torch.cuda.get_device_properties(main).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_memory_limit * GiB / total), main)
        torch.cuda.reset_peak_memory_stats(main)
    res.build_s = time.perf_counter() - t
    res.attn_implementation = str(getattr(net.config, "_attn_implementation", ""))
    res.experts_implementation = str(getattr(net.config, "_experts_implementation", ""))
    progress(f"built and dispatched in {res.build_s:.1f} s; warm-up ...")
    return net


def _decode(net, prompts, main, res: AccelerateResult, progress) -> None:
    """The timed greedy decode of ``prompts``; fills ``res``'s rates, traffic, memory and tokens."""
    import psutil
    import torch

    tokens = res.tokens
    steps: list[float] = []
    ids, res.prefill_s, res.decode_s = greedy_decode(net, prompts, tokens, main, steps, progress)
    n = res.batch * tokens
    res.tok_s = n / res.decode_s if res.decode_s > 0 else float("inf")
    res.ms_per_token = 1000 * res.decode_s / max(1, tokens)  # per decode step (one token per sequence)
    res.ms_per_step_median = 1000 * sorted(steps)[len(steps) // 2] if steps else 0.0
    res.h2d_bytes_per_step = res.placement["offloaded_bytes"] if main.type == "cuda" else 0
    if res.decode_s > 0 and main.type == "cuda":
        res.h2d_gb_s_effective = res.h2d_bytes_per_step * tokens / res.decode_s / 1e9
    if main.type == "cuda":
        res.peak_gpu_allocated_bytes = torch.cuda.max_memory_allocated(main)
    res.host_rss_bytes = psutil.Process().memory_info().rss
    res.token_ids = ids.tolist()
    res.checksum = token_checksum(res.token_ids)


def format_table(r: AccelerateResult) -> str:
    pl = r.placement
    lim = "none (all on the device)" if r.gpu_memory_limit_gib is None else \
        f"{r.gpu_memory_limit_gib:g} GiB (accelerate weight budget {r.gpu_memory_limit_gib - r.reserve_gib:g} GiB)"
    gpu_mods = ", ".join(m for m in pl["gpu_modules"] if m) or "-"
    cpu_mods = ", ".join(pl["offloaded_modules"]) or "-"
    rows = [
        ("tok/s", f"{r.tok_s:.3f}"),
        ("ms per decode step (mean / median)", f"{r.ms_per_token:.1f} / {r.ms_per_step_median:.1f}"),
        ("prefill s", f"{r.prefill_s:.2f}"),
        ("decoder layers on device", f"{len(pl['gpu_layers'])} of {pl['num_layers']} "
                                     f"[{_ranges(pl['gpu_layers']) or '-'}]"),
        ("decoder layers offloaded", f"{len(pl['offloaded_layers'])} [{_ranges(pl['offloaded_layers']) or '-'}]"),
        ("other modules on device / offloaded", f"{gpu_mods} / {cpu_mods}"),
        ("weights on device", f"{pl['gpu_bytes'] / GiB:.2f} GiB"),
        ("weights offloaded (host)", f"{pl['offloaded_bytes'] / GiB:.2f} GiB"),
        ("H2D per decode step", f"{r.h2d_bytes_per_step / 1e9:.2f} GB (effective {r.h2d_gb_s_effective:.1f} GB/s)"),
        ("peak device allocated", f"{r.peak_gpu_allocated_bytes / GiB:.2f} GiB"),
        ("host RSS", f"{r.host_rss_bytes / GiB:.2f} GiB"),
        ("build + dispatch s", f"{r.build_s:.1f}"),
        ("checksum", r.checksum),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"accelerate offload baseline: {r.model}  {r.architecture}  device {r.device} {r.dtype}  batch {r.batch}"
             f"  prompt {r.prompt_tokens}  tokens {r.tokens}  gpu limit {lim}",
             f"transformers {r.transformers}, accelerate {r.accelerate}; attention {r.attn_implementation}, experts "
             f"{r.experts_implementation}; offloaded weights in pageable host memory, copied per forward by "
             f"accelerate's hooks",
             granularity_line(pl)]
    lines += [f"note: {n}" for n in r.notes]
    lines += [f"{k:<{w}}  {v}" for k, v in rows]
    return "\n".join(lines)


def result_json(r: AccelerateResult) -> dict:
    """The one-line JSON result (token ids left out; the checksum stands for them)."""
    d = {k: v for k, v in r.__dict__.items() if k != "token_ids"}
    d["baseline"] = "transformers+accelerate"
    return d


def main(args) -> int:
    """``ferry bench accelerate``."""
    from ferrylm.errors import ModelLoadError
    from ferrylm.synthetic.spec import is_synthetic_spec, parse_synthetic_spec

    for flag, v in (("--batch", args.batch), ("--tokens", args.tokens), ("--prompt-tokens", args.prompt_tokens)):
        if v < 1:
            print(f"ferry bench accelerate: {flag} must be >= 1", file=sys.stderr)
            return 2
    if args.gpu_memory_limit is not None and args.gpu_memory_limit <= args.reserve:
        print(f"ferry bench accelerate: --gpu-memory-limit must exceed --reserve ({args.reserve:g} GiB)",
              file=sys.stderr)
        return 2
    if not is_synthetic_spec(args.model):
        print("ferry bench accelerate: --model takes a synthetic:<preset>[:layers=N] spec (see `ferry models`)",
              file=sys.stderr)
        return 2
    try:
        spec = parse_synthetic_spec(args.model)
        require_accelerate()
    except ModelLoadError as e:
        print(f"ferry bench accelerate: {e.message}", file=sys.stderr)
        return 2
    except MissingAccelerate as e:
        print(f"ferry bench accelerate: {e}", file=sys.stderr)
        return 2
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()  # e.g. 5.24's past_key_values -> cache rename notice
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    try:
        res = run_accelerate_bench(model=spec, device=args.device, dtype=args.dtype,
                                   gpu_memory_limit=args.gpu_memory_limit, batch=args.batch, tokens=args.tokens,
                                   prompt_tokens=args.prompt_tokens, seed=args.seed, reserve=args.reserve,
                                   cpu_memory_limit=args.cpu_memory_limit,
                                   progress=lambda s: print(s, file=sys.stderr, flush=True))
    except RuntimeError as e:  # OOM under the cap, a plan that needs disk
        print(f"ferry bench accelerate: {type(e).__name__}: {str(e).splitlines()[0][:300]}", file=sys.stderr)
        return 1
    print(format_table(res))
    out = result_json(res)
    report(json.dumps(out), {**out, "token_ids": res.token_ids}, args.output_json)
    return 0
