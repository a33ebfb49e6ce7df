"""KV page allocator: reference-counted pages, optionally named by a content hash (automatic prefix caching).

Every page ``0 .. num_pages - 1`` is in exactly one of three states:

- *free*: reference count 0, no name;
- *cached*: reference count 0, named by the hash of the full page of tokens it holds (``engine/cache/prefix_cache.py``):
  its K/V stay valid and a later request with the same prefix maps it instead of recomputing it;
- *owned*: reference count >= 1 (named or not). Only named pages are ever shared (count > 1).

Free and cached pages together are the *available* pages (:attr:`PageAllocator.num_free`), kept in one LRU order
(an ``OrderedDict``: every operation O(1)). :meth:`allocate` hands out the head: unnamed pages are put at the head
when they are released (reused first), named ones at the tail (kept longest); taking a named page evicts its name.
With no names ever given (prefix caching off) this is a plain free-list allocator.

Each page has a *generation*, counted up every time :meth:`allocate` hands it out: the prefix cache's partial-page
entries (``engine/cache/prefix_cache.py``) hold a page by (id, generation), valid while the page was not handed out
again. :meth:`free` with ``keep`` puts such unnamed pages at the LRU tail, kept like named ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class OutOfPages(Exception):
    """The allocator has fewer available pages than asked for (the scheduler preempts or waits)."""


class PageAllocator:
    """Reference-counted allocator of page ids ``0 .. num_pages - 1`` with an LRU of available pages.

    Invariant (checked by :meth:`check`): every page is free, cached or owned; a page's reference count is the
    number of page tables holding it; only named pages are held by more than one table; names and pages map one to
    one; available + owned = total.

    Counters: ``num_evictions`` (named pages whose name was dropped to hand them out).
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._ref = [0] * num_pages
        self._avail: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._name_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._generation = [0] * num_pages
        self.num_evictions = 0

    # --- sizes ---------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages :meth:`allocate` can hand out now (free + cached-unreferenced)."""
        return len(self._avail)

    @property
    def num_used(self) -> int:
        """Pages held by at least one request."""
        return self.num_pages - len(self._avail)

    @property
    def num_cached(self) -> int:
        """Named pages (held or not)."""
        return len(self._name_of)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def generation(self, page: int) -> int:
        """How many times ``page`` was handed out by :meth:`allocate`."""
        return self._generation[page]

    # --- allocation ----------------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages (reference count 1 each), evicting the least recently released named pages when the
        unnamed ones run out. Raises OutOfPages (allocating nothing) when fewer than ``n`` are available."""
        if n > len(self._avail):
            raise OutOfPages(f"asked for {n} pages, {len(self._avail)} free")
        out = []
        for _ in range(n):
            p, _ = self._avail.popitem(last=False)
            name = self._name_of.pop(p, None)
            if name is not None:
                del self._page_of[name]
                self.num_evictions += 1
            self._ref[p] = 1
            self._generation[p] += 1
            out.append(p)
        return out

    def free(self, pages: Iterable[int], keep: frozenset[int] = frozenset()) -> None:
        """Drop one reference to each page; a page nobody holds any more becomes available (a named one, or one in
        ``keep``, at the LRU tail, in the order given: pass a page table reversed so its last pages are evicted
        first; any other at the head, reused first)."""
        for p in pages:
            r = self._ref[p] - 1
            if r < 0:
                raise AssertionError(f"page {p} freed more often than it was held")
            self._ref[p] = r
            if r == 0:
                self._avail[p] = None
                if p not in self._name_of and p not in keep:
                    self._avail.move_to_end(p, last=False)

    # --- names (prefix caching) ----------------------------------------------------------------------------------
    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """The pages named ``names[0]``, ``names[1]``, ... up to the first name not cached (no state change)."""
        out = []
        for h in names:
            p = self._page_of.get(h)
            if p is None:
                break
            out.append(p)
        return out

    def num_unheld(self, pages: Iterable[int]) -> int:
        """How many of ``pages`` nobody holds (acquiring them takes them out of the available pages)."""
        return sum(1 for p in pages if self._ref[p] == 0)

    def acquire(self, pages: Iterable[int]) -> None:
        """Add one reference to each (named) page, taking unheld ones out of the available pages."""
        for p in pages:
            if self._ref[p] == 0:
                del self._avail[p]
            self._ref[p] += 1

    def name(self, page: int, name: bytes) -> bool:
        """Name a held page by its content hash. False (nothing changes) when the page has a name already or another
        page has this name (two requests computed the same page: the first one stays the shared copy)."""
        if page in self._name_of or name in self._page_of:
            return False
        self._name_of[page] = name
        self._page_of[name] = page
        return True

    def name_of(self, page: int) -> bytes | None:
        return self._name_of.get(page)

    # --- invariants ----------------------------------------------------------------------------------------------
    def check(self, owned: list[list[int]]) -> None:
        """Assert the invariants given every owner's page table. Raises AssertionError with the violation."""
        count = [0] * self.num_pages
        for table in owned:
            assert len(set(table)) == len(table), f"a page table holds a page twice: {table[:16]}"
            for p in table:
                assert 0 <= p < self.num_pages, f"page {p} out of range"
                count[p] += 1
        for p in range(self.num_pages):
            held = count[p]
            assert held == self._ref[p], f"page {p}: held by {held} tables, reference count {self._ref[p]}"
            assert (held == 0) == (p in self._avail), (
                f"page {p}: held by {held} tables but {'' if p in self._avail else 'not '}available")
            assert held <= 1 or p in self._name_of, f"page {p} owned twice without a name"
        assert len(self._name_of) == len(self._page_of), "names and pages are not one to one"
        for p, h in self._name_of.items():
            assert self._page_of.get(h) == p, f"page {p}: its name maps to page {self._page_of.get(h)}"
        used = sum(1 for c in count if c)
        assert len(self._avail) + used == self.num_pages, (
            f"free {len(self._avail)} + used {used} != total {self.num_pages} (leaked pages)")
