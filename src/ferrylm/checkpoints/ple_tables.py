"""Where per-layer embedding (PLE) tables live (``--ple-backend``) and how the loader assembles them.

A PLE layer's table (``models/ple.py``) is stored in the checkpoint as ``split_ngram_parts`` row shards
``model.layers.N.ple.ple_embedding.ngram_embedding.shard_I.weight`` (concatenated along rows in shard order; a plain
``ngram_embedding.weight`` is one shard). Placements:

* ``gpu``: one tensor on the compute device (rows gathered there).
* ``host``: one tensor in host memory (page-locked when CUDA is present); a step's rows are gathered on the CPU and
  copied to the device in one transfer.
* ``disk``: nothing is read at load: each shard is a memory map of its checkpoint file (copy-on-write, so the file is
  never written); a step reads only the pages of the rows it gathers, the OS page cache keeping hot rows.

The boot chooses the placement before loading (``engine/ple_choice.py``); every placement gives the same rows.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from pathlib import Path

import torch

from ferrylm.config import PLE_BACKENDS as _FLAG_CHOICES
from ferrylm.errors import ModelLoadError

PLE_BACKENDS = _FLAG_CHOICES[1:]   # the placements (``auto`` is resolved before loading)
_SHARD = re.compile(r"^model\.layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding(?:\.shard_(\d+))?\.weight$")
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class TensorTable:
    """A table held as one tensor (``gpu`` / ``host``): ``weight [rows, D]``."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def gather(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``rows [N]`` -> ``[N, D]`` on ``device`` (gathered where the table lives, then one copy)."""
        out = self.weight.index_select(0, rows.to(self.weight.device))
        return out.to(device, non_blocking=out.is_pinned())


class MmapTable:
    """A table read in place from its checkpoint shards (``disk``).

    Args:
        shards: the shards in row order, each ``[rows_i, D]`` (memory-mapped views); dtype: what gathers return.
    """

    def __init__(self, shards: list[torch.Tensor], dtype: torch.dtype):
        self.shards = shards
        self.dtype = dtype
        self.ends = torch.tensor([s.shape[0] for s in shards]).cumsum(0)

    def gather(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        rows = rows.cpu()
        which = torch.bucketize(rows, self.ends, right=True)
        out = torch.empty(rows.shape[0], self.shards[0].shape[1], dtype=self.dtype)
        for i in which.unique().tolist():
            hit = (which == i).nonzero().flatten()
            local = rows[hit] - (self.ends[i - 1] if i else 0)
            out[hit] = self.shards[i].index_select(0, local).to(self.dtype)
        return out.to(device)


class PoolTable:
    """A synthetic model's table (``checkpoints/synthetic_build.py``): row ``r`` is a window of ``D`` values of a seeded pool
    ``values [P]`` at a position hashed from ``r``, times ``scale``: any number of rows, no table in memory."""

    def __init__(self, values: torch.Tensor, dim: int, scale: float):
        self.values, self.dim, self.scale = values, dim, scale

    def gather(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        span = self.values.shape[0] - self.dim
        start = torch.remainder(rows.to(self.values.device) * 7919, span)
        out = self.values[start[:, None] + torch.arange(self.dim, device=self.values.device)] * self.scale
        return out.to(device)


def safetensors_entry(path: Path, name: str) -> tuple[int, torch.dtype, list[int]]:
    """``(byte offset, dtype, shape)`` of tensor ``name`` in the safetensors file ``path`` (its header only).

    Raises:
        ModelLoadError: the entry is missing or of a dtype without a table reader.
    """
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    entry = header.get(name)
    if entry is None or entry.get("dtype") not in _DTYPES:
        raise ModelLoadError(f"{path.name}: PLE tensor {name!r} is missing or of an unsupported dtype")
    return 8 + size + entry["data_offsets"][0], _DTYPES[entry["dtype"]], entry["shape"]


def map_tensor(path: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of ``path`` as a copy-on-write memory map (nothing read until rows are touched)."""
    offset, dtype, shape = safetensors_entry(path, name)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    count = shape[0] * shape[1]
    return torch.frombuffer(mm, dtype=dtype, count=count, offset=offset).view(shape[0], shape[1])


class PleAssembler:
    """Collects the checkpoint's PLE shards during a load and builds one table per PLE layer.

    Args:
        layers: the decoder layers with PLE; backend: a placement of :data:`PLE_BACKENDS`; device: the compute
            device; dtype: the model's; pin: page-lock host tables.
    """

    def __init__(self, layers: tuple[int, ...], backend: str, device: torch.device, dtype: torch.dtype, pin: bool):
        if backend not in PLE_BACKENDS:
            raise ValueError(f"--ple-backend must be one of auto, {', '.join(PLE_BACKENDS)}, got {backend!r}")
        self.layers, self.backend, self.device, self.dtype, self.pin = set(layers), backend, device, dtype, pin
        self.parts: dict[int, dict[int, torch.Tensor]] = {}

    def add(self, name: str, path: Path, read) -> bool:
        """Take tensor ``name`` of file ``path`` when it is a PLE shard (``read()`` loads it; not called for
        ``disk``). Returns False for other tensors."""
        m = _SHARD.match(name)
        if m is None or int(m.group(1)) not in self.layers:
            return False
        layer, part = int(m.group(1)), int(m.group(2) or 0)
        if self.backend == "disk":
            t = map_tensor(path, name)
        else:
            t = read().to(self.dtype)
        self.parts.setdefault(layer, {})[part] = t
        return True

    def finish(self) -> dict[int, TensorTable | MmapTable]:
        """The tables by decoder layer. Raises ModelLoadError for a layer whose shards are not ``0 .. P-1``."""
        out = {}
        for layer, parts in self.parts.items():
            if sorted(parts) != list(range(len(parts))):
                raise ModelLoadError(f"PLE table of layer {layer}: shards {sorted(parts)} are not 0..{len(parts) - 1}")
            shards = [parts[i] for i in range(len(parts))]
            if self.backend == "disk":
                out[layer] = MmapTable(shards, self.dtype)
                continue
            home = self.device if self.backend == "gpu" else torch.device("cpu")
            weight = torch.cat(shards).to(home)
            out[layer] = TensorTable(weight.pin_memory() if self.pin and home.type == "cpu" else weight)
        return out
