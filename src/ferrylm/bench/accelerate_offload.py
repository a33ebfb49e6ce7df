"""``ferry bench accelerate``: the comparison baseline: the same architecture and GPU cap through
transformers + accelerate offload (``device_map`` with ``max_memory``), greedy decode tok/s.

How the model is made (peak host RAM ~ the offloaded bytes, never the model twice):

1. The ``synthetic:<preset>[:layers=N]`` spec gives the HF config (:func:`hf_config`); transformers builds the
   model class (``AutoModelForCausalLM.from_config``, e.g. ``Qwen3MoeForCausalLM``) on the meta device under
   accelerate's ``init_empty_weights`` (parameters meta, buffers such as RoPE's ``inv_freq`` real).
2. ``accelerate.infer_auto_device_map(max_memory={gpu: limit - reserve, "cpu": ...},
   no_split_module_classes=model._no_split_modules)`` decides the placement. accelerate keeps room on the GPU for
   the largest offloaded block, to load it at forward time; ``--reserve`` (default 1 GiB) is left out of its budget
   for the KV cache and activations.
3. Every parameter is allocated directly on its device and filled with seeded random values (norms 1, biases 0,
   embeddings N(0, 1), every other matrix N(0, 1/fan_in): ferrylm's synthetic scales without its residual
   scaling and router normalisation — the values change nothing that accelerate moves, and tokens are not compared
   with ferrylm's); on CUDA the offloaded ones are drawn on the GPU and copied into (pageable) host tensors.
4. ``accelerate.dispatch_model(model, device_map, main_device)`` attaches accelerate's hooks: an offloaded module's
   weights stay in host memory and are copied to the GPU at the start of each of its forwards and dropped after
   it (accelerate's CPU offload; copies are synchronous, from pageable memory, as accelerate does them).

Granularity: transformers 5.x stores a MoE layer's routed experts as fused 3D parameters (``Qwen3MoeExperts``:
``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and declares the decoder layer unsplittable
(``_no_split_modules``), so accelerate places and moves whole decoder layers: every decode step copies every
offloaded layer, all its experts included, whichever top-k the router picks. The printed table states the unit.

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
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ferrylm.bench.common import bench_prompts, sync, token_checksum

GPU = "gpu"  # device-map value for "on the main device" before it is resolved to a CUDA index
GiB = 2**30
_FERRYLM_KEYS = ("ferrylm_synthetic", "ferrylm_router_bias", "architectures", "torch_dtype", "dtype", "model_type")
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


def hf_config(spec):
    """The transformers config of a :class:`~ferrylm.synthetic.spec.SyntheticSpec` (its ``layers`` applied)."""
    import transformers

    from ferrylm.synthetic.spec import synthetic_config

    cfg = synthetic_config(spec)
    model_type = cfg["model_type"]
    for k in _FERRYLM_KEYS:
        cfg.pop(k, None)
    return transformers.AutoConfig.for_model(model_type, **cfg)


def build_empty(config, dtype):
    """The transformers model of ``config`` with every parameter on the meta device (buffers real, on the CPU)."""
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def module_for(name: str, device_map: dict[str, Any]) -> str:
    """The device-map key that covers parameter / module ``name`` (the longest matching prefix; ``""`` covers all).
    Raises KeyError when none does."""
    best = None
    for k in device_map:
        if k == "" or name == k or name.startswith(k + "."):
            if best is None or len(k) > len(best):
                best = k
    if best is None:
        raise KeyError(f"{name} is not covered by the device map")
    return best


def plan_device_map(model, gpu_budget_bytes: int | None, cpu_budget_bytes: int, dtype) -> dict[str, str]:
    """accelerate's placement: ``{module name: GPU | "cpu"}``. ``gpu_budget_bytes`` None = everything on the GPU.

    Raises:
        RuntimeError: the host budget is too small too (accelerate would spill to disk).
    """
    if gpu_budget_bytes is None:
        return {"": GPU}
    from accelerate import infer_auto_device_map

    acc_log = logging.getLogger("accelerate.utils.modeling")
    level = acc_log.level
    acc_log.setLevel(logging.ERROR)  # "Device 0 is not available" on a CPU-only machine: the plan is still right
    try:
        dm = infer_auto_device_map(model, max_memory={0: max(0, gpu_budget_bytes), "cpu": cpu_budget_bytes},
                                   no_split_module_classes=list(model._no_split_modules or []), dtype=dtype)
    finally:
        acc_log.setLevel(level)
    if any(v == "disk" for v in dm.values()):
        raise RuntimeError(f"accelerate would offload to disk: the host budget ({cpu_budget_bytes / GiB:.1f} GiB, "
                           f"--cpu-memory-limit) is too small for the offloaded layers")
    return {k: (GPU if v == 0 else "cpu") for k, v in dm.items()}


def _fill_(t, name: str, generator) -> None:
    if t.dim() == 1:
        t.fill_(1.0 if "norm" in name else 0.0)
    elif "embed" in name:
        t.normal_(0.0, 1.0, generator=generator)
    else:
        t.normal_(0.0, t.shape[-1] ** -0.5, generator=generator)


def materialize_(model, device_map: dict[str, str], main_device, seed: int = 0) -> None:
    """Give every meta parameter of ``model`` a real tensor on its device of ``device_map`` (GPU = ``main_device``),
    seeded random values (module docstring). Offloaded parameters are drawn on ``main_device`` and copied to host
    memory one tensor at a time, so nothing exists twice beyond one tensor."""
    import torch

    gens = {}

    def gen(dev):
        key = str(dev)
        if key not in gens:
            gens[key] = torch.Generator(device=dev).manual_seed(seed)
        return gens[key]

    with torch.no_grad():
        for name, p in list(model.named_parameters()):
            if p.device.type != "meta":
                continue
            target = main_device if device_map[module_for(name, device_map)] == GPU else torch.device("cpu")
            t = torch.empty(p.shape, dtype=p.dtype, device=main_device)
            _fill_(t, name, gen(main_device))
            if t.device != target:
                t = t.to(target)
            mod_name, _, leaf = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        for name, b in list(model.named_buffers()):
            if b.device.type == "meta":  # persistent buffers (none in these families): zeros
                mod_name, _, leaf = name.rpartition(".")
                model.get_submodule(mod_name)._buffers[leaf] = torch.zeros(b.shape, dtype=b.dtype)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def dispatch(model, device_map: dict[str, str], main_device):
    """accelerate's dispatch of ``model`` over ``device_map``. CUDA: ``accelerate.dispatch_model``. CPU: the hooks
    ``dispatch_model`` attaches for a CUDA main device, with the CPU as execution device (module docstring)."""
    import torch
    from accelerate import dispatch_model

    if main_device.type == "cuda":
        idx = main_device.index if main_device.index is not None else torch.cuda.current_device()
        dm = {k: (idx if v == GPU else "cpu") for k, v in device_map.items()}
        return dispatch_model(model, device_map=dm, main_device=torch.device("cuda", idx))
    if all(v == GPU for v in device_map.values()):
        return model
    from accelerate.hooks import attach_align_device_hook_on_blocks
    from accelerate.utils import OffloadedWeightsLoader, extract_submodules_state_dict

    cpu_modules = [k for k, v in device_map.items() if v == "cpu"]
    state_dict = extract_submodules_state_dict(model.state_dict(), cpu_modules)
    execution = {k: main_device for k in device_map}
    execution[""] = main_device
    attach_align_device_hook_on_blocks(model, execution_device=execution,
                                       offload={k: v == "cpu" for k, v in device_map.items()},
                                       weights_map=OffloadedWeightsLoader(state_dict=state_dict))
    model.hf_device_map = dict(device_map)
    return model


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


def describe_placement(model, device_map: dict[str, str]) -> dict:
    """Counts and bytes per side, decoder layers per side, and the placement unit / expert storage."""
    import torch

    layer_cls = list(model._no_split_modules or [])
    sides: dict[str, dict] = {GPU: {"bytes": 0, "layers": [], "modules": []},
                              "cpu": {"bytes": 0, "layers": [], "modules": []}}
    for name, p in model.named_parameters():
        sides[device_map[module_for(name, device_map)]]["bytes"] += _bytes(p)
    n_layers = model.config.num_hidden_layers
    for i in range(n_layers):
        key = module_for(f"model.layers.{i}", device_map)
        side = device_map[key]
        if key.startswith(f"model.layers.{i}") and key != f"model.layers.{i}":
            side = "split"  # never for families with an unsplittable decoder layer
        sides.setdefault(side, {"bytes": 0, "layers": [], "modules": []})["layers"].append(i)
    for k, v in device_map.items():
        if not k.startswith("model.layers."):
            sides[v]["modules"].append(k.removeprefix("model.") or "(whole model)")
    experts = None
    for name, m in model.named_modules():
        params = dict(m.named_parameters(recurse=False))
        if type(m).__name__.endswith("Experts") and params and all(p.dim() == 3 for p in params.values()):
            experts = {"class": type(m).__name__, "fused": True,
                       "params": {k: list(p.shape) for k, p in params.items()},
                       "bytes_per_layer": sum(_bytes(p) for p in params.values())}
            break
        if isinstance(m, torch.nn.ModuleList) and name.endswith(".experts"):
            experts = {"class": type(m[0]).__name__, "fused": False, "params": {},
                       "bytes_per_layer": sum(_bytes(p) for p in m.parameters())}
            break
    layer_bytes = 0
    if n_layers:
        layer_bytes = sum(_bytes(p) for p in model.model.layers[0].parameters())
    return {"gpu_bytes": sides[GPU]["bytes"], "offloaded_bytes": sides["cpu"]["bytes"],
            "gpu_layers": sides[GPU]["layers"], "offloaded_layers": sides["cpu"]["layers"],
            "gpu_modules": sides[GPU]["modules"], "offloaded_modules": sides["cpu"]["modules"],
            "placement_unit": layer_cls, "layer_bytes": layer_bytes, "experts": experts,
            "num_layers": n_layers}


def granularity_line(pl: dict) -> str:
    unit = "/".join(pl["placement_unit"]) or "(none declared)"
    ex = pl["experts"]
    if ex is None:
        return f"placement unit: {unit} (model._no_split_modules); no routed experts found"
    if ex["fused"]:
        shapes = " + ".join(f"{k} {v}" for k, v in ex["params"].items())
        how = f"fused 3D parameters per layer ({ex['class']}: {shapes})"
    else:
        how = f"one module per expert ({ex['class']}), kept inside the unsplittable layer"
    return (f"placement unit: {unit} (model._no_split_modules), {pl['layer_bytes'] / GiB:.2f} GiB each; routed "
            f"experts stored as {how}, {ex['bytes_per_layer'] / GiB:.2f} GiB/layer -> each decode step copies "
            f"every offloaded layer whole, all its experts included")


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
    import psutil
    import torch
    import transformers

    from ferrylm.synthetic.spec import SyntheticSpec, parse_synthetic_spec

    spec = model if isinstance(model, SyntheticSpec) else parse_synthetic_spec(model)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    main = torch.device(device)
    if main.type == "cuda" and main.index is None:
        main = torch.device("cuda", torch.cuda.current_device())
    tdtype = getattr(torch, dtype)
    res = AccelerateResult(model=spec.name, device=str(main), dtype=dtype, batch=batch, prompt_tokens=prompt_tokens,
                           tokens=tokens, gpu_memory_limit_gib=gpu_memory_limit, reserve_gib=reserve,
                           transformers=transformers.__version__, accelerate=accelerate.__version__)
    if spec.skew:
        res.notes.append(f"skew={spec.skew:g} ignored: transformers' router has no bias, and accelerate moves whole "
                         f"layers whatever the routing")
    t = time.perf_counter()
    cfg = hf_config(spec)
    net = build_empty(cfg, tdtype)
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

    prompts, warm = bench_prompt_tensors(cfg.vocab_size, batch, prompt_tokens, seed)
    greedy_decode(net, warm, 2, main)
    progress(f"decoding {batch} x {tokens} tokens ...")
    steps: list[float] = []
    ids, res.prefill_s, res.decode_s = greedy_decode(net, prompts, tokens, main, steps, progress)
    n = batch * tokens
    res.tok_s = n / res.decode_s if res.decode_s > 0 else float("inf")
    res.ms_per_token = 1000 * res.decode_s / max(1, tokens)  # per decode step (one token per sequence)
    res.ms_per_step_median = 1000 * sorted(steps)[len(steps) // 2] if steps else 0.0
    res.h2d_bytes_per_step = pl["offloaded_bytes"] if main.type == "cuda" else 0
    if res.decode_s > 0 and main.type == "cuda":
        res.h2d_gb_s_effective = res.h2d_bytes_per_step * tokens / res.decode_s / 1e9
    if main.type == "cuda":
        res.peak_gpu_allocated_bytes = torch.cuda.max_memory_allocated(main)
    res.host_rss_bytes = psutil.Process().memory_info().rss
    res.token_ids = ids.tolist()
    res.checksum = token_checksum(res.token_ids)
    return (res, net) if keep_model else res


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
    print(json.dumps(out))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**out, "token_ids": res.token_ids}, f, indent=2)
    return 0
