"""A cheap integrity check of a folder's safetensors files, run before anything loads them.

A safetensors file is ``[u64 little-endian header length N][N bytes of JSON header][tensor data]``; every tensor's
``data_offsets`` are relative to the start of the data, and the data must be covered exactly (the library refuses a
file with bytes left over or missing: "incomplete metadata, file not fully covered"). Reading only the headers
finds a truncated or corrupt file in milliseconds, so ``ferry serve`` can refuse it with one line naming the file
(exit 2) instead of an engine that fails seconds later with the library's message and no file name.

This module imports no torch (the frontend runs it).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from ferrylm.errors import ModelLoadError

MAX_HEADER_BYTES = 100 << 20   # the safetensors library's own limit on the JSON header
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def verify_safetensors(path: str | os.PathLike) -> None:
    """Check that ``path`` is a complete safetensors file: a readable header, and tensor data that covers the
    rest of the file exactly.

    Raises:
        ModelLoadError: one line starting with the file's path and saying what is wrong (truncated: how many bytes
            the header describes and how many the file holds).
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{p}: not a safetensors file: {size} bytes, shorter than its 8-byte header "
                                     f"length (truncated or empty; re-download or re-convert it)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise ModelLoadError(f"{p}: corrupt or truncated safetensors file: its header claims {n} bytes but "
                                     f"the file holds {size} bytes (re-download or re-convert it)")
            raw = f.read(n)
    except OSError as e:
        raise ModelLoadError(f"{p}: cannot read the safetensors file: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        end = 0
        for name, t in header.items():
            if name == "__metadata__":
                continue
            lo, hi = (int(x) for x in t["data_offsets"])
            if not 0 <= lo <= hi:
                raise ValueError(f"tensor {name!r} has data offsets {lo}..{hi}")
            count = 1
            for d in t["shape"]:
                count *= int(d)
            width = _DTYPE_BYTES.get(str(t["dtype"]))
            if width is not None and hi - lo != count * width:
                raise ValueError(f"tensor {name!r} ({t['dtype']}{list(t['shape'])}) spans {hi - lo} bytes, not "
                                 f"{count * width}")
            end = max(end, hi)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{p}: corrupt safetensors header ({e}; re-download or re-convert it)") from None
    have = size - 8 - n
    if have < end:
        raise ModelLoadError(f"{p}: truncated safetensors file: its header describes {end} bytes ({_mib(end)}) of "
                             f"tensor data but the file holds {have} ({_mib(have)}; {end - have} bytes missing); "
                             f"re-download or re-convert it")
    if have > end:
        raise ModelLoadError(f"{p}: corrupt safetensors file: {have - end} bytes after the last tensor's data "
                             f"(the header describes {end} bytes); re-download or re-convert it")


def checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model folder, as the loader reads them: the shards ``model.safetensors.index.json``
    names (missing ones included, so they are reported), else ``model.safetensors``, else every ``*.safetensors``;
    [] when the index is unreadable (the loader reports that)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            return [d / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    return sorted(d.glob("*.safetensors"))


def verify_checkpoint(model_dir: str | os.PathLike) -> int:
    """Verify every safetensors file of ``model_dir`` (:func:`verify_safetensors`); return how many were checked.

    Raises:
        ModelLoadError: the first bad file, or a shard the index names that is missing.
    """
    if Path(model_dir).suffix.lower() == ".gguf" and Path(model_dir).is_file():
        from ferrylm.checkpoints.gguf_reader import read_gguf

        read_gguf(model_dir)  # raises on a bad header or a tensor past the end of the file
        return 1
    files = checkpoint_files(model_dir)
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: missing (model.safetensors.index.json names it)")
        verify_safetensors(f)
    return len(files)
