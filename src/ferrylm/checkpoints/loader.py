"""Load a Hugging Face model folder (config.json + safetensors) into a ferrylm model and an expert executor.

Steps: read config.json → pick the class from the registry and check the config → stream every tensor of the
checkpoint, routed experts into preallocated ``[E, …]`` stacks, everything else into a name → tensor dict →
build the executor → build the model on the ``meta`` device and assign the tensors. Every checkpoint tensor
must find a place and every parameter / expert slot must be filled, else ModelLoadError names the tensor.
Only tensors are read: no code from the folder is ever imported or run. A synthetic model folder (config.json with
a ``ferrylm_synthetic`` recipe, see ``synthetic/spec.py``) has no weights: its model is built in memory instead.

A checkpoint with a ``quantization_config`` goes through :mod:`ferrylm.checkpoints.quant.load` instead: routed experts
repacked into :class:`~ferrylm.experts.quantized.QuantTensor` stacks, other quantized linears dequantized. The expert
layouts accepted, the naming and the model's assembly: :mod:`ferrylm.checkpoints.assemble`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ferrylm.checkpoints.assemble import (ExpertAssembler, ExpertBiasAssembler, LoadedModel, expert_assemblers,
                                          finish_model, module_name, placement, ple_assembler, renamed, tensor_dtype)
from ferrylm.checkpoints.ple_tables import PleAssembler
from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts import ExpertOptions
from ferrylm.models.tensor_parallel import TPShard, check_shardable, shard_config, shard_tensor


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding the weights.

    ``model.safetensors.index.json`` present → the files its ``weight_map`` names (so stray extra files such as
    ``consolidated.safetensors`` are not read twice); else ``model.safetensors``; else every ``*.safetensors``.

    Raises:
        ModelLoadError: no safetensors weights, an unreadable index, or a shard the index names is missing.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e!r}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index.name} names shard {f.name}, which is missing from {model_dir}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} holds no *.safetensors weights (.bin / .pt checkpoints are not read)")
    return files


def _progress(total: int, desc: str):
    """A tqdm byte counter on stderr, or None when stderr is not a terminal (logs and tests stay quiet)."""
    import sys

    if not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


def load_model(model_dir: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               moe_backend: str | ExpertOptions = "resident", expert_device: torch.device | str | None = None,
               pin_experts: bool = False, tp: TPShard | None = None, ple_backend: str = "gpu") -> LoadedModel:
    """Load the HF model folder ``model_dir`` (or build the synthetic model a synthetic folder describes).

    Args:
        model_dir: folder with ``config.json`` and safetensors weights (single file or sharded with an index),
            a synthetic model folder (:func:`ferrylm.synthetic.spec.materialize`), or a ``.gguf`` file
            (read in place: :mod:`ferrylm.checkpoints.quant.gguf_file`).
        device: where weights (and, for the resident backend, experts) are placed.
        dtype: floating-point tensors are cast to it.
        moe_backend: expert backend name (see ``ferrylm.experts.MOE_BACKENDS``) or ``ExpertOptions``; ignored for
            dense models.
        expert_device: where the routed-expert stacks are assembled (default: ``device`` for the resident
            backend, host memory for the offloading ones, see ``ferrylm.experts.expert_home``); the resident
            backend then moves them to ``device``.
        pin_experts: assemble CPU expert stacks in page-locked memory (only when CUDA is available).
        tp: this rank's tensor-parallel shard (:mod:`ferrylm.models.tensor_parallel`): every tensor is cut to it as
            it is read and the model is built at shard shape (``LoadedModel.config`` is the per-rank config); None
            or size 1 = the whole model. Plain (unquantized) safetensors folders only.
        ple_backend: where per-layer embedding tables are placed, ``gpu`` (``device``), ``host`` or ``disk``
            (``checkpoints/ple_tables.py``); models without them ignore it.

    Returns:
        :class:`LoadedModel` with the model in eval mode, gradients off.

    Raises:
        ModelLoadError: missing/unreadable files, unsupported config, a checkpoint tensor without a place, a
            parameter or expert without a tensor, a shape mismatch, a truncated file, an unsupported quantization
            method or a quantized tensor whose scales do not fit its weight (the message names the tensor).
        UnsupportedArchitecture: ``architectures[0]`` is not registered (message lists the supported ones).
        ValueError: unknown ``moe_backend``.
    """
    from ferrylm.checkpoints.gguf_config import check_tensor_parallel, is_gguf_file
    from ferrylm.synthetic.spec import is_synthetic_folder

    model_dir = Path(model_dir)
    split = tp is not None and tp.is_split
    check_tensor_parallel(model_dir, tp.size if split else 1)
    if is_gguf_file(model_dir):  # a GGUF served from the file itself
        from ferrylm.checkpoints.quant.gguf_file import load_gguf_model

        return load_gguf_model(model_dir, device=device, dtype=dtype, moe_backend=moe_backend,
                               expert_device=expert_device, pin_experts=pin_experts)
    if is_synthetic_folder(model_dir):
        from ferrylm.synthetic.spec import spec_from_folder
        from ferrylm.checkpoints.synthetic_build import build_synthetic

        return build_synthetic(spec_from_folder(model_dir), device=device, dtype=dtype, moe_backend=moe_backend,
                               expert_device=expert_device, pin_experts=pin_experts, tp=tp if split else None)
    return _load_folder(model_dir, device=device, dtype=dtype, moe_backend=moe_backend, expert_device=expert_device,
                        pin_experts=pin_experts, tp=tp if split else None, ple_backend=ple_backend)


def _load_folder(model_dir: Path, *, device, dtype: torch.dtype, moe_backend, expert_device, pin_experts: bool,
                 tp: TPShard | None, ple_backend: str) -> LoadedModel:
    """:func:`load_model` of a safetensors folder; ``tp`` a split shard or None."""
    full = ModelConfig.from_folder(model_dir)
    config = shard_config(full, tp) if tp is not None else full
    model_cls, device, exp_dev, pin = placement(config, device, moe_backend, expert_device, pin_experts)
    if tp is not None:
        check_shardable(model_cls, config, tp)
    moe_layers = model_cls.moe_layer_indices(config)
    from ferrylm.checkpoints.quant import reader_for

    reader = reader_for(config.raw)
    if reader is not None and tp is not None:
        raise ModelLoadError(f"--tensor-parallel-size {tp.size}: quantized checkpoints ({reader.method}) are not "
                             f"split by tensor parallel yet")
    if reader is not None:
        from ferrylm.checkpoints.quant.load import read_quantized

        files = checkpoint_files(model_dir)
        bar = _progress(sum(p.stat().st_size for p in files), f"loading {model_dir.name} ({reader.method})")
        try:
            tensors, origin, stacks = read_quantized(files, reader, model_cls, config, device=device, dtype=dtype,
                                                     expert_device=exp_dev, pin=pin, moe_layers=moe_layers,
                                                     progress=bar)
        finally:
            if bar is not None:
                bar.close()
        return finish_model(model_cls, config, device, moe_backend, stacks, tensors, origin)
    experts, biases = expert_assemblers(model_cls, config, moe_layers, exp_dev, dtype, pin)
    ple = ple_assembler(model_cls, config, ple_backend, device, dtype)
    if ple is not None and tp is not None:
        raise ModelLoadError(f"--tensor-parallel-size {tp.size}: per-layer embeddings are not split yet")
    sinks = _PlainSinks(model_cls, config, full, tp, device, dtype, experts, biases, ple)
    tensors, origin = _read_plain(model_dir, sinks)
    stacks = experts.finish() if experts is not None else None
    if biases is not None:
        biases.attach(stacks)
    return finish_model(model_cls, config, device, moe_backend, stacks, tensors, origin,
                   ple.finish() if ple is not None else None)


@dataclass
class _PlainSinks:
    """Where :func:`_read_plain` puts each tensor of an unquantized checkpoint: PLE tables, expert stacks, expert
    biases, else the model's state dict (on ``device`` in ``dtype``). ``full``: the unsplit config, ``tp`` the
    split shard or None."""

    model_cls: type
    config: ModelConfig
    full: ModelConfig
    tp: TPShard | None
    device: torch.device
    dtype: torch.dtype
    experts: ExpertAssembler | None
    biases: ExpertBiasAssembler | None
    ple: PleAssembler | None


def _read_plain(model_dir: Path, k: _PlainSinks) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Stream every tensor of the folder's safetensors into ``k``'s sinks; returns ``(tensors, origin)``: the
    state-dict tensors and the checkpoint name each came from."""
    from ferrylm.checkpoints.quant.load import check_complete

    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    files = checkpoint_files(model_dir)
    for path in files:
        check_complete(path)
    bar = _progress(sum(p.stat().st_size for p in files), f"loading {model_dir.name}")
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if k.ple is not None and k.ple.add(renamed(name, k.model_cls), path, lambda: f.get_tensor(name)):
                    continue
                if k.model_cls.skips_tensor(name, k.config):
                    continue
                t = f.get_tensor(name)
                if bar is not None:
                    bar.update(t.numel() * t.element_size())
                if k.tp is not None:   # this rank's part only: the stacks are allocated at shard shape
                    t = shard_tensor(name, t, k.full, k.tp)
                if k.experts is not None and k.experts.add(renamed(name, k.model_cls), t):
                    continue
                if k.biases is not None and k.biases.add(name, t):
                    continue
                key = module_name(name, k.model_cls, k.config)
                if key is None:
                    continue
                if key in tensors:
                    raise ModelLoadError(f"checkpoint tensor {name!r} appears twice (also as {origin[key]!r})")
                tensors[key] = (t.to(device=k.device, dtype=tensor_dtype(k.model_cls, key, k.dtype))
                                if t.is_floating_point() else t.to(k.device))
                origin[key] = name
    if bar is not None:
        bar.close()
    return tensors, origin


