"""The transformers model of ``ferry bench accelerate`` and accelerate's placement of it.

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
"""

from __future__ import annotations

import logging
from typing import Any

GPU = "gpu"  # device-map value for "on the main device" before it is resolved to a CUDA index
GiB = 2**30
_FERRYLM_KEYS = ("ferrylm_synthetic", "ferrylm_router_bias", "architectures", "torch_dtype", "dtype", "model_type")

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
