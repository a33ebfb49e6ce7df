"""Serve a GGUF from the file itself (a MoE, or a dense Llama without routed experts): nothing is converted or
written.

The file is memory-mapped once (``np.memmap``, copy-on-write so torch gets writable views; the file never
changes). Then:

* Routed experts (``blk.N.ffn_{gate,up,down}_exps``, ``[E, I, H]`` / ``[E, H, I]``): a projection whose stacks
  have one GGML block type in every layer (``Q4_K``, ``Q5_K``, ``Q6_K``, ``Q8_0``) keeps the file's bytes: its
  :class:`~ferrylm.experts.quantized.QuantTensor` (a block format, :func:`~ferrylm.experts.quantized.block_format`)
  is a view of the mapped tensor, so an expert's row holds exactly its blocks and offload moves the file's bits
  per weight. A projection whose layers use several K-quant types (llama.cpp's ``Q4_K_M`` puts ``Q6_K`` in some
  layers' ``ffn_down_exps`` and ``Q4_K`` in the others) keeps its bytes too, as ``kmix``
  (:func:`~ferrylm.experts.quantized.mix_format`): every layer of a model shares one expert row layout, so each
  row holds its layer's blocks padded to the widest type of the mix, and a tag byte per expert names the type (the
  bytes moved are the widest type's: Q4_K_M's downs at 6.56 bits). A mix with Q8_0 (32-value blocks) is repacked
  without loss into one int8 format with mins (:func:`ferrylm.checkpoints.quant.gguf_moe.unified_format`).
  ``MXFP4`` (gpt-oss) keeps its e2m1 codes and E8M0 scales as the ``fp4`` format of gpt-oss's own MXFP4
  checkpoints (:func:`~ferrylm.checkpoints.quant.gguf_moe.repack_mxfp4`: nibbles paired per byte, the scales as
  bfloat16; the same values). Float experts (F32 / F16 / BF16) become plain stacks in the model dtype; expert
  biases (gpt-oss) are the layer's :class:`~ferrylm.experts.executor.ExpertMath`.
* On a CPU with the native kernels (``--moe-cpu-kernel``), the big non-expert matrices stay the file's blocks too:
  a ``Q8_0`` / ``Q4_K`` / ``Q5_K`` / ``Q6_K`` weight of an ``nn.Linear`` or ``nn.Embedding`` (lm_head, token
  embeddings, attention, dense and shared-expert MLPs) that the file holds as the model reads it (no converter
  change undone) becomes a :class:`~ferrylm.models.quant_linear.QuantLinear` / ``QuantEmbedding`` over its mapped
  bytes (:func:`~ferrylm.models.quant_linear.compact_modules`). Not: a tied embedding, what the class keeps in
  float32 or reads as a tensor (``tensor_weights``).
* Every other tensor is dequantized (gguf-py's ``dequantize``, exact), put back as the HF checkpoint has it
  (:mod:`ferrylm.checkpoints.gguf_archs`: names, and what llama.cpp's converter changed) and cast to the model dtype
  (bfloat16 on a GPU by default; float32 for what the model class keeps so) on its way to the device.

The config is :func:`ferrylm.checkpoints.gguf_config.served_config`; the tokenizer and chat template come from the same
metadata (:func:`ferrylm.checkpoints.gguf_tokenizer.gguf_tokenizer`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts import ExpertOptions
from ferrylm.experts.native_layouts import BlockMatrix
from ferrylm.experts.executor import ExpertMath, LayerExperts
from ferrylm.experts.gguf_blocks import BLOCK_CODE, BLOCK_TYPES, KIND_OF_GGUF
from ferrylm.experts.quantized import ExpertQuant, QuantFormat, QuantTensor, block_format, empty_quant, mix_format
from ferrylm.checkpoints.assemble import finish_model, module_name, placement, tensor_dtype
from ferrylm.checkpoints.gguf_archs import ExpertTensor, HFTensor, iter_expert_layers, split_tensors
from ferrylm.models.quant_linear import DenseKernel, compact_modules, dense_kernel
from ferrylm.checkpoints.gguf_config import EXPERT_TENSORS, expert_types, served_config, type_name
from ferrylm.checkpoints.gguf_reader import GGUFTensor, dequantize_tensor, read_gguf
from ferrylm.config import ModelConfig

log = logging.getLogger("ferrylm.models")
FLOAT_TYPES = ("F32", "F16", "BF16")
_MIXABLE = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the types gguf_moe.unified_format can repack together
_PARTS = ("gate", "up", "down")


def projection_format(types: list[str], what: str) -> QuantFormat | None:
    """The in-memory format of one projection (``gate_up`` or ``down``) whose layers use the GGUF ``types``: the
    block format of a single block type, ``kmix`` of several K-quant types, the unified int8 format of another
    mix, None for float types.

    Raises:
        ModelLoadError: float mixed with quantized types, or a type (or a mix) that is not read.
    """
    if not types or set(types) <= set(FLOAT_TYPES):
        return None
    if set(types) & set(FLOAT_TYPES):
        raise ModelLoadError(f"routed {what} experts mix float and quantized GGUF types ({types}); one kind per "
                             f"projection is supported")
    if types == ["MXFP4"]:
        from ferrylm.checkpoints.quant.gguf_moe import MXFP4_FORMAT

        return MXFP4_FORMAT
    if len(types) == 1 and types[0] in KIND_OF_GGUF:
        return block_format(types[0])
    if all(t in KIND_OF_GGUF and BLOCK_TYPES[KIND_OF_GGUF[t]].elems == 256 for t in types):
        return mix_format(types)
    if set(types) <= set(_MIXABLE):
        from ferrylm.checkpoints.quant.gguf_moe import unified_format

        return unified_format(set(types))
    raise ModelLoadError(f"routed {what} experts have GGUF types {types}; read are one of "
                         f"{', '.join(KIND_OF_GGUF)}, MXFP4 per projection, or a mix of {', '.join(_MIXABLE)}")


def planned_quant(gguf_types: dict[str, list[str]]) -> ExpertQuant | None:
    """The :class:`ExpertQuant` a GGUF's experts will have (``quantization_config.gguf_types`` of
    :func:`~ferrylm.checkpoints.gguf_config.served_config`), or None when they are float. Raises ModelLoadError."""
    gu = projection_format(gguf_types.get("gate_up", []), "gate/up")
    down = projection_format(gguf_types.get("down", []), "down")
    if gu is None and down is None:
        return None
    if gu is None or down is None:
        raise ModelLoadError("routed experts quantize one projection and leave the other float; one kind for all "
                             "routed experts is supported")
    return ExpertQuant(gu, down)


class GGUFPlanReader:
    """``quantization_config`` reader of the ``gguf`` method: only :meth:`planned` (the experts' formats before
    loading, for ``--moe-backend auto`` and the memory plan); the weights are read by :func:`load_gguf_model`."""

    method = "gguf"

    def __init__(self, qcfg: dict):
        self.types = dict(qcfg.get("gguf_types") or {})

    def planned(self) -> ExpertQuant | None:
        return planned_quant(self.types)

    def planned_for(self, hidden: int, inter: int) -> ExpertQuant | None:
        """As :meth:`planned` (GGML blocks do not depend on the shapes)."""
        return self.planned()


def _torch_view(data: np.ndarray, t: GGUFTensor) -> torch.Tensor:
    """The tensor's bytes in the mapped file as a uint8 torch view ``[nbytes]`` (no copy)."""
    return torch.from_numpy(data[t.offset:t.offset + t.nbytes])


def _expert_stack(data: np.ndarray, t: GGUFTensor, fmt: QuantFormat | None, dtype: torch.dtype,
                  device: torch.device, pin: bool) -> torch.Tensor | QuantTensor:
    """One ``[E, N, K]`` expert stack in ``fmt`` (None: plain ``dtype``) on ``device``: a view of the file's bytes
    for a block format on the CPU without pinning, else a copy."""
    from ferrylm.checkpoints.quant.gguf_moe import _DECODERS, repack

    e, n, k = t.shape
    if fmt is None:
        w = torch.from_numpy(dequantize_tensor(data, t)).to(dtype)
        return w.pin_memory() if pin else w.to(device)
    try:
        fmt.check_shape(n, k, t.name)
    except ValueError as err:
        raise ModelLoadError(str(err)) from None
    if fmt.kind == "fp4":
        from ferrylm.checkpoints.quant.gguf_moe import repack_mxfp4

        if type_name(t.qtype) != "MXFP4":
            raise ModelLoadError(f"GGUF tensor {t.name} is {type_name(t.qtype)}, not MXFP4")
        qt = repack_mxfp4(data, t, dtype)
        if pin:
            return qt._map(lambda x: x.pin_memory())
        return qt if device.type == "cpu" else qt.to(device)
    if fmt.kind == "kmix":
        kind = type_name(t.qtype).lower()
        if kind not in fmt.mix:
            raise ModelLoadError(f"GGUF tensor {t.name} is {type_name(t.qtype)}, not one of {fmt.describe()}")
        qt = empty_quant(fmt, (e,), n, k, dtype=dtype, pin_memory=pin)
        rb = k // 256 * BLOCK_TYPES[kind].nbytes
        qt.data.zero_()
        qt.data[..., :rb].copy_(_torch_view(data, t).view(e, n, rb))
        qt.tag.fill_(BLOCK_CODE[kind])
        return qt if device.type == "cpu" else qt.to(device)
    if fmt.is_block:
        if type_name(t.qtype).lower() != fmt.kind:
            raise ModelLoadError(f"GGUF tensor {t.name} is {type_name(t.qtype)}, not {fmt.describe()}")
        qt = QuantTensor(fmt, _torch_view(data, t).view(e, n, fmt.packed_k(k)), dtype=dtype)
    else:
        qt = repack(_DECODERS[type_name(t.qtype)][0](data, t), fmt, dtype)
    if pin:
        return qt._map(lambda x: x.pin_memory())
    return qt if device.type == "cpu" else qt.to(device)


def _plain_tensors(hf_tensors: list[HFTensor], data: np.ndarray, model_cls: type, config, device: torch.device,
                   dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The non-expert tensors by state-dict name (the model dtype, float32 where the class keeps it) and the GGUF
    tensors each came from."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for h in hf_tensors:
        key = module_name(h.name, model_cls, config)
        if key is None:
            continue
        w = torch.from_numpy(np.ascontiguousarray(h.produce(data)))
        tensors[key] = w.to(device=device, dtype=tensor_dtype(model_cls, key, dtype))
        origin[key] = " + ".join(t.name for t in h.sources)
    return tensors, origin


def _block_weights(hf_tensors: list[HFTensor], data: np.ndarray, model_cls: type,
                   config) -> dict[str, tuple[BlockMatrix, HFTensor]]:
    """The non-expert weights that may stay the file's blocks, by state-dict name, as block matrices over the
    mapped bytes: a verbatim 2-D tensor of a block type, not kept in float32 or read as a tensor by the class."""
    out = {}
    for h in hf_tensors:
        key = module_name(h.name, model_cls, config)
        kind = KIND_OF_GGUF.get(type_name(h.sources[0].qtype))
        if (key is None or kind is None or not h.verbatim or len(h.shape) != 2 or not key.endswith(".weight")
                or key.endswith(tuple(model_cls.float32_tensors))
                or key.removesuffix(".weight").endswith(tuple(model_cls.tensor_weights))):
            continue
        t, bt = h.sources[0], BLOCK_TYPES[kind]
        n, k = t.shape
        out[key] = (BlockMatrix(kind, k, _torch_view(data, t).view(n, k // bt.elems * bt.nbytes)), h)
    return out


def _compact_layers(blocks: dict[str, tuple[BlockMatrix, HFTensor]], data: np.ndarray, model_cls: type, config,
                    kernel: DenseKernel, dtype: torch.dtype):
    """The loader's ``adapt`` hook: the compact layers put in place on the meta model, and the tensors of the
    block weights no layer took (dequantized as the others)."""

    def adapt(model) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        placed = compact_modules(model, {key: m for key, (m, _) in blocks.items()}, kernel, dtype,
                                 embeddings=not config.tie_word_embeddings)
        if placed:
            kinds = sorted({kind.upper() for key in placed for kind in blocks[key][0].kinds})
            log.info("non-expert weights: %d matrices kept as the file's %s blocks (%.2f GiB), on the native-%s "
                     "kernel", len(placed), "/".join(kinds), sum(blocks[key][0].nbytes for key in placed) / 2 ** 30,
                     kernel.native.isa)
        rest = [h for key, (_, h) in blocks.items() if key not in placed]
        return _plain_tensors(rest, data, model_cls, config, torch.device("cpu"), dtype)

    return adapt


def _expert_layers(path: Path, experts: list[ExpertTensor], data: np.ndarray, model_cls: type, config,
                   fmts: dict, dtype: torch.dtype, exp_dev: torch.device, pin: bool) -> dict[int, LayerExperts]:
    """Every MoE layer's :class:`LayerExperts` from its GGUF stacks (and gpt-oss's biases as its ``math``).

    Raises:
        ModelLoadError: a stack of a layer without routed experts, a wrong shape, a missing stack, biases in a
            family without them.
    """
    moe_layers = set(model_cls.moe_layer_indices(config))
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    shapes = {("gate", "weight"): (e, i, h), ("up", "weight"): (e, i, h), ("down", "weight"): (e, h, i),
              ("gate", "bias"): (e, i), ("up", "bias"): (e, i), ("down", "bias"): (e, h)}
    swiglu = model_cls.expert_swiglu(config)
    out: dict[int, LayerExperts] = {}
    for layer, stacks in iter_expert_layers(experts):
        for (part, leaf), t in stacks.items():
            if layer not in moe_layers:
                raise ModelLoadError(f"GGUF tensor {t.name}: layer {layer} has no routed experts")
            if tuple(t.shape) != shapes[(part, leaf)]:
                raise ModelLoadError(f"GGUF tensor {t.name}: expected shape {list(shapes[(part, leaf)])}, got "
                                     f"{list(t.shape)}")
            if leaf == "bias" and swiglu is None:
                raise ModelLoadError(f"GGUF tensor {t.name}: {config.architecture} experts have no biases")
        want = {(p, "weight") for p in _PARTS} | ({(p, "bias") for p in _PARTS} if swiglu is not None else set())
        if missing := sorted(want - set(stacks)):
            part, leaf = missing[0]
            raise ModelLoadError(f"{path}: GGUF lacks blk.{layer}.ffn_{part}_exps.{leaf}")
        w = {p: _expert_stack(data, stacks[(p, "weight")], fmts[p], dtype, exp_dev, pin) for p in _PARTS}
        out[layer] = LayerExperts(gate=w["gate"], up=w["up"], down=w["down"])
        if swiglu is not None:
            b = {p: torch.from_numpy(dequantize_tensor(data, stacks[(p, "bias")])).to(dtype) for p in _PARTS}
            out[layer].math = ExpertMath(b["gate"], b["up"], b["down"], *swiglu)
    if missing_layers := sorted(moe_layers - set(out)):
        raise ModelLoadError(f"{path}: GGUF lacks blk.{missing_layers[0]}.ffn_gate_exps.weight")
    return out


def load_gguf_model(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    moe_backend: str | ExpertOptions = "resident", expert_device: torch.device | str | None = None,
                    pin_experts: bool = False):
    """Load the GGUF ``path`` as :func:`ferrylm.checkpoints.loader.load_model` loads a folder (same arguments and
    result, a :class:`~ferrylm.checkpoints.assemble.LoadedModel`), reading the file itself (module docstring).

    Raises:
        ModelLoadError: an architecture not served, an unmapped tensor, an expert type not read, missing tensors or metadata.
        UnsupportedArchitecture / ValueError: as ``load_model``.
    """
    start = time.perf_counter()
    g = read_gguf(path)
    served = served_config(g)
    config = ModelConfig.from_dict(served)
    model_cls, device, exp_dev, pin = placement(config, device, moe_backend, expert_device, pin_experts)
    quant = planned_quant(expert_types(g))
    fmts = {"gate": quant.gate_up if quant else None, "up": quant.gate_up if quant else None,
            "down": quant.down if quant else None}
    data = np.asarray(np.memmap(g.path, dtype=np.uint8, mode="c"))  # copy-on-write: writable views, file untouched
    hf_tensors, expert_tensors = split_tensors(g, served)
    options = moe_backend if isinstance(moe_backend, ExpertOptions) else ExpertOptions(backend=moe_backend)
    kernel = dense_kernel(device, options)
    blocks = _block_weights(hf_tensors, data, model_cls, config) if kernel is not None else {}
    taken = {h.name for _, h in blocks.values()}
    tensors, origin = _plain_tensors([h for h in hf_tensors if h.name not in taken], data, model_cls, config, device,
                                     dtype)
    experts = _expert_layers(g.path, expert_tensors, data, model_cls, config, fmts, dtype, exp_dev, pin)
    adapt = _compact_layers(blocks, data, model_cls, config, kernel, dtype) if blocks else None
    loaded = finish_model(model_cls, config, device, moe_backend, experts or None, tensors, origin, adapt=adapt)
    if experts:
        h, i = config.hidden_size, config.moe_intermediate_size
        weights = len(experts) * config.num_experts * 3 * h * i
        file_bits = sum(8 * e.tensor.nbytes for e in expert_tensors if e.leaf == "weight") / weights
        row_bits = 8 * next(iter(experts.values())).expert_bytes / (3 * h * i)
        log.info("loaded %s from the file in %.1f s: %d layers, %s on %s; experts %s, %.2f bits/weight in memory "
                 "(%.2f in the file)", Path(path).name, time.perf_counter() - start, config.num_layers,
                 str(dtype).removeprefix("torch."), device,
                 quant.describe() if quant else "plain", row_bits, file_bits)
    else:
        log.info("loaded %s from the file in %.1f s: %d layers, dense, %s on %s", Path(path).name,
                 time.perf_counter() - start, config.num_layers, str(dtype).removeprefix("torch."), device)
    return loaded


__all__ = ["EXPERT_TENSORS", "GGUFPlanReader", "load_gguf_model", "planned_quant", "projection_format"]
