"""Automatic prefix caching (vLLM's semantics): full KV pages named by a hash chained over their tokens.

The name of a request's page ``i`` (tokens ``i * page_size .. (i + 1) * page_size - 1``) is
``blake2b-128(name of page i-1 || tokens of page i)``, page 0 chained from the cache's *seed* (a digest of
everything else that changes the K/V of a token sequence: the model's config and weights identity, the KV
dtype). Equal names therefore mean equal token prefixes, hence equal K/V.

- A page is named once its last token is computed (:meth:`PrefixCache.commit`, called by the scheduler before a
  request's pages are released and when it plans a step); the partial last page of a request is never named, so
  never shared, and a named page is never written again (writes go to positions past ``num_computed_tokens``).
- A new request (or one recomputed after preemption) maps the longest run of named pages matching its tokens
  (:meth:`PrefixCache.lookup`); its ``num_computed_tokens`` starts past them. The match stops before the page
  holding the request's last known token, so at least that token is computed (it gives the logits to sample) and
  no shared page is ever written.
- Named pages nobody holds stay in the allocator's LRU until a new page is needed (``engine/cache/page_allocator.py``).
- The cache lives in the engine process: an engine restart starts empty.

Requests that ask for prompt logprobs are not matched (their prompt must go through the forward).
Cost: one hash per full page (no per-token Python loop: tokens are packed by ``array``).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from ferrylm.engine.cache.page_allocator import PageAllocator
from ferrylm.engine.request import Request


def cache_seed(*parts: object) -> bytes:
    """A 16-byte seed from the reprs of ``parts`` (model config, dtype, ...): caches of different seeds never
    share a page name."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return h.digest()


def chain_hashes(seed: bytes, prev: list[bytes], tokens: list[int], page_size: int) -> None:
    """Extend ``prev`` (the names of pages ``0 .. len(prev) - 1``) with the names of every further full page of
    ``tokens`` (the whole token sequence, prompt then output)."""
    n_full = len(tokens) // page_size
    last = prev[-1] if prev else seed
    for i in range(len(prev), n_full):
        h = hashlib.blake2b(last, digest_size=16)
        h.update(array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes())
        last = h.digest()
        prev.append(last)


@dataclass
class PrefixCacheStats:
    """Counters in tokens (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``): ``queries`` the prompt
    tokens looked up at each request's first scheduling, ``hits`` of them found cached."""

    queries: int = 0
    hits: int = 0


class PrefixCache:
    """Names, looks up and maps full KV pages of requests over a :class:`PageAllocator`.

    Args:
        allocator: the KV pool's page allocator (names live there, with the LRU).
        page_size: tokens per page.
        seed: :func:`cache_seed` of what changes the K/V besides the tokens.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, seed: bytes):
        self.allocator = allocator
        self.page_size = page_size
        self.seed = seed
        self.stats = PrefixCacheStats()

    def _hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """``req``'s page names, computed up to ``num_pages`` full pages (fewer if it has fewer)."""
        hs = req.page_hashes
        if len(hs) < num_pages:
            end = min(num_pages * self.page_size, req.num_tokens)
            chain_hashes(self.seed, hs, req.tokens(0, end), self.page_size)
        return hs[:num_pages]

    def names(self, req: Request, num_pages: int) -> list[bytes]:
        """The names of ``req``'s first ``num_pages`` full pages (fewer if it has fewer), computed as needed."""
        return self._hashes(req, num_pages)

    def lookup(self, req: Request) -> list[int]:
        """The cached pages ``req`` can map (a prefix of its pages; nothing changes). Empty for a request that
        holds pages already or asks for prompt logprobs."""
        if req.page_table or req.num_computed_tokens or req.params.prompt_logprobs is not None:
            return []
        max_pages = (req.num_tokens - 1) // self.page_size   # the last known token is always computed
        if max_pages <= 0:
            return []
        return self.allocator.lookup(self._hashes(req, max_pages))

    def map(self, req: Request, pages: list[int]) -> None:
        """Give ``req`` (holding no pages) the looked-up ``pages``, one more reference each: its computation
        starts past them. Records its cached-token count until its first scheduling."""
        if pages:
            self.allocator.acquire(pages)
            req.page_table = list(pages)
            req.num_computed_tokens = len(pages) * self.page_size
            req.num_named_pages = len(pages)
        if req.first_scheduled_time is None:
            req.num_cached_tokens = len(pages) * self.page_size

    def count(self, req: Request) -> None:
        """Count ``req``'s lookup in the stats (once, at its first scheduling)."""
        self.stats.queries += req.num_prompt_tokens
        self.stats.hits += min(req.num_cached_tokens or 0, req.num_prompt_tokens)

    def commit(self, req: Request) -> None:
        """Name ``req``'s pages whose tokens are all computed and that have no name yet."""
        full = min(req.num_computed_tokens // self.page_size, len(req.page_table))
        if full <= req.num_named_pages:
            return
        hs = self._hashes(req, full)
        for i in range(req.num_named_pages, full):
            self.allocator.name(req.page_table[i], hs[i])
        req.num_named_pages = full
