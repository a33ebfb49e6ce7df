"""Folders built once into the cache: streamed safetensors writing, atomic and process-safe folder building
(built in a temp folder next to the destination, then ``os.rename``, serialised by an ``fcntl`` lock file; see
:func:`build_atomically`), and content keys of source files (:func:`source_key`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ferrylm.errors import ModelLoadError

log = logging.getLogger(__name__)

#: Bump when the folders built from a source change, so cached folders made by older code are not reused.
FORMAT_VERSION = 1

# --------------------------------------------------------------------------------------------------------------
# safetensors writing (streamed)
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: ``produce()`` returns it as a C-contiguous array (numpy, or a torch tensor for bf16)
    whose bytes are exactly ``shape`` x ``dtype``; it is called once, when its turn to be written comes."""

    name: str
    dtype: str  # safetensors dtype string: "F32", "BF16", "F16", "U8", "F8_E4M3"
    shape: tuple[int, ...]
    produce: Callable[[], Any]


_ST_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "F8_E4M3": 1}


def _as_bytes(arr: Any) -> memoryview:
    """The raw bytes of a contiguous numpy array or torch tensor (bf16 viewed as int16)."""
    if not isinstance(arr, np.ndarray):  # torch.Tensor
        import torch

        t = arr.contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        elif t.dtype == torch.float8_e4m3fn:
            t = t.view(torch.uint8)
        arr = t.numpy()
    return memoryview(np.ascontiguousarray(arr)).cast("B")


def write_safetensors(path: Path, entries: list[TensorEntry], progress: Any = None) -> None:
    """Write a ``.safetensors`` file tensor by tensor, never holding more than one tensor in memory.

    Layout (huggingface/safetensors format spec): u64 little-endian header size N, N bytes of JSON header
    (``{name: {dtype, shape, data_offsets: [begin, end]}}`` + ``__metadata__``; padded with spaces to a multiple of
    8 bytes), then the tensors' bytes back to back in header order. ``__metadata__ = {"format": "pt"}`` because
    transformers refuses a file without it.

    Args:
        path: destination file.
        entries: tensors in file order.
        progress: optional tqdm-like object; ``update(nbytes)`` is called after each tensor.

    Raises:
        ValueError: a produced tensor's byte size differs from its declared shape/dtype.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for e in entries:
        n = int(np.prod(e.shape, dtype=np.int64)) * _ST_ITEMSIZE[e.dtype]
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + n]}
        off += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for e in entries:
            data = _as_bytes(e.produce())
            begin, end = header[e.name]["data_offsets"]
            if data.nbytes != end - begin:
                raise ValueError(f"{e.name}: produced {data.nbytes} bytes, header says {end - begin}")
            f.write(data)
            if progress is not None:
                progress.update(data.nbytes)


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm byte counter on stderr; silent when stderr is not a terminal (``disable=None``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None, leave=False)


# --------------------------------------------------------------------------------------------------------------
# Atomic, locked folder building
# --------------------------------------------------------------------------------------------------------------

def folder_is_complete(path: Path) -> bool:
    """True when ``path`` holds what every built folder ends with (config.json, weights, tokenizer.json)."""
    return all((path / n).is_file() for n in ("config.json", "model.safetensors", "tokenizer.json"))


def build_atomically(dest: str | Path, build: Callable[[Path], None], *, what: str = "model") -> Path:
    """Create folder ``dest`` by ``build(tmp_dir)``, atomically and at most once across processes.

    ``build`` fills a fresh temp folder ``<parent>/.<name>.tmp-XXXX``; on success it is renamed to ``dest``
    (``os.rename`` is atomic within one file system), so ``dest`` either does not exist or is complete. On any
    exception (including KeyboardInterrupt) the temp folder is removed and the exception propagates. A process
    killed outright leaves a temp folder, which the next build of the same ``dest`` removes. Concurrent builders
    serialise on ``<parent>/.<name>.lock`` (``fcntl.flock``); whoever comes second finds ``dest`` complete and
    returns it without building.

    Returns:
        ``dest`` as a Path.

    Raises:
        ModelLoadError: the parent folder cannot be created or written.
    """
    dest = Path(dest)
    if folder_is_complete(dest):
        return dest
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        lock_file = open(parent / f".{dest.name}.lock", "a+")
    except OSError as e:
        raise ModelLoadError(f"cannot write the model cache {parent}: {e}") from None
    with lock_file:  # closing the file releases the flock
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        if folder_is_complete(dest):
            return dest
        for stale in parent.glob(f".{dest.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if dest.exists():  # incomplete leftovers not made by us (we only ever rename complete folders)
            shutil.rmtree(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the final folder is an ordinary readable cache entry
        try:
            log.info("building %s into %s", what, dest)
            build(tmp)
            _fsync_tree(tmp)  # data on disk before the name appears: a crash never shows a hollow folder
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with contextlib.suppress(OSError):  # make the rename durable
            dfd = os.open(parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return dest


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


_KEY_SAMPLE = 1 << 20


def source_key(path: str | Path, *extra: object) -> str:
    """A short (10 hex chars) cache key for a source file: its size, a hash of its first and last MiB (the
    GGUF header with its metadata and tensor table, and the tail of the data) and :data:`FORMAT_VERSION`, plus
    ``extra``. By content, not mtime: the same file installed by two checkouts (two venvs) shares one built
    folder instead of building again; a different file gets a new key."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(_KEY_SAMPLE))
        if size > 2 * _KEY_SAMPLE:
            f.seek(size - _KEY_SAMPLE)
            h.update(f.read(_KEY_SAMPLE))
    raw = ":".join(str(x) for x in (size, h.hexdigest(), FORMAT_VERSION, *extra))
    return hashlib.sha256(raw.encode()).hexdigest()[:10]
