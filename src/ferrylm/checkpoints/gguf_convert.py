"""Convert a Llama-architecture GGUF file into a standard Hugging Face model folder.

The folder holds ``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (every tensor dequantized to float32,
bit-exact to what the GGUF encodes), ``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template) and
``generation_config.json``. Everything downstream (our loader, transformers) then reads one format only.

Format sources:
- GGUF container layout and metadata key names: ggml's ``docs/gguf.md`` (version 2/3: little-endian, 64-bit
  counts, ``general.alignment`` default 32).
- Block quantization formats: dequantized with ``gguf.quants.dequantize`` (the gguf-py package), so the values are
  exactly llama.cpp's.
- Q/K row order: llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders the rows of ``attn_q`` and
  ``attn_k`` inside every head from HF's "rotate halves" RoPE layout to GGML's interleaved-pairs layout;
  :func:`unpermute_rope_rows` undoes it.

Conversion is atomic (built in a temp folder next to the destination, then ``os.rename``) and serialised across
processes by an ``fcntl`` lock file, see :func:`build_atomically`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ferrylm.errors import ModelLoadError
from ferrylm.checkpoints.gguf_tokenizer import gguf_tokenizer

log = logging.getLogger(__name__)

#: Bump when the produced folder changes, so cached conversions made by older code are not reused.
FORMAT_VERSION = 1

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (docs/gguf.md, enum gguf_metadata_value_type) -> struct format.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
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

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.u32(), self.u64()
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
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
    except (OSError, ValueError, struct.error, UnicodeDecodeError, IndexError) as e:
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


# --------------------------------------------------------------------------------------------------------------
# Llama mapping
# --------------------------------------------------------------------------------------------------------------

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


# GGUF per-block tensor names (llama.cpp gguf-py tensor_mapping, LLM_ARCH_LLAMA) -> HF Llama names.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF Llama tensor name to its HF ``LlamaForCausalLM`` name.

    Raises:
        ModelLoadError: the name is not part of the Llama layout we convert (e.g. ``rope_freqs.weight``).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES \
            and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not supported by the Llama converter")


def _f32_clean(v: float) -> float:
    """A GGUF FLOAT32 value as the shortest decimal that rounds to the same float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(v)))


def llama_config_from_gguf(g: GGUFFile) -> dict[str, Any]:
    """Build a HF ``LlamaForCausalLM`` config.json dict from the GGUF's ``llama.*`` / ``tokenizer.ggml.*`` metadata.

    Raises:
        ModelLoadError: not a ``llama`` architecture, a required key is missing, or a feature we do not convert
            (partial rotary, RoPE scaling, per-layer head counts).
    """
    arch = g.get("general.architecture")
    if arch != "llama":
        from ferrylm.checkpoints.gguf_archs import unsupported

        raise unsupported(g.path, arch)

    def req(key: str) -> Any:
        v = g.get(f"llama.{key}")
        if v is None:
            raise ModelLoadError(f"{g.path}: GGUF metadata lacks 'llama.{key}'")
        if isinstance(v, np.ndarray):
            raise ModelLoadError(f"{g.path}: per-layer 'llama.{key}' is not supported")
        return v

    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    kv_heads = int(g.get("llama.attention.head_count_kv", heads))
    head_dim = int(g.get("llama.attention.key_length", hidden // heads))
    rope_dim = int(g.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"{g.path}: partial rotary (rope dims {rope_dim} < head_dim {head_dim}) unsupported")
    scaling = g.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{g.path}: RoPE scaling {scaling!r} is not supported by the converter")
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = int(g.get("llama.vocab_size") or (len(tokens) if tokens is not None else 0))
    if not vocab:
        raise ModelLoadError(f"{g.path}: cannot tell the vocabulary size")
    tied = all(t.name != "output.weight" for t in g.tensors)
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": int(req("context_length")),
        "rms_norm_eps": _f32_clean(req("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_clean(g.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in g.tensors),
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        v = g.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if v is not None:
            cfg[hf_key] = int(v)
    return cfg


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
    """True when ``path`` holds what every converted folder ends with (config.json, weights, tokenizer.json)."""
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
    ``extra``. By content, not mtime: the same file installed by two checkouts (two venvs) shares one converted
    folder instead of converting again (issue 26: 1.3 GB per checkout); a different file gets a new key."""
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


# --------------------------------------------------------------------------------------------------------------
# The conversion
# --------------------------------------------------------------------------------------------------------------

def _tensor_entries(g: GGUFFile, data: np.ndarray, cfg: dict[str, Any]) -> list[TensorEntry]:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    entries = []
    for t in g.tensors:
        hf = hf_tensor_name(t.name)
        perm = heads if ".attn_q." in t.name else kv_heads if ".attn_k." in t.name else 0

        def produce(t: GGUFTensor = t, perm: int = perm) -> np.ndarray:
            w = dequantize_tensor(data, t)
            return unpermute_rope_rows(w, perm) if perm else w

        entries.append(TensorEntry(hf, "F32", t.shape, produce))
    return entries


def convert_gguf_into(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True) -> None:
    """Convert ``gguf_path`` into the existing, empty folder ``out_dir`` (no atomicity; see :func:`convert_gguf`).

    Raises:
        ModelLoadError: unreadable GGUF, unsupported architecture/tensor/tokenizer.
    """
    g = read_gguf(gguf_path)
    from ferrylm.checkpoints.gguf_config import is_moe_gguf

    if is_moe_gguf(g):  # the MoE architectures of gguf_archs: experts stay quantized
        from ferrylm.checkpoints.quant.gguf_moe import convert_moe_gguf_into

        convert_moe_gguf_into(g, Path(out_dir), progress=progress)
        return
    cfg = llama_config_from_gguf(g)
    out = Path(out_dir)
    data = np.asarray(np.memmap(g.path, dtype=np.uint8, mode="r"))  # plain ndarray view: cheap slicing
    entries = _tensor_entries(g, data, cfg)
    names = {e.name for e in entries}
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}.weight" for i in range(cfg["num_hidden_layers"]) for n in _BLOCK_NAMES.values()}
    if missing := sorted(expected - names):
        raise ModelLoadError(f"{g.path}: GGUF lacks tensors, e.g. {missing[0]} ({len(missing)} missing)")
    total = sum(int(np.prod(e.shape)) * 4 for e in entries)
    bar = progress_bar(total, f"converting {g.path.name}") if progress else None
    try:
        write_safetensors(out / "model.safetensors", entries, bar)
    finally:
        if bar is not None:
            bar.close()
    gguf_tokenizer(g.path).save_pretrained(str(out))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    # config.json last: a folder is only "complete" once it exists (folder_is_complete), belt and braces.
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def convert_gguf(gguf_path: str | Path, dest: str | Path, *, progress: bool = True) -> Path:
    """Convert a Llama GGUF file into the HF folder ``dest`` unless it already exists; atomic and process-safe.

    Weights are dequantized to float32 (exact), Q/K rows un-permuted (:func:`unpermute_rope_rows`), names mapped
    to HF Llama names (:func:`hf_tensor_name`). Takes a few seconds for a 135M-parameter model.

    Returns:
        ``dest`` (a complete folder).

    Raises:
        ModelLoadError: the file is not a convertible GGUF, or the cache folder is not writable.
    """
    gguf_path = Path(gguf_path)
    return build_atomically(dest, lambda tmp: convert_gguf_into(gguf_path, tmp, progress=progress),
                            what=f"HF folder from {gguf_path.name}")
