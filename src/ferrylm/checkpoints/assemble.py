"""What every loader shares: where routed experts are assembled (:func:`placement`), the expert stacks and
biases filled from checkpoint tensors, checkpoint names mapped onto the model's, and the model built on ``meta``
over its executor with every parameter assigned (:func:`finish_model`).

Expert layouts accepted (per MoE layer N, block named ``block_sparse_moe`` or ``mlp``):
  * per expert: ``model.layers.N.<block>.experts.E.{w1,w3,w2}.weight`` (Mixtral) or
    ``….experts.E.{gate_proj,up_proj,down_proj}.weight`` (Qwen-MoE), each ``[I, H]`` / ``[I, H]`` / ``[H, I]``.
  * fused (transformers v5 in-memory layout, written by ``save_pretrained(save_original_format=False)``):
    ``….experts.gate_up_proj [E, 2I, H]`` (gate rows first, then up) and ``….experts.down_proj [E, H, I]``.
  * gpt-oss (a model class with ``fused_experts = "gpt_oss"``): ``….experts.gate_up_proj [E, H, 2I]`` (transposed,
    gate and up columns interleaved), ``….experts.down_proj [E, I, H]``, and the biases
    ``….experts.gate_up_proj_bias [E, 2I]`` / ``….experts.down_proj_bias [E, H]`` (:class:`ExpertBiasAssembler`,
    which the quantized path shares).
"""

from __future__ import annotations

import re
from collections.abc import Container
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ferrylm.checkpoints.ple_tables import PleAssembler
from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts import ExpertOptions, build_executor, check_backend, expert_home
from ferrylm.experts.executor import ClampedSwiGLU, ExpertExecutor, ExpertMath, LayerExperts
from ferrylm.models.registry import get_model_class

_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
_BIAS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_bias$")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_PART_NAMES = {"gate": "w1 / gate_proj", "up": "w3 / up_proj", "down": "w2 / down_proj"}


@dataclass
class LoadedModel:
    """A loaded model. ``executor`` runs the routed experts (None for dense models)."""

    model: nn.Module
    config: ModelConfig
    executor: ExpertExecutor | None


class ExpertAssembler:
    """Collects routed-expert tensors into preallocated per-layer stacks and tracks which slots are filled.

    Args:
        layers: decoder layers that hold routed experts.
        num_experts, hidden_size, intermediate_size: ``E``, ``H``, ``I``.
        device, dtype: where and how the stacks are stored.
        pin_memory: allocate the stacks in page-locked host memory (``device`` must be the CPU).
    """

    def __init__(self, layers: tuple[int, ...], num_experts: int, hidden_size: int, intermediate_size: int,
                 device: torch.device, dtype: torch.dtype, pin_memory: bool = False, fused: str = "halves"):
        e, h, i = num_experts, hidden_size, intermediate_size
        self.fused = fused  # "halves" (transformers' fused layout) or "gpt_oss" (module docstring)
        self.shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
        self.num_experts = e

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, device=device, dtype=dtype, pin_memory=pin_memory)

        self.stacks = {n: LayerExperts(gate=empty(e, i, h), up=empty(e, i, h), down=empty(e, h, i)) for n in layers}
        self.filled: dict[tuple[int, str], set[int]] = {(n, p): set() for n in layers for p in self.shapes}

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Place ``tensor`` if ``name`` is a routed-expert tensor; return False if it is not one.

        Raises:
            ModelLoadError: expert tensor of a non-MoE layer, expert id out of range, wrong shape, duplicate.
        """
        m = _PER_EXPERT.match(name)
        if m:
            layer, expert, part = int(m[1]), int(m[2]), _PART[m[3]]
            self._put(name, layer, part, [expert], tensor[None])
            return True
        m = _FUSED.match(name)
        if not m:
            return False
        layer, experts = int(m[1]), list(range(self.num_experts))
        if self.fused == "gpt_oss":  # [E, K, N] -> [E, N, K]; gate / up columns interleaved
            tensor = tensor.transpose(1, 2)
            if m[2] == "gate_up_proj":
                self._put(name, layer, "gate", experts, tensor[:, 0::2])
                self._put(name, layer, "up", experts, tensor[:, 1::2])
                return True
        if m[2] == "down_proj":
            self._put(name, layer, "down", experts, tensor)
            return True
        i = self.shapes["gate"][0]
        if tensor.ndim != 3 or tensor.shape[1] != 2 * i:
            raise ModelLoadError(f"{name}: expected shape [{self.num_experts}, {2 * i}, {self.shapes['gate'][1]}] "
                                 f"(gate rows then up rows), got {list(tensor.shape)}")
        self._put(name, layer, "gate", experts, tensor[:, :i])
        self._put(name, layer, "up", experts, tensor[:, i:])
        return True

    def _put(self, name: str, layer: int, part: str, experts: list[int], tensor: torch.Tensor) -> None:
        check_expert_ids(name, layer, experts, self.stacks, self.num_experts)
        stack = self.stacks[layer]
        want = (len(experts), *self.shapes[part])
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"checkpoint tensor {name!r}: expected shape {list(want)}, got "
                                 f"{list(tensor.shape)}")
        done = unfilled(self.filled, name, layer, part, experts)
        getattr(stack, part)[experts[0]:experts[-1] + 1].copy_(tensor)
        done.update(experts)

    def finish(self) -> dict[int, LayerExperts]:
        """The completed stacks. Raises ModelLoadError naming the first missing expert tensor."""
        check_experts_complete(self.filled, self.num_experts)
        return self.stacks


class ExpertBiasAssembler:
    """gpt-oss's expert biases (``….experts.gate_up_proj_bias [E, 2I]``, gate / up interleaved, and
    ``….experts.down_proj_bias [E, H]``), collected per layer and attached to the stacks as their
    :class:`~ferrylm.experts.executor.ExpertMath` with the model's clamped SwiGLU.

    Args:
        layers: MoE decoder layers. num_experts, hidden_size, intermediate_size: ``E``, ``H``, ``I``.
        swiglu: the :class:`~ferrylm.experts.executor.ClampedSwiGLU`. dtype: the biases' dtype.
    """

    def __init__(self, layers: tuple[int, ...], num_experts: int, hidden_size: int, intermediate_size: int,
                 swiglu: ClampedSwiGLU, dtype: torch.dtype):
        self.layers = layers
        self.shapes = {"gate_up_proj": (num_experts, 2 * intermediate_size), "down_proj": (num_experts, hidden_size)}
        self.swiglu, self.dtype = swiglu, dtype
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` if ``name`` is an expert bias; False if it is not one.

        Raises:
            ModelLoadError: a bias of a layer without experts, a wrong shape, a duplicate.
        """
        m = _BIAS.match(name)
        if not m:
            return False
        layer, kind = int(m[1]), m[2]
        if layer not in self.layers:
            raise ModelLoadError(f"checkpoint tensor {name!r}: layer {layer} has no routed experts")
        if tuple(tensor.shape) != self.shapes[kind]:
            raise ModelLoadError(f"checkpoint tensor {name!r}: expected shape {list(self.shapes[kind])}, got "
                                 f"{list(tensor.shape)}")
        if (layer, kind) in self.tensors:
            raise ModelLoadError(f"checkpoint tensor {name!r} appears twice")
        self.tensors[(layer, kind)] = tensor.to(self.dtype)
        return True

    def attach(self, stacks: dict[int, LayerExperts]) -> dict[int, LayerExperts]:
        """Set every layer's ``math``. Raises ModelLoadError naming the first missing bias."""
        for layer in self.layers:
            for kind in self.shapes:
                if (layer, kind) not in self.tensors:
                    raise ModelLoadError(f"checkpoint lacks model.layers.{layer}.mlp.experts.{kind}_bias")
            gu = self.tensors[(layer, "gate_up_proj")]
            stacks[layer].math = ExpertMath(gu[:, 0::2].contiguous(), gu[:, 1::2].contiguous(),
                                            self.tensors[(layer, "down_proj")].contiguous(), *self.swiglu)
        return stacks


def check_expert_ids(name: str, layer: int, experts: list[int], layers: Container[int], num_experts: int) -> None:
    """Raise ModelLoadError (naming checkpoint tensor ``name``) unless ``layer`` is one of ``layers`` (those with
    routed experts) and the ascending ids ``experts`` stay below ``num_experts``."""
    if layer not in layers:
        raise ModelLoadError(f"checkpoint tensor {name!r}: layer {layer} has no routed experts")
    if experts[-1] >= num_experts:
        raise ModelLoadError(f"checkpoint tensor {name!r}: expert {experts[-1]} out of range "
                             f"(num_experts={num_experts})")


def unfilled(filled: dict[tuple[int, str], set[int]], name: str, layer: int, part: str,
             experts: list[int]) -> set[int]:
    """The set of expert ids loaded for ``(layer, part)``, which the caller updates with ``experts`` once copied.
    Raises ModelLoadError when tensor ``name`` loads any of them again."""
    done = filled[(layer, part)]
    if done.intersection(experts):
        raise ModelLoadError(f"checkpoint tensor {name!r} duplicates expert weights already loaded")
    return done


def check_experts_complete(filled: dict[tuple[int, str], set[int]], num_experts: int) -> None:
    """``filled``: (layer, part) -> the expert ids loaded. Raises ModelLoadError naming the first missing expert."""
    for (layer, part), done in sorted(filled.items()):
        missing = sorted(set(range(num_experts)) - done)
        if missing:
            raise ModelLoadError(f"checkpoint lacks routed expert weights: model.layers.{layer} expert "
                                 f"{missing[0]} {part} projection ({_PART_NAMES[part]})")


def expert_assemblers(model_cls: type, config: ModelConfig, moe_layers: tuple[int, ...], device: torch.device,
                      dtype: torch.dtype, pin: bool) -> tuple[ExpertAssembler | None, ExpertBiasAssembler | None]:
    """The plain expert stacks' assembler of ``model_cls``'s layout and, for gpt-oss, the bias assembler (None:
    dense model / experts without biases)."""
    if not moe_layers:
        return None, None
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    experts = ExpertAssembler(moe_layers, e, h, i, device, dtype, pin_memory=pin, fused=model_cls.fused_experts)
    biases = (ExpertBiasAssembler(moe_layers, e, h, i, model_cls.expert_swiglu(config), dtype)
              if model_cls.fused_experts == "gpt_oss" else None)
    return experts, biases


def module_name(name: str, model_cls: type, config: ModelConfig) -> str | None:
    """Map a checkpoint name onto the model's state-dict name; None for tensors that are deliberately skipped
    (cached RoPE frequencies; ``lm_head.weight`` of a tied model)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if config.tie_word_embeddings and name == "lm_head.weight":
        return None
    for old, new in model_cls.hf_renames:
        name = name.replace(old, new)
    return name


def renamed(name: str, model_cls: type) -> str:
    """``name`` with the class's ``hf_renames`` applied (an expert tensor under a prefix the class renames, e.g. a
    multimodal checkpoint's ``model.language_model.layers.N.mlp.experts...``, is placed like the plain name)."""
    for old, new in model_cls.hf_renames:
        name = name.replace(old, new)
    return name


def tensor_dtype(model_cls: type, key: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a floating checkpoint tensor placed at state-dict name ``key`` is stored in: ``dtype``, or float32
    for the names the class keeps in float32 (``float32_tensors``, e.g. GLM-4.5's ``e_score_correction_bias``)."""
    keep = getattr(model_cls, "float32_tensors", ())
    return torch.float32 if keep and key.endswith(tuple(keep)) else dtype


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor], origin: dict[str, str]) -> None:
    """Assign ``tensors`` onto the meta-built ``model``; every parameter filled, nothing left over."""
    expected = model.state_dict()
    for key, t in tensors.items():
        if key not in expected:
            raise ModelLoadError(f"checkpoint tensor {origin[key]!r} has no place in "
                                 f"{type(model).__name__}")
        if tuple(t.shape) != tuple(expected[key].shape):
            raise ModelLoadError(f"checkpoint tensor {origin[key]!r}: expected shape "
                                 f"{list(expected[key].shape)}, got {list(t.shape)}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensor {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    model.load_state_dict(tensors, strict=True, assign=True)


def placement(config: ModelConfig, device: torch.device | str, moe_backend: str | ExpertOptions,
              expert_device: torch.device | str | None, pin_experts: bool) -> tuple[type, torch.device,
                                                                                  torch.device, bool]:
    """Shared by :func:`~ferrylm.checkpoints.loader.load_model`, the GGUF reader and the synthetic builder: check the config against its model class and the
    backend name, and decide where routed experts are assembled.

    Returns ``(model class, compute device, expert device, pin)``; ``pin`` is True only for CPU expert stacks when
    CUDA is available. Raises UnsupportedArchitecture / ModelLoadError (config) or ValueError (backend).
    """
    model_cls = get_model_class(config.architecture)
    model_cls.check_config(config)
    check_backend(moe_backend)
    device = torch.device(device)
    exp_dev = expert_home(moe_backend, device) if expert_device is None else torch.device(expert_device)
    return model_cls, device, exp_dev, bool(pin_experts and exp_dev.type == "cpu" and torch.cuda.is_available())


def prepare_for_inference(model: torch.nn.Module) -> torch.nn.Module:
    """Inference-only layout changes after the weights are in place: the projections a module computes from one
    input become one matrix multiply (every attention layer's q/k/v,
    :meth:`~ferrylm.models.layers.Attention.fuse_projections`; the :class:`~ferrylm.models.quant_linear.FusedLinears`
    modules: a gated MLP's gate/up, a Gated DeltaNet's input projections). Returns ``model``."""
    from ferrylm.models.layers import Attention
    from ferrylm.models.quant_linear import FusedLinears

    fused: set[int] = set()   # each linear layer joins one product: the outermost module's (modules() is preorder)
    for m in model.modules():
        if isinstance(m, Attention):
            m.fuse_projections()
        elif isinstance(m, FusedLinears):
            children = {id(c) for c in m.fused_children()}
            if not children & fused:
                m.fuse_projections()
                if m.is_fused:
                    fused |= children
    return model


def ple_assembler(model_cls: type, config: ModelConfig, backend: str, device: torch.device,
                  dtype: torch.dtype):
    """The :class:`~ferrylm.checkpoints.ple_tables.PleAssembler` of a model with per-layer embeddings, else None."""
    shape_of = getattr(model_cls, "ple_shape", None)   # only Qwen4-Exp has per-layer embeddings
    shape = shape_of(config) if shape_of is not None else None
    if shape is None:
        return None
    return PleAssembler(shape.layers, backend, device, dtype, pin=torch.cuda.is_available())


class _MetaNoInit(TorchFunctionMode):
    """``torch.nn.init``'s random fills skipped for meta tensors, which hold no values to fill (torch's meta
    ``normal_`` imports its decomposition and compiler stack on first use: about 1.5 s of a start)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_INITS:
            t = kwargs.get("tensor", args[0] if args else None)
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


_RANDOM_INITS = frozenset({nn.init.normal_, nn.init.trunc_normal_})


def build_on_meta(model_cls: type, config: ModelConfig, executor: ExpertExecutor | None, device: torch.device):
    """``model_cls(config, executor=, device=)`` with its parameters on ``meta`` (the checkpoint's tensors are
    assigned next), no random initialisation run."""
    with _MetaNoInit(), torch.device("meta"):
        return model_cls(config, executor=executor, device=device)


def finish_model(model_cls: type, config: ModelConfig, device: torch.device, moe_backend, stacks, tensors: dict,
            origin: dict, ple_tables: dict | None = None, adapt=None) -> LoadedModel:
    """Build the executor over the expert ``stacks`` (None: dense) and the model on ``meta``, assign ``tensors``
    (and hand a PLE model its tables). A family whose experts clamp without biases (DeepSeek-V4) gets its
    :class:`ExpertMath` here. ``adapt(model) -> (tensors, origin)``: a reader's own modules put in place on the meta
    model before the assignment (a GGUF's compact layers, ``checkpoints/quant/gguf_file.py``), with the tensors of
    the weights it left to assign."""
    swiglu = model_cls.expert_swiglu(config)
    for layer in (stacks or {}).values():
        if swiglu is not None and layer.math is None:
            layer.math = ExpertMath.unbiased(layer.num_experts, config.hidden_size, config.moe_intermediate_size,
                                             swiglu, layer.dtype, device)
    executor = build_executor(moe_backend, stacks, device) if stacks is not None else None
    model = build_on_meta(model_cls, config, executor, device)
    if adapt is not None:
        more, more_origin = adapt(model)
        tensors, origin = {**tensors, **more}, {**origin, **more_origin}
    _assign(model, tensors, origin)
    if ple_tables is not None:
        model.use_ple_tables(ple_tables)
    model.requires_grad_(False)
    model.eval()
    prepare_for_inference(model)
    return LoadedModel(model=model, config=config, executor=executor)
