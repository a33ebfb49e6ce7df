"""Continuous batching with chunked prefill and preemption by recompute.

Each step builds one batch under two limits: at most ``max_running_requests`` running requests, and at most
``max_prefill_length`` new tokens (decode tokens count one each). The plan is built in named sub-steps:

1. ``_schedule_running``: every running request gets its next tokens (1 for decode, a chunk of the rest of its
   prompt otherwise). Decodes come first: a prefill chunk is cut to the budget less the decodes still to
   schedule, so every running stream gets its next token in every step whatever prompt is being prefilled beside
   it (a step is then at most ``max_prefill_length`` tokens: that bounds the streams' inter-token latency).
   When the pool is out of pages, the newest running request is preempted (pages freed, requeued at the front
   of the waiting queue, recomputed later) — the scheduler never crashes for lack of pages.
   A request alone in the pool that still cannot grow ends with finish reason "length" instead of thrashing.
   Short prompts waiting: a running prefill chunk leaves room (at most a quarter of the budget) for the waiting
   prompts short enough to fit it, so a short request that arrives during a long prefill starts in the next step
   instead of after the whole prompt (vLLM's long-prefill threshold plays this part).
2. ``_schedule_waiting``: waiting requests in arrival order join while slots, budget and free pages allow. A
   request that does not fit the free pages *now* is skipped, not waited on, so it never blocks smaller requests
   behind it (no head-of-line deadlock). Requests that can never fit were rejected at admission.
   Aging: each round in which a skipped request is passed over (a request behind it is admitted) counts; once it
   was passed over ``aging_rounds`` times, nothing behind it is admitted any more, so the pages running requests
   free go to it. Its wait is then bounded by the running requests' remaining work, whatever keeps arriving.
   A preempted request comes back only when the free pages hold its whole sequence plus a page per running
   request (``_room_to_resume``); on its next chunk alone it would be the newest again at the next page a running
   request needs, and the two would preempt each other at every page.
   Isolation: a request marked ``isolate`` (a suspect of an earlier engine failure) waits until nothing runs,
   then runs alone, and nothing is admitted while it runs.
   Prefix caching (``prefix_cache`` given): a request with no pages first maps the longest cached run of its full
   pages (``engine/cache/prefix_cache.py``) and the tokens of a cached partial page after them (copied into its own
   page); its chunk starts past them and only the rest counts against the budget and the free pages. It is admitted only if the rest fits too (the looked-up pages count: mapping an unheld cached
   page takes it out of the available ones), so a skipped request holds nothing.

Recurrent state (models with linear-attention layers, ``state_pool`` given): a request is admitted only while a
state slot is free (it then takes one; otherwise it waits like a request short of pages, holding nothing), and
every release (finish, abort, preemption, the OOM guard) gives the slot back in :meth:`Scheduler._release`.
With prefix caching on, such a model also has state snapshots (``engine/cache/state_snapshots.py``): a request maps only
the cached tokens up to the last point whose state has a snapshot, which is copied into its slot at admission, and
prefill chunks of several pages end on page boundaries and one token before the prompt's end (so each prompt's full
pages and its prompt point get a snapshot).

Turn points (agent turns re-sent with their history): after each step, a request that reached its prompt's point
(its end; one token before for hybrid models) keeps it, and a request that finishes keeps the end of what it
computed (its prompt and output but the last sampled token): a partial-page tail (``PrefixCache.record_tail``) and,
for hybrid models, a state snapshot evicted after the page-boundary ones. The next turn then recomputes only its
new tokens and that last token; one whose template drops the answer's reasoning resumes at the prompt's point.

Pages computed so far are named (``PrefixCache.commit``) at the start of each plan and before any release
(finish, preemption), so what a finished or preempted request computed stays cached.

Design after vLLM v1's token-budget scheduler (request counters catching up), split into sub-steps.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ferrylm.engine.cache.kv_pool import pages_needed
from ferrylm.engine.cache.page_allocator import PageAllocator
from ferrylm.engine.cache.prefix_cache import PrefixCache, TailHit
from ferrylm.engine.request import Request, Status
from ferrylm.faults import NO_FAULTS, FaultInjector


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits: ``max_running_requests`` (requests), ``max_prefill_length`` (tokens per step), ``page_size``;
    ``aging_rounds``: times a waiting request may be passed over by later arrivals before nothing may pass it."""

    max_running_requests: int
    max_prefill_length: int
    page_size: int
    aging_rounds: int = 16


@dataclass
class ScheduledSeq:
    """``request`` computes tokens ``start .. start + num_tokens - 1`` this step; ``sample`` when the chunk
    reaches the end of its known tokens (so a next token is produced)."""

    request: Request
    start: int
    num_tokens: int

    @property
    def sample(self) -> bool:
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class Batch:
    """One step's plan. ``truncated``: requests ended with "length" because the whole KV pool cannot hold their
    next token (they were alone and still short of pages)."""

    seqs: list[ScheduledSeq]
    preempted: list[Request]
    truncated: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass
class TokenUpdate:
    """A sampled token committed to its request (``row``: its row in the step's samples). ``finish_reason`` when
    it ended the request; ``grammar_error`` when the request's structured output cannot go on (it ended, aborted)."""

    request: Request
    token: int
    row: int
    finish_reason: str | None = None
    grammar_error: str | None = None


def stop_reason(r: Request, tok: int, eos_ids: tuple[int, ...], max_model_len: int) -> str | None:
    """``"stop"`` (EOS, a stop token), ``"length"`` (max_tokens, the context) or None after ``tok`` was appended."""
    p = r.params
    if r.min_tokens_met and ((not p.ignore_eos and tok in eos_ids) or tok in p.stop_token_ids):
        return "stop"
    if r.num_output_tokens >= p.max_tokens or r.num_tokens >= max_model_len:
        return "length"
    return None


class Scheduler:
    """Owns the waiting and running queues and the page tables (through the allocator).

    ``prefill_budget`` (tokens per step) starts at ``config.max_prefill_length``; the OOM guard lowers it for a
    while (:meth:`set_prefill_budget`). ``faults``: the fault injector (point ``kv_page_alloc``). ``growing``: the
    request whose pages are being allocated (set while :meth:`_grow` runs, so an allocation failure there can be
    pinned on it). ``prefix_cache``: automatic prefix caching over ``allocator`` (None: off)."""

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, faults: FaultInjector = NO_FAULTS,
                 prefix_cache: PrefixCache | None = None, state_pool=None, state_snapshots=None):
        self.config = config
        self.state_pool = state_pool   # engine/cache/state_pool.StatePool of a hybrid model (None: no recurrent state)
        self.state_snapshots = state_snapshots   # engine/cache/state_snapshots.StateSnapshots (hybrid + prefix caching)
        self.allocator = allocator
        self.faults = faults
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefill_budget = config.max_prefill_length
        self.growing: Request | None = None

    # --- queue operations -------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished and free its pages at once. Safe to call on a waiting or running request."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def set_prefill_budget(self, tokens: int) -> None:
        """Set the per-step token budget (tokens, 1 .. ``config.max_prefill_length``) until set again."""
        self.prefill_budget = max(1, min(int(tokens), self.config.max_prefill_length))

    def preempt(self, req: Request) -> None:
        """Preempt the running ``req`` now (pages freed, requeued first, recomputed later)."""
        self._preempt(req)

    # --- planning ---------------------------------------------------------------------------------------------
    def schedule(self) -> Batch:
        """Plan the next step. The returned seqs own the pages they need for this step."""
        budget = self.prefill_budget
        if self.prefix_cache is not None:
            for r in self.running:   # what the last step computed becomes shareable
                self.prefix_cache.commit(r)
        seqs, preempted, truncated, budget = self._schedule_running(budget, self._short_waiting_tokens(budget))
        seqs += self._schedule_waiting(budget)
        return Batch(seqs=seqs, preempted=preempted, truncated=truncated)

    def _short_waiting_tokens(self, budget: int) -> int:
        """Tokens the waiting short prompts need (each at most a quarter of ``budget``, in arrival order, at most a
        quarter of ``budget`` in all; 0 when no slot is free for them): what a running prefill leaves for them."""
        cap = budget // 4
        free_slots = self.config.max_running_requests - len(self.running)
        need = 0
        for req in itertools.islice(self.waiting, max(0, free_slots)):
            left = req.num_tokens - req.num_computed_tokens
            if req.isolate or left > cap or need + left > cap:
                break
            need += left
        return need

    def _schedule_running(self, budget: int, reserve: int = 0
                          ) -> tuple[list[ScheduledSeq], list[Request], list[Request], int]:
        """Plan the running requests' tokens within ``budget``; a prefill chunk leaves ``reserve`` tokens for the
        waiting short prompts. Returns (seqs, preempted, truncated, budget left)."""
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        truncated: list[Request] = []
        # NOTE: decodes first: a prefill chunk gets the budget less one token per decode still to schedule, so a
        # long prompt never holds back the running streams (their next tokens are in every step)
        decodes_left = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            if left == 1:
                decodes_left -= 1
                n = 1
            else:
                n = self._chunk(req, req.num_computed_tokens, min(left, budget - decodes_left - reserve))
                if n <= 0:
                    i += 1   # no room beside the decodes this step: its next chunk waits
                    continue
            while not self._grow(req, req.num_computed_tokens + n):
                if len(self.running) == 1:
                    # Alone and still short of pages: the whole pool cannot hold this request's next token.
                    # Preempting it would recompute forever; end it with "length" (the pool is its context).
                    self.finish(req, "length")
                    truncated.append(req)
                    break
                victim = self.running[-1]
                if victim is not req and victim.num_tokens - victim.num_computed_tokens == 1:
                    decodes_left -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                break  # req was preempted (newest) or truncated; everything after it is gone too
            seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        return seqs, preempted, truncated, budget

    def _schedule_waiting(self, budget: int) -> list[ScheduledSeq]:
        seqs: list[ScheduledSeq] = []
        skipped: list[Request] = []
        if any(r.isolate for r in self.running):
            return seqs   # an isolated request runs alone
        try:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
                req = self.waiting[0]
                if req.isolate and (self.running or seqs):
                    break  # it runs alone: admit nothing past it until the running requests are done
                if self.state_pool is not None and req.state_slot is None and self.state_pool.num_free == 0:
                    n = None  # no state slot free: it waits, holding nothing (like a request short of pages)
                elif req.num_preemptions and not self._room_to_resume(req):
                    n = None  # back only with room to go on: else the running ones' next pages preempt it again
                else:
                    n = self._admit_pages(req, budget)
                # NOTE: popped only after _admit_pages returns: an allocation failure raised inside it leaves req
                # queued (with the cached pages it mapped, which a retry keeps and a failure releases)
                self.waiting.popleft()
                if n is None:
                    skipped.append(req)  # does not fit the free pages now; let smaller ones behind it run
                    if req.times_passed_over >= self.config.aging_rounds:
                        break            # aged: the pages freed from now on are its, nothing passes it
                    continue
                for r in skipped:
                    r.times_passed_over += 1
                req.status = Status.RUNNING
                if self.state_pool is not None and req.state_slot is None:
                    req.state_slot = self.state_pool.allocate()
                    if req.num_computed_tokens and self._snapshots_on:   # mapped cached pages: their end state
                        name = self.prefix_cache.point_name(req, req.num_computed_tokens)
                        self.state_snapshots.restore(name, req.state_slot)
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.monotonic()
                    if self.prefix_cache is not None:
                        self.prefix_cache.count(req)
                self.running.append(req)
                seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
                budget -= n
                if req.isolate:
                    break
        finally:
            self.waiting.extendleft(reversed(skipped))
        return seqs

    # --- pages ------------------------------------------------------------------------------------------------
    def _room_to_resume(self, req: Request) -> bool:
        """Whether a preempted ``req`` may come back: the available pages hold its whole sequence so far (it
        recomputes it) plus one page for each running request's growth. Admitted on its next chunk alone, it was
        the newest again when a running request needed a page: preempted, recomputed, preempted (a livelock
        on a pool far smaller than the running set)."""
        need = pages_needed(req.num_tokens + 1, self.config.page_size) + len(self.running)
        return need <= self.allocator.num_free

    def _admit_pages(self, req: Request, budget: int) -> int | None:
        """Map ``req``'s cached prefix (when it holds no pages) and give it pages for its next chunk of at most
        ``budget`` tokens; return the chunk's length, or None, ``req`` then holding no pages, when the pages it
        needs are not available now."""
        cache, ps = self.prefix_cache, self.config.page_size
        if cache is not None and not req.page_table:
            hit, tail = self._cached_prefix(req)
            start = len(hit) * ps + (tail.length if tail is not None else 0)
            n = self._chunk(req, start, min(req.num_tokens - start, budget))
            need = pages_needed(start + n, ps) - len(hit)
            if need > self.allocator.num_free - self.allocator.num_unheld(hit):
                return None
            cache.map(req, hit)
            if self._grow(req, start + n):
                if tail is not None:   # NOTE: right after the allocation, before anything writes a page
                    cache.map_tail(req, tail)
                return n
        else:
            n = self._chunk(req, req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            if self._grow(req, req.num_computed_tokens + n):
                return n
        # short of pages while holding some (mapped ones, or what a retry after an allocation failure kept): a
        # waiting request holds nothing
        self._release(req)
        req.num_computed_tokens = 0
        return None

    def _cached_prefix(self, req: Request) -> tuple[list[int], TailHit | None]:
        """The cached full pages ``req`` maps and the tail after them (or None); hybrid models only up to a point
        whose state snapshot is kept."""
        cache, snaps = self.prefix_cache, self.state_snapshots
        hit = cache.lookup(req)
        tail = cache.lookup_tail(req, len(hit), snaps.has if snaps is not None else None)
        if tail is None and hit and snaps is not None:
            hit = hit[:snaps.usable(cache.names(req, len(hit)), len(hit))]
        return hit, tail

    @property
    def _snapshots_on(self) -> bool:
        return self.state_snapshots is not None and self.prefix_cache is not None

    def _chunk(self, req: Request, start: int, n: int) -> int:
        """``n`` new tokens of ``req`` from ``start``, cut back (hybrid models with state snapshots only, so the state
        there can be kept) to end on a page boundary when they would end inside a later page, and to end on the
        prompt's point (:meth:`_prompt_point`) when they would pass it."""
        if not self._snapshots_on:
            return n
        ps = self.config.page_size
        boundary = (start + n) // ps * ps
        if boundary > start:
            n = boundary - start
        point = self._prompt_point(req)
        return point - start if start < point < start + n else n

    def _prompt_point(self, req: Request) -> int:
        """Where a request's prompt is kept as a turn point: its end; for hybrid models one token before (a state
        exists only where a step ends, and the point serves a repeated prompt, whose last token is always
        computed, as well as a next turn that keeps the prompt but drops the answer's reasoning)."""
        return req.num_prompt_tokens - (1 if self.state_snapshots is not None else 0)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` pages for ``num_tokens`` tokens. False (nothing allocated) when the pool is short."""
        need = pages_needed(num_tokens, self.config.page_size) - len(req.page_table)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        if self.faults.enabled:
            self.growing = req
            self.faults.check("kv_page_alloc", prompt_tokens=req.num_prompt_tokens)
            self.growing = None
        req.page_table.extend(self.allocator.allocate(need))
        return True

    def _release(self, req: Request) -> None:
        """Name what ``req`` computed (prefix caching), then drop its pages (the last ones first in the LRU)."""
        if req.page_table:
            keep = frozenset()
            if self.prefix_cache is not None:
                self.prefix_cache.commit(req)
                keep = frozenset(p for p in req.page_table[-2:] if self.prefix_cache.holds_tail(p))
            self.allocator.free(reversed(req.page_table), keep)
            req.page_table = []
        req.num_named_pages = 0
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s pages (and state slot) and requeue it first in line; it recomputes prompt + output later
        (from token 0: its recurrent state is gone with its slot)."""
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update(self, seqs: list[ScheduledSeq], token_ids: list[int] | None, *, eos_ids: tuple[int, ...],
               max_model_len: int, advance: Callable[[Request, int], str | None] | None = None) -> list[TokenUpdate]:
        """Commit a step that succeeded: every sequence's computed tokens advance (a request aborted during the
        step gave its pages back already: nothing is committed for it), hybrid models keep the state snapshots
        of page boundaries, then each sampled token (``token_ids``, one per sampling sequence) is appended,
        checked by ``advance`` (the grammar: an error string ends the request) and the stop rules, and finished
        requests are released.

        Returns:
            one :class:`TokenUpdate` per token kept.
        """
        for s in seqs:
            if s.request.status is not Status.FINISHED:
                s.request.num_computed_tokens += s.num_tokens
        if self.prefix_cache is not None:
            self._keep_points(seqs)
        if token_ids is None:
            return []
        out: list[TokenUpdate] = []
        for i, s in enumerate([s for s in seqs if s.sample]):
            r = s.request
            if r.status is Status.FINISHED:
                continue
            tok = token_ids[i]
            r.output_token_ids.append(tok)
            error = advance(r, tok) if advance is not None else None
            reason = "abort" if error is not None else stop_reason(r, tok, eos_ids, max_model_len)
            if reason is not None:
                if error is None and self.prefix_cache is not None:
                    self._keep_turn_point(r)   # the end of the turn: its next turn resumes here
                self.finish(r, reason)
            out.append(TokenUpdate(r, tok, i, None if error else reason, error))
        return out

    def _keep_points(self, seqs: list[ScheduledSeq]) -> None:
        """After a step: keep the point each sequence reached when it is a page boundary (hybrid models: its state
        snapshot) or its prompt's point (a turn point: its tail, and its state snapshot)."""
        ps = self.config.page_size
        for s in seqs:
            r = s.request
            n = r.num_computed_tokens
            if r.status is Status.FINISHED or n == 0:
                continue
            if n == self._prompt_point(r):
                self._keep_turn_point(r)
            elif n % ps == 0 and self.state_snapshots is not None and r.state_slot is not None:
                self.state_snapshots.save(self.prefix_cache.point_name(r, n), r.state_slot)

    def _keep_turn_point(self, r: Request) -> None:
        """Keep ``r``'s computed tokens (the end of its prompt or of its turn) as a reusable point: their tail
        (``engine/cache/prefix_cache.py``) and, for hybrid models, the state after them as a turn point
        (``engine/cache/state_snapshots.py``)."""
        n = r.num_computed_tokens
        if n == 0:
            return
        self.prefix_cache.record_tail(r, n)
        if self.state_snapshots is not None and r.state_slot is not None:
            self.state_snapshots.save(self.prefix_cache.point_name(r, n), r.state_slot, turn=True)

    def check_invariants(self) -> None:
        """Assert: every page free, cached or owned, reference counts matching the tables, only named pages
        shared; free + used = total; every running request's table covers its computed tokens, and none of its
        pages past them is named. Raises AssertionError."""
        owners = self.running + [r for r in self.waiting if r.page_table]
        self.allocator.check([r.page_table for r in owners])
        for r in self.running:
            have = len(r.page_table) * self.config.page_size
            assert have >= r.num_computed_tokens, (
                f"{r.request_id}: {have} slots < {r.num_computed_tokens} computed tokens")
            full = r.num_computed_tokens // self.config.page_size
            for i in range(full, len(r.page_table)):   # pages still to be written are never named (shared)
                assert self.allocator.name_of(r.page_table[i]) is None, (
                    f"{r.request_id}: page {i} is named but tokens {i * self.config.page_size}.. are not computed")
        assert len(self.running) <= self.config.max_running_requests
        if self.state_snapshots is not None:
            self.state_snapshots.check()
        if self.state_pool is not None:   # each running request owns exactly one slot, none owned twice
            self.state_pool.check([r.state_slot for r in self.running + list(self.waiting)], len(self.running))
        else:
            assert all(r.state_slot is None for r in self.running), "a state slot without a state pool"
