"""Paged KV cache: one pool of fixed-size pages per layer and its free-list allocator.

Layout (PagedAttention, Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention"): the K and V caches of every layer are ``[num_pages * page_size, num_kv_heads, head_dim]``
tensors allocated once at boot. A request owns a *page table* (list of page ids); token ``i`` of the request lives
in slot ``page_table[i // page_size] * page_size + i % page_size``. The allocator (``engine/cache/page_allocator.py``)
hands out whole pages, reference-counted so full pages can be shared by prefix caching.

The attention backends that read the pool live in ``engine/attention/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrylm.engine.cache.page_allocator import PageAllocator


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // page_size)


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

    A model class may define ``kv_layout(config) -> KVLayout``; :meth:`of` asks it, else every layer stores
    ``num_kv_heads x head_dim`` K and V.
    """

    num_layers: int
    layers: tuple[int, ...]
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int

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

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token takes across all layers that store K/V."""
        per_layer = self.k_heads * self.k_dim + self.v_heads * self.v_dim
        return len(self.layers) * per_layer * torch.empty((), dtype=dtype).element_size()


class KVPool:
    """The cached tensors of every layer: ``k[layer]`` ``[num_pages * page_size, k_heads, k_dim]`` and ``v[layer]``
    ``[num_pages * page_size, v_heads, v_dim]`` (empty ``[0]`` tensors for layers outside ``layout.layers``).

    Memory: ``num_pages * page_size * layout.bytes_per_token(dtype)`` bytes.
    """

    def __init__(self, *, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        slots = num_pages * page_size
        stored = set(layout.layers)

        def tensor(i: int, heads: int, dim: int) -> torch.Tensor:
            if i not in stored or heads == 0:
                return torch.empty(0, dtype=dtype, device=device)
            return torch.zeros(slots, heads, dim, dtype=dtype, device=device)

        self.k = [tensor(i, layout.k_heads, layout.k_dim) for i in range(layout.num_layers)]
        self.v = [tensor(i, layout.v_heads, layout.v_dim) for i in range(layout.num_layers)]
        self.allocator = PageAllocator(num_pages)

    @property
    def num_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_pages * self.page_size

    def copy_page_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` (< ``page_size``) token slots of page ``src`` into page ``dst``, in every
        layer's K and V (the prefix cache's partial pages, ``engine/cache/prefix_cache.py``)."""
        s, d = src * self.page_size, dst * self.page_size
        if s == d:
            return
        for t in (*self.k, *self.v):
            if t.numel():
                t[d:d + num_tokens].copy_(t[s:s + num_tokens])


def slots_for(page_table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """Cache slots of token positions ``start .. end - 1`` under ``page_table``."""
    return [page_table[i // page_size] * page_size + i % page_size for i in range(start, end)]
