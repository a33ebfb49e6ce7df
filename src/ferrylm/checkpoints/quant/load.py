"""Stream a quantized safetensors checkpoint into a model: routed experts repacked into
:class:`~ferrylm.experts.quantized.QuantTensor` stacks, every other quantized linear dequantized to the model dtype.

Steps (:func:`read_quantized`): index every tensor name of every shard → group the names of each quantized module
(a prefix whose marker part exists, see :class:`~ferrylm.checkpoints.quant.base.QuantReader`) → for each module: a
routed expert (per expert ``…experts.E.{w1,w3,w2,gate_proj,up_proj,down_proj}`` or a fused stack
``…experts.{gate_up_proj,gate_proj,up_proj,down_proj}``) is decoded and copied into its layer's stack
(:class:`QuantAssembler`); any other is dequantized and treated as a plain weight. Plain tensors go the way
:func:`ferrylm.checkpoints.loader.load_model` takes them. Every stack slot must be filled exactly once; gate and up share
one format model-wide, down one format model-wide.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import LayerExperts
from ferrylm.experts.quantized import QuantFormat, QuantTensor, empty_quant
from ferrylm.checkpoints.assemble import (check_expert_ids, check_experts_complete, expert_assemblers, module_name,
                                         renamed, tensor_dtype, unfilled)
from ferrylm.checkpoints.quant.base import QuantReader

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                         r"(w1|w3|w2|gate_proj|up_proj|down_proj)$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|gate_proj|up_proj|"
                    r"down_proj)$")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class QuantAssembler:
    """Per-layer quantized expert stacks ``gate/up [E, I, H]``, ``down [E, H, I]``, allocated on first use in the
    format the checkpoint's first module of that projection has.

    Args:
        layers: MoE decoder layers. num_experts, hidden_size, intermediate_size: ``E``, ``H``, ``I``.
        device, dtype: where the stacks live; the compute dtype. pin_memory: page-locked host stacks.
    """

    def __init__(self, layers: tuple[int, ...], num_experts: int, hidden_size: int, intermediate_size: int,
                 device: torch.device, dtype: torch.dtype, pin_memory: bool = False):
        self.num_experts = num_experts
        self.shapes = {"gate": (intermediate_size, hidden_size), "up": (intermediate_size, hidden_size),
                       "down": (hidden_size, intermediate_size)}
        self.device, self.dtype, self.pin = device, dtype, pin_memory
        self.formats: dict[str, QuantFormat] = {}
        self.stacks: dict[int, dict[str, QuantTensor]] = {n: {} for n in layers}
        self.filled: dict[tuple[int, str], set[int]] = {(n, p): set() for n in layers for p in self.shapes}

    def put(self, name: str, layer: int, part: str, experts: list[int], qt: QuantTensor) -> None:
        """Place ``qt`` (one expert ``[N, K]`` or ``len(experts)`` consecutive experts ``[n, N, K]``).

        Raises:
            ModelLoadError: a layer without experts, an expert out of range, a wrong shape, a duplicate, or a
                format other than the one the projection already has (names the checkpoint tensor).
        """
        check_expert_ids(name, layer, experts, self.stacks, self.num_experts)
        stacks = self.stacks[layer]
        one = qt.data.dim() == 2
        want = self.shapes[part] if one else (len(experts), *self.shapes[part])
        if tuple(qt.shape) != tuple(want):
            raise ModelLoadError(f"checkpoint tensor {name!r}: expected a weight of shape {list(want)}, got "
                                 f"{list(qt.shape)}")
        key = "down" if part == "down" else "gate_up"
        fmt = self.formats.setdefault(key, qt.fmt)
        if qt.fmt != fmt:
            raise ModelLoadError(f"checkpoint tensor {name!r} is stored as {qt.fmt.describe()} but other {key} "
                                 f"expert projections as {fmt.describe()}; one format per projection is supported")
        if part not in stacks:
            try:
                stacks[part] = empty_quant(fmt, (self.num_experts,), *self.shapes[part], device=self.device,
                                           dtype=self.dtype, pin_memory=self.pin)
            except ValueError as e:
                raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
        done = unfilled(self.filled, name, layer, part, experts)
        dst = stacks[part][experts[0]] if one else stacks[part][experts[0]:experts[-1] + 1]
        dst.copy_(qt)
        done.update(experts)

    def finish(self) -> dict[int, LayerExperts]:
        """The stacks as :class:`LayerExperts`. Raises ModelLoadError naming the first missing expert."""
        check_experts_complete(self.filled, self.num_experts)
        return {n: LayerExperts(gate=s["gate"], up=s["up"], down=s["down"]) for n, s in self.stacks.items()}


def check_complete(path: Path) -> None:
    """Raise ModelLoadError naming the first tensor that ends past the end of the safetensors file ``path``
    (a truncated download), or when the header itself is cut. Reads only the header."""
    import json
    import struct

    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n > size:
                raise ModelLoadError(f"{path} is truncated: its header needs {n} bytes, the file has {size}")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise ModelLoadError(f"cannot read the safetensors header of {path}: {e}") from None
    data = 8 + n
    cut = sorted((v["data_offsets"][1], k) for k, v in header.items()
                 if k != "__metadata__" and data + v["data_offsets"][1] > size)
    if cut:
        raise ModelLoadError(f"{path} is truncated: tensor {cut[0][1]!r} ends at byte {data + cut[0][0]}, past the "
                             f"end of the file ({size} bytes)")


def read_quantized(files: list[Path], reader: QuantReader, model_cls: type, config: ModelConfig, *,
                   device: torch.device, dtype: torch.dtype, expert_device: torch.device, pin: bool,
                   moe_layers: tuple[int, ...], progress=None):
    """Read every tensor of ``files`` (see the module docstring).

    Returns:
        ``(tensors, origin, experts)``: model state-dict name -> plain tensor (on ``device`` in ``dtype``), that
        name -> checkpoint name, and MoE layer -> :class:`LayerExperts` (quantized stacks, or plain ones when the
        checkpoint left the experts unquantized) or None for a dense model.

    Raises:
        ModelLoadError: a tensor without a place, a quantized module that does not decode, experts partly
            quantized, a missing expert (the message names the tensor).
    """
    with contextlib.ExitStack() as stack:
        shards = _Shards(files, lambda name: model_cls.skips_tensor(name, config), stack, progress)
        modules, plain = _group_modules(shards.names(), reader, lambda name: model_cls.skips_tensor(name, config))
        sinks = _QuantSinks(reader, model_cls, config, device=device, dtype=dtype, expert_device=expert_device,
                            pin=pin, moe_layers=moe_layers)
        for prefix, names in modules.items():
            sinks.module(prefix, names, {suffix: shards.get(n) for suffix, n in names.items()})
        for name in plain:
            sinks.plain(name, shards.get(name))
    return sinks.tensors, sinks.origin, sinks.finish()


class _Shards:
    """Every tensor name of the safetensors ``files`` (open in ``stack``) but those ``skip`` names, and where it is
    stored. Raises ModelLoadError for a truncated or unreadable shard and a name stored twice."""

    def __init__(self, files: list[Path], skip, stack: contextlib.ExitStack, progress) -> None:
        self.where: dict[str, object] = {}
        self.progress = progress
        for path in files:
            check_complete(path)
            try:
                h = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ModelLoadError(f"cannot read {path}: {e}") from None
            for name in h.keys():
                if skip(name):
                    continue
                if name in self.where:
                    raise ModelLoadError(f"checkpoint tensor {name!r} appears in two shards")
                self.where[name] = h

    def names(self):
        return self.where.keys()

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (counted on the progress bar). Raises ModelLoadError when it cannot be read."""
        try:
            t = self.where[name].get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot read checkpoint tensor {name!r}: {e}") from None
        if self.progress is not None:
            self.progress.update(t.numel() * t.element_size())
        return t


def _group_modules(names, reader: QuantReader, skip) -> tuple[dict[str, dict[str, str]], list[str]]:
    """``(modules, plain)``: the quantized modules (prefix -> suffix -> tensor name; a prefix whose marker part
    exists) and the plain tensor names, in checkpoint order; names the reader or ``skip`` drops are left out."""
    marked = {sp[0] for sp in map(reader.split, names) if sp is not None and sp[1] == reader.marker}
    modules: dict[str, dict[str, str]] = {}
    plain: list[str] = []
    for name in names:
        if reader.skip(name) or skip(name):
            continue
        sp = reader.split(name)
        if sp is not None and sp[0] in marked:
            modules.setdefault(sp[0], {})[sp[1]] = name
        else:
            plain.append(name)
    return modules, plain


class _QuantSinks:
    """Where :func:`read_quantized` puts each module and tensor: quantized expert stacks, plain expert stacks (a
    checkpoint that left its experts unquantized), expert biases, else the model's state dict (``tensors`` on
    ``device`` in ``dtype``, ``origin`` the checkpoint name of each)."""

    def __init__(self, reader: QuantReader, model_cls: type, config: ModelConfig, *, device: torch.device,
                 dtype: torch.dtype, expert_device: torch.device, pin: bool, moe_layers: tuple[int, ...]) -> None:
        self.reader, self.model_cls, self.config = reader, model_cls, config
        self.device, self.dtype, self.moe_layers = device, dtype, moe_layers
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.quant = QuantAssembler(moe_layers, e, h, i, expert_device, dtype, pin) if moe_layers else None
        self.dense, self.biases = expert_assemblers(model_cls, config, moe_layers, expert_device, dtype, pin)
        self.used_quant = self.used_dense = False
        self.tensors: dict[str, torch.Tensor] = {}
        self.origin: dict[str, str] = {}

    def module(self, prefix: str, names: dict[str, str], parts: dict[str, torch.Tensor]) -> None:
        """One quantized module: a routed expert (or fused stack) into the quantized stacks, else dequantized."""
        label = names[self.reader.marker]
        placed = renamed(prefix, self.model_cls)     # the class's names (``hf_renames``) place the experts
        m_one, m_fused = _PER_EXPERT.match(placed), _FUSED.match(placed)
        if self.quant is not None and (m_one or m_fused):
            self._put_expert(prefix, label, m_one, m_fused, self.reader.decode(prefix, parts, self.dtype))
            return
        weight = self.reader.dequantize(prefix, parts, self.dtype)
        wname = prefix + ".weight"
        if self.dense is not None and self.dense.add(renamed(wname, self.model_cls), weight):
            self.used_dense = True
            return
        self._put_state(label, module_name(wname, self.model_cls, self.config), weight)

    def _put_expert(self, prefix: str, label: str, m_one, m_fused, qt: QuantTensor) -> None:
        self.used_quant = True
        if m_one:
            self.quant.put(label, int(m_one[1]), _PART[m_one[3]], [int(m_one[2])], qt)
            return
        layer, kind = int(m_fused[1]), m_fused[2]
        experts = list(range(qt.shape[0])) if qt.data.dim() == 3 else [0]
        if kind != "gate_up_proj":
            self.quant.put(label, layer, _PART[kind], experts, qt)
            return
        n2 = qt.shape[-2]
        if n2 % 2:
            raise ModelLoadError(f"checkpoint tensor {label!r}: gate_up rows ({n2}) are not even")
        if self.reader.gate_up_rows(prefix) == "interleaved":
            gate, up = _take_rows(qt, 0), _take_rows(qt, 1)
        else:
            gate, up = qt.rows(0, n2 // 2), qt.rows(n2 // 2, n2)
        self.quant.put(label, layer, "gate", experts, gate)
        self.quant.put(label, layer, "up", experts, up)

    def plain(self, name: str, t: torch.Tensor) -> None:
        """One unquantized checkpoint tensor: an expert bias, a plain expert weight, else a state-dict tensor."""
        if self.biases is not None and self.biases.add(name, t):
            return
        if self.dense is not None and self.dense.add(renamed(name, self.model_cls), t):
            self.used_dense = True
            return
        self._put_state(name, module_name(name, self.model_cls, self.config), t)

    def _put_state(self, name: str, key: str | None, t: torch.Tensor) -> None:
        if key is None:
            return
        if key in self.tensors:
            raise ModelLoadError(f"checkpoint tensor {name!r} appears twice (also as {self.origin[key]!r})")
        self.tensors[key] = (t.to(device=self.device, dtype=tensor_dtype(self.model_cls, key, self.dtype))
                             if t.is_floating_point() else t.to(self.device))
        self.origin[key] = name

    def finish(self) -> dict[int, LayerExperts] | None:
        """The expert stacks (None for a dense model). Raises ModelLoadError for experts partly quantized."""
        if self.used_quant and self.used_dense:
            raise ModelLoadError("the checkpoint quantizes some routed experts and leaves others plain; ferrylm "
                                 "needs one format for all routed experts")
        if not self.moe_layers:
            return None
        experts = self.quant.finish() if self.used_quant else self.dense.finish()
        if self.biases is not None:
            self.biases.attach(experts)
        return experts


def _take_rows(qt: QuantTensor, start: int) -> QuantTensor:
    """Every second output row from ``start`` (gpt-oss's interleaved gate / up rows), contiguous."""
    def rows(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        if t is None:
            return None
        index = [slice(None)] * t.dim()
        index[dim] = slice(start, None, 2)
        return t[tuple(index)].contiguous()

    return QuantTensor(qt.fmt, rows(qt.data, -2), rows(qt.scales, -2), rows(qt.mins, -2),
                       rows(qt.row_scale, -1), qt.dtype)
