"""Read a GGUF file: its metadata and tensor table from the header (memory-mapped, no tensor data read), and a
tensor's values dequantized.

Format sources:
- GGUF container layout and metadata key names: ggml's ``docs/gguf.md`` (version 2/3: little-endian, 64-bit
  counts, ``general.alignment`` default 32).
- Block quantization formats: dequantized with ``gguf.quants.dequantize`` (the gguf-py package), so the values are
  exactly llama.cpp's.
- Q/K row order: llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders the rows of ``attn_q`` and
  ``attn_k`` inside every head from HF's "rotate halves" RoPE layout to GGML's interleaved-pairs layout;
  :func:`unpermute_rope_rows` undoes it.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ferrylm.errors import ModelLoadError

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (docs/gguf.md, enum gguf_metadata_value_type) -> struct format.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_DEQUANT_CHUNK_BYTES = 4 << 20  # raw bytes dequantized per gguf-py call


# --------------------------------------------------------------------------------------------------------------
# Reading the container
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: GGUF tensor name (e.g. ``"blk.0.attn_q.weight"``).
        shape: PyTorch order (GGUF stores ``ne0`` = the innermost dimension first; this is reversed).
        qtype: ``gguf.GGMLQuantizationType`` value (int).
        offset: absolute byte offset of the data in the file.
        nbytes: size of the (possibly quantized) data in bytes.
    """

    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int
    nbytes: int


@dataclass
class GGUFFile:
    """Parsed header of a GGUF file: metadata (key -> value; arrays as lists or numpy arrays) and tensor table."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class LazyStrings(Sequence):
    """A long GGUF string array (a vocabulary, its merges) kept as its bytes until an item is read: decoding 150k
    strings takes ~60 ms, and the config and the engine only ask for its length. Decoded once, on first use."""

    def __init__(self, blob: bytes, count: int):
        self._blob, self._count, self._items = blob, count, None

    def __len__(self) -> int:
        return self._count

    def _decoded(self) -> list[str]:
        if self._items is None:
            self._items = _Cursor(self._blob).strings(self._count, lazy=False)
            self._blob = b""
        return self._items

    def __getitem__(self, i):
        return self._decoded()[i]

    def __iter__(self):
        return iter(self._decoded())

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, LazyStrings)) and list(self) == list(other)

    def tolist(self) -> list[str]:
        return list(self._decoded())


LAZY_STRINGS_MIN = 4096   # string arrays at least this long are kept as bytes until read


class _Cursor:
    """Little-endian reader over a buffer (the header part of the mmapped file)."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def scalar(self, vtype: int) -> Any:
        fmt = _SCALAR_FORMATS[vtype]
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self) -> str:
        n = self.u64()
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s.decode("utf-8")

    def strings(self, count: int, lazy: bool = True) -> "list[str] | LazyStrings":
        """``count`` strings in a row (a vocabulary: 150k of them), in one tight loop; from
        :data:`LAZY_STRINGS_MIN` on (with ``lazy``), only their lengths are walked here."""
        buf, pos, out = self.buf, self.pos, []
        length, append = _U64.unpack_from, out.append
        if lazy and count >= LAZY_STRINGS_MIN:
            for _ in range(count):
                pos += 8 + length(buf, pos)[0]
            if pos > len(buf):
                raise struct.error("a string array runs past the end of the buffer")
            out, self.pos = LazyStrings(bytes(buf[self.pos:pos]), count), pos
            return out
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            append(buf[pos:pos + n].decode("utf-8"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.u32(), self.u64()
            if item_type == _STRING:
                return self.strings(count)
            if item_type == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY_DTYPES[item_type])
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += dtype.itemsize * count
            return arr
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.scalar(vtype)


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of a GGUF file (metadata and tensor table); tensor data is not read. The last few parses
    are kept, keyed by the file's resolved path, size and mtime (a start reads one header for resolving, the config,
    the checkpoint check and the tokenizer; a large vocabulary takes ~0.4 s to parse). Treat the result as
    read-only.

    Layout per ggml ``docs/gguf.md``: magic ``GGUF``, u32 version (2 or 3), u64 tensor count, u64 metadata count,
    the key/value pairs, the tensor infos (name, u32 n_dims, u64 dims[ne0 first], u32 type, u64 offset), then the
    data section aligned to ``general.alignment`` (default 32) bytes.

    Raises:
        ModelLoadError: the file cannot be read, is not GGUF, has an unsupported version or is truncated.
    """
    path = Path(path)
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from None
    return _read_gguf_cached(key, path)


@functools.lru_cache(maxsize=4)
def _read_gguf_cached(key: tuple, path: Path) -> GGUFFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != _GGUF_MAGIC:
                raise ModelLoadError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
            cur = _Cursor(buf)
            cur.pos = 4
            version = cur.u32()
            if version not in (2, 3):
                raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            n_tensors, n_kv = cur.u64(), cur.u64()
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                meta[key] = cur.value(cur.u32())
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                ne = [cur.u64() for _ in range(cur.u32())]
                qtype, rel = cur.u32(), cur.u64()
                infos.append((name, ne, qtype, rel))
            align = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
            data_start = (cur.pos + align - 1) // align * align
            size = len(buf)
    except ModelLoadError:
        raise
    except (struct.error, IndexError):
        raise ModelLoadError(f"{path} is truncated: its header runs past the end of the file "
                             f"({path.stat().st_size} bytes); download it again") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from None

    tensors = []
    for name, ne, qtype, rel in infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path}: tensor {name} has unknown GGML type {qtype}") from None
        nrows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
        nbytes = nrows * (ne[0] // block) * type_size
        start = data_start + rel
        if start + nbytes > size:
            raise ModelLoadError(f"{path} is truncated: tensor {name} ends past the end of the file")
        tensors.append(GGUFTensor(name, tuple(int(d) for d in reversed(ne)), qtype, start, nbytes))
    return GGUFFile(path, version, meta, tensors)


def dequantize_tensor(data: np.ndarray, t: GGUFTensor) -> np.ndarray:
    """Dequantize one tensor to float32 with ``gguf.quants.dequantize`` (llama.cpp's formulas, exact values).

    Args:
        data: the whole file as a uint8 array (a plain view of an ``np.memmap``).
        t: the tensor's info from :func:`read_gguf`.

    Returns:
        float32 array of shape ``t.shape`` (PyTorch order).
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(t.qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = data[t.offset:t.offset + t.nbytes]
    # Blocks are independent, so dequantize in flat chunks of whole blocks: gguf-py would otherwise loop over
    # 16-row groups (slow for small rows), and one huge chunk would need several tensor-sized temporaries.
    step = max(1, _DEQUANT_CHUNK_BYTES // type_size) * type_size
    out = np.empty(t.nbytes // type_size * block, dtype=np.float32)
    for begin in range(0, t.nbytes, step):
        chunk = raw[begin:begin + step]
        first = begin // type_size * block
        out[first:first + len(chunk) // type_size * block] = dequantize(chunk.reshape(1, -1), qtype).ravel()
    return out.reshape(t.shape)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``, ``LlamaModel.permute``).

    HF Llama applies RoPE to the two halves of each head (dims ``j`` and ``j + d/2`` rotate together); GGML rotates
    adjacent pairs (``2j``, ``2j + 1``). The converter therefore stores HF row ``i * d/2 + j`` (half ``i``, pair
    ``j``) of each head at row ``2j + i``. This maps it back.

    Args:
        w: ``[n_heads * head_dim, in_features]`` (or 1-D bias ``[n_heads * head_dim]``) in GGUF row order.
        n_heads: query heads for ``attn_q``, key/value heads for ``attn_k``.

    Returns:
        A new array in HF row order, same shape.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"cannot un-permute RoPE rows: {rows} rows is not a multiple of 2 x {n_heads} heads")
    half = rows // n_heads // 2
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _f32_clean(v: float) -> float:
    """A GGUF FLOAT32 value as the shortest decimal that rounds to the same float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(v)))
