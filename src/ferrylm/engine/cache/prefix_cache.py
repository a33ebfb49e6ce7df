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

Partial pages (turn boundaries): a conversation re-sent with its history rarely ends a turn on a page boundary, so
the cache also keeps *tails*: at the end of a request's prompt and at the end of what it computed when it finishes
(:meth:`PrefixCache.record_tail`), the page holding that point, by (page, allocator generation), under the name of
the full page before it, with its tokens up to the point. Those tokens' K/V stay valid while the page is not handed
out again (later writes go past them), and a finished request's partial last page is released to the LRU tail like
a named page. A new request that matches full pages then looks for a tail right after them
(:meth:`PrefixCache.lookup_tail`): the longest run of tokens it shares with one (attention K/V is per token), or,
for hybrid models, a whole tail whose state snapshot is kept (a state exists only at the tail's end). Its first page
past the full ones is a fresh page into which those tokens' K/V are copied (:meth:`PrefixCache.map_tail`), never the
tail's page itself. Tails need a copy function (the KV pool's); without one (tensor parallel: the copy would have to
run on every rank) only full pages are shared.

Requests that ask for prompt logprobs are not matched (their prompt must go through the forward).
Cost: one hash per full page (no per-token Python loop: tokens are packed by ``array``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
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


def tail_name(prev: bytes, tokens: list[int]) -> bytes:
    """The name of a partial page: ``tokens`` (1 .. page_size - 1 of them) after the page named ``prev`` (the seed
    for page 0); never equal to a full page's name (a hash of its own person)."""
    h = hashlib.blake2b(prev, digest_size=16, person=b"ferrylm-tail")
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(frozen=True)
class TailHit:
    """``length`` tokens a request reuses from the start of cached page ``page``."""

    page: int
    length: int


@dataclass(frozen=True)
class _Tail:
    page: int
    generation: int
    tokens: tuple[int, ...]


#: tails kept after one full page (the newest first): a page re-sent with different continuations
TAILS_PER_PREFIX = 4


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
        copy_prefix: ``(src_page, dst_page, num_tokens)`` copies the K/V of a page's first tokens (the KV pool's
            ``copy_page_prefix``); None: no tails, only full pages are shared.
        align: a tail is reused only up to a multiple of this many tokens (the pool's ``layout.align``: a model with
            per-block caches keeps a block's state only as of its end).
    """

    def __init__(self, allocator: PageAllocator, page_size: int, seed: bytes,
                 copy_prefix: Callable[[int, int, int], None] | None = None, align: int = 1):
        self.allocator = allocator
        self.align = align
        self.page_size = page_size
        self.seed = seed
        self.copy_prefix = copy_prefix
        self.stats = PrefixCacheStats()
        # the name of the full page before (the seed for page 0) -> its tails, newest first; least recently used first
        self._tails: OrderedDict[bytes, list[_Tail]] = OrderedDict()
        self._tail_pages: dict[int, int] = {}   # page -> generation when its last tail was recorded

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

    # --- partial pages (tails) --------------------------------------------------------------------------------
    def point_name(self, req: Request, n: int) -> bytes:
        """The name of ``req``'s first ``n`` (>= 1) tokens: its page name on a page boundary, else a tail name."""
        full, rest = divmod(n, self.page_size)
        prev = self._hashes(req, full)[-1] if full else self.seed
        return prev if not rest else tail_name(prev, req.tokens(full * self.page_size, n))

    def record_tail(self, req: Request, n: int) -> None:
        """Keep ``req``'s first ``n`` computed tokens as a tail (nothing when ``n`` ends on a page boundary, the
        full pages being named, or without a copy function). Tails after at most ``allocator.num_pages`` full pages
        are kept, the least recently used dropped first."""
        full, rest = divmod(n, self.page_size)
        if self.copy_prefix is None or not rest or n > req.num_computed_tokens:
            return
        page = req.page_table[full]
        tail = _Tail(page, self.allocator.generation(page), tuple(req.tokens(full * self.page_size, n)))
        prev = self._hashes(req, full)[-1] if full else self.seed
        kept = [t for t in self._tails.pop(prev, []) if t.tokens != tail.tokens and self._valid(t)]
        self._tails[prev] = [tail, *kept][:TAILS_PER_PREFIX]
        self._tail_pages[page] = tail.generation
        while len(self._tails) > self.allocator.num_pages:
            self._tails.popitem(last=False)

    def _valid(self, tail: _Tail) -> bool:
        return self.allocator.generation(tail.page) == tail.generation

    def holds_tail(self, page: int) -> bool:
        """Whether ``page`` holds a tail recorded since it was last handed out (release it with ``keep``)."""
        return self._tail_pages.get(page) == self.allocator.generation(page)

    def lookup_tail(self, req: Request, full: int, usable: Callable[[bytes], bool] | None = None) -> TailHit | None:
        """The tail ``req`` reuses right after its first ``full`` pages (a lookup's hit), at least one known token
        left to compute: the longest run of tokens it shares with a valid tail, or with ``usable`` (hybrid models:
        whether the state snapshot of a point name is kept) only a whole tail that is usable. None when there is
        none or ``req`` is not matched at all (see :meth:`lookup`)."""
        if (self.copy_prefix is None or not self._tails or req.page_table or req.num_computed_tokens
                or req.params.prompt_logprobs is not None):
            return None
        start = full * self.page_size
        longest = min(self.page_size - 1, req.num_tokens - 1 - start)
        if longest <= 0:
            return None
        prev = self._hashes(req, full)[-1] if full else self.seed
        want = req.tokens(start, start + longest)
        best: TailHit | None = None
        for t in self._tails.get(prev, ()):
            if not self._valid(t):
                continue
            j = 0
            for a, b in zip(t.tokens, want):
                if a != b:
                    break
                j += 1
            j -= j % self.align
            if usable is not None and (j < len(t.tokens) or not usable(tail_name(prev, want[:j]))):
                continue
            if j and (best is None or j > best.length):
                best = TailHit(t.page, j)
        if best is not None:
            self._tails.move_to_end(prev)
        return best

    def map_tail(self, req: Request, hit: TailHit) -> None:
        """Copy ``hit``'s tokens into ``req``'s page past its mapped full pages (allocated already, nothing written
        since, so the tail's page still holds them even when it is that very page or another one ``req`` was just
        given) and advance ``req`` past them."""
        self.copy_prefix(hit.page, req.page_table[req.num_computed_tokens // self.page_size], hit.length)
        req.num_computed_tokens += hit.length
        if req.first_scheduled_time is None:
            req.num_cached_tokens = (req.num_cached_tokens or 0) + hit.length

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
