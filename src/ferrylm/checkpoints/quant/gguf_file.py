"""Serve a Mixture-of-Experts GGUF from the file itself: nothing is converted or written.

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
  without loss into one int8 format with mins (:func:`ferrylm.checkpoints.quant.gguf_moe.unified_format`). Float
  experts (F32 / F16 / BF16) become plain stacks in the model dtype.
* Every other tensor is dequantized (gguf-py's ``dequantize``, exact) and cast to the model dtype (bfloat16 on a
  GPU by default) on its way to the device; Q/K rows of the ``llama`` architecture are un-permuted.

The config is :func:`ferrylm.checkpoints.gguf_config.served_config`; the tokenizer and chat template come from the same
metadata (:func:`ferrylm.checkpoints.gguf_convert.gguf_tokenizer`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from ferrylm.errors import ModelLoadError
from ferrylm.experts import ExpertOptions
from ferrylm.experts.executor import LayerExperts
from ferrylm.experts.gguf_blocks import BLOCK_CODE, BLOCK_TYPES, KIND_OF_GGUF
from ferrylm.experts.quantized import ExpertQuant, QuantFormat, QuantTensor, block_format, empty_quant, mix_format
from ferrylm.checkpoints.gguf_config import EXPERT_TENSORS, expert_types, served_config
from ferrylm.checkpoints.gguf_convert import GGUFFile, GGUFTensor, dequantize_tensor, read_gguf, unpermute_rope_rows

log = logging.getLogger("ferrylm.models")
FLOAT_TYPES = ("F32", "F16", "BF16")
_MIXABLE = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the types gguf_moe.unified_format can repack together
_PART = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


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
    if len(types) == 1 and types[0] in KIND_OF_GGUF:
        return block_format(types[0])
    if all(t in KIND_OF_GGUF and BLOCK_TYPES[KIND_OF_GGUF[t]].elems == 256 for t in types):
        return mix_format(types)
    if set(types) <= set(_MIXABLE):
        from ferrylm.checkpoints.quant.gguf_moe import unified_format

        return unified_format(set(types))
    raise ModelLoadError(f"routed {what} experts have GGUF types {types}; read are one of "
                         f"{', '.join(KIND_OF_GGUF)} per projection, or a mix of {', '.join(_MIXABLE)}")


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
    from ferrylm.checkpoints.gguf_config import type_name
    from ferrylm.checkpoints.quant.gguf_moe import _DECODERS, repack

    e, n, k = t.shape
    if fmt is None:
        w = torch.from_numpy(dequantize_tensor(data, t)).to(dtype)
        return w.pin_memory() if pin else w.to(device)
    try:
        fmt.check_shape(n, k, t.name)
    except ValueError as err:
        raise ModelLoadError(str(err)) from None
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


def _names(g: GGUFFile):
    """``(tensor, hf name, expert layer or None, expert part or None)`` for every tensor of ``g``."""
    from ferrylm.checkpoints.quant.gguf_moe import _hf_name

    arch = g.get("general.architecture")
    for t in g.tensors:
        hf, proj = _hf_name(arch, t.name)
        if proj is None:
            yield t, hf, None, None
        else:
            parts = t.name.split(".")
            yield t, hf, int(parts[1]), _PART[parts[2]]


def load_gguf_model(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    moe_backend: str | ExpertOptions = "resident", expert_device: torch.device | str | None = None,
                    pin_experts: bool = False):
    """Load the MoE GGUF ``path`` as :func:`ferrylm.checkpoints.loader.load_model` loads a folder (same arguments and
    result, a :class:`~ferrylm.checkpoints.loader.LoadedModel`), reading the file itself (module docstring).

    Raises:
        ModelLoadError: not a MoE GGUF, an unmapped tensor, an expert type not read, missing tensors or metadata.
        UnsupportedArchitecture / ValueError: as ``load_model``.
    """
    from ferrylm.config import ModelConfig
    from ferrylm.checkpoints.loader import _finish, _module_name, placement

    start = time.perf_counter()
    g = read_gguf(path)
    config = ModelConfig.from_dict(served_config(g))
    model_cls, device, exp_dev, pin = placement(config, device, moe_backend, expert_device, pin_experts)
    moe_layers = set(model_cls.moe_layer_indices(config))
    quant = planned_quant(expert_types(g))
    fmts = {"gate": quant.gate_up if quant else None, "up": quant.gate_up if quant else None,
            "down": quant.down if quant else None}
    data = np.asarray(np.memmap(g.path, dtype=np.uint8, mode="c"))  # copy-on-write: writable views, file untouched
    arch = g.get("general.architecture")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    stacks: dict[int, dict[str, torch.Tensor | QuantTensor]] = {n: {} for n in moe_layers}
    for t, hf, layer, part in _names(g):
        if part is not None:
            if layer not in stacks:
                raise ModelLoadError(f"GGUF tensor {t.name}: layer {layer} has no routed experts")
            want = (config.num_experts, *((config.moe_intermediate_size, config.hidden_size) if part != "down"
                                          else (config.hidden_size, config.moe_intermediate_size)))
            if tuple(t.shape) != want:
                raise ModelLoadError(f"GGUF tensor {t.name}: expected shape {list(want)}, got {list(t.shape)}")
            stacks[layer][part] = _expert_stack(data, t, fmts[part], dtype, exp_dev, pin)
            continue
        w = dequantize_tensor(data, t)
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            w = unpermute_rope_rows(w, heads if ".attn_q." in t.name else kv_heads)
        if hf.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, t.shape[-1])
        key = _module_name(hf, model_cls, config)
        if key is None:
            continue
        tensors[key] = torch.from_numpy(np.ascontiguousarray(w)).to(device=device, dtype=dtype)
        origin[key] = t.name
    for layer, s in stacks.items():
        if set(s) != {"gate", "up", "down"}:
            missing = sorted({"gate", "up", "down"} - set(s))[0]
            raise ModelLoadError(f"{g.path}: GGUF lacks blk.{layer}.ffn_{missing}_exps.weight")
    experts = {n: LayerExperts(gate=s["gate"], up=s["up"], down=s["down"]) for n, s in stacks.items()}
    loaded = _finish(model_cls, config, device, moe_backend, experts or None, tensors, origin)
    if experts:
        h, i = config.hidden_size, config.moe_intermediate_size
        weights = len(experts) * config.num_experts * 3 * h * i
        file_bits = sum(8 * t.nbytes for t, _, _, p in _names(g) if p is not None) / weights
        row_bits = 8 * next(iter(experts.values())).expert_bytes / (3 * h * i)
        log.info("loaded %s from the file in %.1f s: %d layers, %s on %s; experts %s, %.2f bits/weight in memory "
                 "(%.2f in the file)", Path(path).name, time.perf_counter() - start, config.num_layers,
                 str(dtype).removeprefix("torch."), device,
                 quant.describe() if quant else "plain", row_bits, file_bits)
    return loaded


__all__ = ["EXPERT_TENSORS", "GGUFPlanReader", "load_gguf_model", "planned_quant", "projection_format"]
