"""Paged KV cache: one pool of fixed-size pages per layer and its free-list allocator.

Layout (PagedAttention, Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention"): the K and V caches of every layer are ``[num_pages * page_size, num_kv_heads, head_dim]``
tensors allocated once at boot. A request owns a *page table* (list of page ids); token ``i`` of the request lives
in slot ``page_table[i // page_size] * page_size + i % page_size``. The allocator (``engine/cache/page_allocator.py``)
hands out whole pages, reference-counted so full pages can be shared by prefix caching.

KV cache dtype (``--kv-cache-dtype``): ``auto`` stores K/V in the model dtype; ``fp8`` stores float8 e4m3 values
with one float32 scale per (token, KV head) beside them (``k_scale`` / ``v_scale`` ``[num_slots, heads]``):
``x ~= q * scale``, ``scale = amax(|x| over the head's dims) / 448``. The scale is fixed when the token is written
(decode writes a page one token at a time, so a per-page scale would have to rescale earlier tokens; a static
per-layer scale, vLLM's default of 1.0 without calibration, clips or underflows outliers). Its cost is 4 bytes per
head and token: at head_dim 128 a token takes 0.52x its bf16 bytes. A multi-head latent row ``[c_kv ; k_pe]`` is
one head. Every backend writes through :meth:`KVPool.store` or its Triton store and reads the scales beside the
values.

The attention backends that read the pool live in ``engine/attention/``.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from ferrylm.config import KV_CACHE_DTYPES
from ferrylm.engine.cache.page_allocator import PageAllocator

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0            # largest finite float8 e4m3fn
SCALE_BYTES = 4            # one float32 scale per (token, head) of an fp8 pool
_MIN_SCALE = 1e-12         # an all-zero head keeps a positive scale


def kv_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype: ``dtype`` (the model's) for ``auto``, float8 e4m3fn for ``fp8``.

    Raises:
        ValueError: an unknown name (the message names ``--kv-cache-dtype``).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return FP8 if kv_cache_dtype == "fp8" else dtype


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (float8 e4m3fn ``[..., D]``, float32 scales ``[...]``) with ``x ~= q * scale[..., None]``,
    one scale per row of ``D`` (a head of a token)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [..., D]`` (float8) times ``scale [...]`` in ``dtype``."""
    return (q.float() * scale[..., None]).to(dtype)


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class BlockSpec:
    """A per-block cache of one layer: one row of ``width`` values per ``rate`` tokens (DeepSeek-V4's compressed
    entries, indexer keys and open-window pools). Block ``w`` of a sequence (tokens ``w * rate ..``) lives on the
    page of those tokens (``page_size % rate == 0``), row ``slot(w * rate) // rate`` of the layer's tensor, so the
    rows are allocated, shared by the prefix cache and freed with their pages.

    Attributes:
        layer, name: which cache; rate: tokens per row; width: values per row; float32: kept in float32 (pools),
            else in the model dtype.
    """

    layer: int
    name: str
    rate: int
    width: int
    float32: bool = False


@dataclass(frozen=True)
class KVLayout:
    """What one token stores in the pool, per layer that has attention state.

    Attributes:
        num_layers: decoder layers of the model (the pool's per-layer lists are indexed by layer number).
        layers: the layers that store K/V (a linear-attention layer of a hybrid stores none: its pool entries
            are empty tensors).
        k_heads, k_dim: the K tensor of one token of one layer is ``[k_heads, k_dim]``.
        v_heads, v_dim: the V tensor likewise; ``v_heads == 0`` for a layout with one cached tensor per token
            (multi-head latent attention keeps the compressed latent and the rope key in ``k`` only).
        index_dim: ``Di`` of one raw index key per token and layer, kept in the model dtype (the attention
            indexer of Qwen4-Exp, ``models/indexed_attention.py``); 0 = none.
        blocks: per-block caches (:class:`BlockSpec`), none for most models.

    A model class may define ``kv_layout(config) -> KVLayout``; :meth:`of` asks it, else every layer stores
    ``num_kv_heads x head_dim`` K and V.
    """

    num_layers: int
    layers: tuple[int, ...]
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    index_dim: int = 0
    blocks: tuple[BlockSpec, ...] = ()

    @property
    def align(self) -> int:
        """Tokens a reused prefix must be a multiple of (the largest block rate; 1 without blocks): a block's pool
        is kept only as of its block's end."""
        return max((b.rate for b in self.blocks), default=1)

    @staticmethod
    def standard(config) -> "KVLayout":
        """Every layer stores K and V of ``num_kv_heads x head_dim`` (``config``: a ModelConfig)."""
        return KVLayout(num_layers=config.num_layers, layers=tuple(range(config.num_layers)),
                        k_heads=config.num_kv_heads, k_dim=config.head_dim, v_heads=config.num_kv_heads,
                        v_dim=config.head_dim)

    @staticmethod
    def of(config) -> "KVLayout":
        """The layout of ``config``'s architecture (its model class's ``kv_layout`` when it has one)."""
        from ferrylm.models.registry import MODEL_REGISTRY, get_model_class

        if config.architecture in MODEL_REGISTRY:
            cls = get_model_class(config.architecture)
            if hasattr(cls, "kv_layout"):
                return cls.kv_layout(config)
        return KVLayout.standard(config)

    def bytes_per_token(self, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """Bytes one token takes across all layers that store K/V (``dtype``: the model's; an fp8 pool adds its
        scales)."""
        store = kv_storage_dtype(kv_cache_dtype, dtype)
        elem = torch.empty((), dtype=store).element_size()
        per_layer = (self.k_heads * self.k_dim + self.v_heads * self.v_dim) * elem
        if store == FP8:
            per_layer += (self.k_heads + self.v_heads) * SCALE_BYTES
        per_layer += self.index_dim * torch.empty((), dtype=dtype).element_size()
        model_elem = torch.empty((), dtype=dtype).element_size()
        blocks = sum(-(-b.width * (4 if b.float32 else model_elem) // b.rate) for b in self.blocks)
        return len(self.layers) * per_layer + blocks


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed pool tensor. In host memory, an anonymous mapping of its own: its pages come zeroed from the OS when
    first written, instead of being written once at boot (about 0.3 s per GiB and all of it resident), whatever the
    engine's malloc settings (``engine/host_malloc.py`` keeps blocks up to 1 GiB in the heap, where calloc writes
    its zeros)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


class KVPool:
    """The cached tensors of every layer: ``k[layer]`` ``[num_pages * page_size, k_heads, k_dim]`` and ``v[layer]``
    ``[num_pages * page_size, v_heads, v_dim]`` (empty ``[0]`` tensors for layers outside ``layout.layers``), in
    the storage dtype; an fp8 pool also has ``k_scale[layer]`` / ``v_scale[layer]`` ``[num_slots, heads]`` float32
    (empty otherwise, and always for an unscaled pool); a layout with ``index_dim`` also ``index_k[layer]``
    ``[num_slots, Di]`` in the model dtype.

    Args:
        dtype: the model's (activation) dtype: what :meth:`keys` / :meth:`values` give back.
        kv_cache_dtype: ``auto`` or ``fp8`` (module docstring).

    Memory: ``num_pages * page_size * layout.bytes_per_token(dtype, kv_cache_dtype)`` bytes.
    """

    def __init__(self, *, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, kv_cache_dtype: str = "auto"):
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        store = kv_storage_dtype(kv_cache_dtype, dtype)
        self.storage_dtype = store       # what the tensors hold (float8 e4m3fn for fp8)
        self.scaled = store == FP8
        slots = num_pages * page_size
        stored = set(layout.layers)

        def tensor(i: int, heads: int, dim: int) -> torch.Tensor:
            if i not in stored or heads == 0:
                return torch.empty(0, dtype=store, device=device)
            return pool_zeros((slots, heads, dim), store, device)

        def scales(i: int, heads: int) -> torch.Tensor:
            if i not in stored or heads == 0 or not self.scaled:
                return torch.empty(0, dtype=torch.float32, device=device)
            return torch.ones(slots, heads, dtype=torch.float32, device=device)

        self.k = [tensor(i, layout.k_heads, layout.k_dim) for i in range(layout.num_layers)]
        self.v = [tensor(i, layout.v_heads, layout.v_dim) for i in range(layout.num_layers)]
        self.k_scale = [scales(i, layout.k_heads) for i in range(layout.num_layers)]
        self.v_scale = [scales(i, layout.v_heads) for i in range(layout.num_layers)]
        self.index_k = [pool_zeros((slots, layout.index_dim), dtype, device)
                        if i in stored and layout.index_dim else torch.empty(0, dtype=dtype, device=device)
                        for i in range(layout.num_layers)]
        self.blocks: dict[tuple[int, str], torch.Tensor] = {}
        for b in layout.blocks:
            if page_size % b.rate:
                raise ValueError(f"--page-size must be a multiple of {b.rate} for this model (its layer {b.layer} "
                                 f"caches one row per {b.rate} tokens), got {page_size}")
            self.blocks[(b.layer, b.name)] = pool_zeros((slots // b.rate, b.width),
                                                        torch.float32 if b.float32 else dtype, device)
        self.allocator = PageAllocator(num_pages)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Write ``k`` (and ``v``) ``[T, heads, dim]`` at cache ``slots [T]`` (int64, all valid) of ``layer``,
        quantized for an fp8 pool (torch ops; the Triton backend has its own store kernels)."""
        self._put(self.k[layer], self.k_scale[layer], slots, k)
        if v is not None:
            self._put(self.v[layer], self.v_scale[layer], slots, v)

    def keys(self, layer: int, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``k[layer][idx]`` in ``dtype`` (dequantized for an fp8 pool): ``idx`` any int64 shape ``S`` ->
        ``[*S, heads, dim]``."""
        return self._get(self.k[layer], self.k_scale[layer], idx, dtype)

    def values(self, layer: int, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``v[layer][idx]`` in ``dtype``, as :meth:`keys`."""
        return self._get(self.v[layer], self.v_scale[layer], idx, dtype)

    def store_index(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Write raw index keys ``[T, Di]`` at cache ``slots [T]`` of ``layer`` (layout ``index_dim``)."""
        self.index_k[layer].index_copy_(0, slots, keys.to(self.dtype))

    def index_keys(self, layer: int, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``index_k[layer][idx]`` in ``dtype``: ``idx`` any int64 shape ``S`` -> ``[*S, Di]``."""
        return self.index_k[layer][idx].to(dtype)

    def _put(self, cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        if not self.scaled:
            cache.index_copy_(0, slots, x if x.dtype == cache.dtype else x.to(cache.dtype))
            return
        q, s = quantize_fp8(x)
        cache.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))   # no float8 index_copy_ on the CPU
        scale.index_copy_(0, slots, s)

    def _get(self, cache: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not self.scaled:   # index_select: a row copy each, about half the cost of indexing with idx
            x = cache.index_select(0, idx.reshape(-1)).view(*idx.shape, *cache.shape[1:])
            return x if x.dtype == dtype else x.to(dtype)
        return dequantize_fp8(cache[idx], scale[idx], dtype)

    @property
    def num_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_pages * self.page_size

    def copy_page_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` (< ``page_size``) token slots of page ``src`` into page ``dst``, in every
        layer's K and V and, in an fp8 pool, their scales, and the block rows that end within them (the prefix
        cache's partial pages, ``engine/cache/prefix_cache.py``; ``num_tokens`` a multiple of ``layout.align``)."""
        s, d = src * self.page_size, dst * self.page_size
        if s == d:
            return
        for t in (*self.k, *self.v, *self.k_scale, *self.v_scale, *self.index_k):
            if t.numel():
                t[d:d + num_tokens].copy_(t[s:s + num_tokens])
        for b in self.layout.blocks:   # the rows of the blocks that end within the copied tokens
            t, n = self.blocks[(b.layer, b.name)], num_tokens // b.rate
            t[d // b.rate:d // b.rate + n].copy_(t[s // b.rate:s // b.rate + n])


def slots_for(page_table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """Cache slots of token positions ``start .. end - 1`` under ``page_table``."""
    return [page_table[i // page_size] * page_size + i % page_size for i in range(start, end)]
