"""The OOM ladder: runs a step's scheduling and its forward, and on an allocation failure applies the guard's
decisions (``memory/guard.py``: retry, shrink the expert cache, halve the prefill, defer prefills, preempt, fail)
until the (possibly smaller) step succeeds or its requests are failed.

A step's requests keep their counters through a failed attempt (the engine commits counters and tokens only after
the whole step succeeded), so a retry recomputes from the same place. The ladder works on the scheduler's
sequences (``request``, ``start``, ``num_tokens``) and the scheduler's queue operations, through
:class:`StepHost`: it imports nothing of the engine.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

from ferrylm.memory.guard import OomGuard, Recovery, StepRecovery, is_oom
from ferrylm.memory.budget import gib

log = logging.getLogger("ferrylm.engine")


class StepHost(Protocol):
    """What the ladder needs of the engine.

    ``scheduler``: ``schedule()``, ``growing`` (the request whose pages were being allocated), ``prefill_budget``,
    ``set_prefill_budget(n)``, ``preempt(request)``, ``running``. ``run_step(seqs)``: one attempt of the step.
    ``states_lost()``: a failed attempt wrote recurrent states (hybrid models). ``fail_requests(requests,
    message)``: end them with ``insufficient_memory``. ``finished(request)``: it ended (aborted) during the
    attempt."""

    scheduler: Any

    def run_step(self, seqs: list) -> None: ...

    def states_lost(self) -> bool: ...

    def fail_requests(self, requests: list, message: str) -> None: ...

    def finished(self, request) -> bool: ...


class OomLadder:
    """Applies :class:`OomGuard` decisions to a step (module docstring). ``device``: named in failure messages;
    ``abandoned``: the exception type of a step whose requests were all aborted at a layer boundary."""

    def __init__(self, guard: OomGuard, host: StepHost, device, abandoned: type[BaseException]):
        self.guard = guard
        self.host = host
        self.device = device
        self.abandoned = abandoned

    def schedule(self):
        """``scheduler.schedule()``; an allocation failure while a request's pages are allocated is retried, then
        the budget halved, then that request failed (the others are scheduled)."""
        sched, st = self.host.scheduler, None
        while True:
            try:
                return sched.schedule()
            except Exception as e:
                if not is_oom(e):
                    raise
                st = st or StepRecovery()
                self.guard.note_oom(st, e)
            req, sched.growing = sched.growing, None
            if req is None:
                raise RuntimeError(f"allocation failure while scheduling, not pinned on a request: {st.message}")
            self.guard.release()
            chunk = min(req.num_tokens - req.num_computed_tokens, sched.prefill_budget)
            d = self._decide(st, prefill_tokens=chunk, num_seqs=1)
            detail = ""
            if d.action == "halve":
                sched.set_prefill_budget(d.prefill_tokens)
                detail = f" to {sched.prefill_budget} tokens"
            self._log(d.action + detail, st, "scheduling", chunk, [req])
            if d.action == "fail":
                self._fail([req], st, "scheduling", chunk)
                st = None

    def run(self, seqs: list) -> bool:
        """Run the step's sequences, climbing the ladder on allocation failures. Returns False when the step was
        abandoned (its requests all aborted mid-step), so its duration teaches the estimates nothing."""
        st: StepRecovery | None = None
        while seqs:
            try:
                self.host.run_step(seqs)
                break
            except self.abandoned:   # every request aborted at a layer boundary: nothing to commit
                log.debug("step of %d token(s) abandoned at a layer boundary: its requests were all aborted",
                         sum(s.num_tokens for s in seqs))
                return False
            except Exception as e:
                if not is_oom(e):
                    raise
                st = st or StepRecovery()
                self.guard.note_oom(st, e)
            # outside the except block: the exception, its traceback and the step's tensors are unreachable
            self.guard.release()
            seqs = self._without_lost_states([s for s in seqs if not self.host.finished(s.request)])
            if seqs:
                seqs = self._climb(st, seqs)
        if st is None:
            budget = self.guard.step_succeeded()
            if budget is not None:
                self.host.scheduler.set_prefill_budget(budget)
        return True

    def _climb(self, st: StepRecovery, seqs: list) -> list:
        """Apply the next rung to the failed step; return what to attempt next (empty: the step is over)."""
        sched = self.host.scheduler
        prefill = sum(s.num_tokens for s in seqs if s.num_tokens > 1)
        tokens = sum(s.num_tokens for s in seqs)
        phase = "prefill" if any(s.num_tokens > 1 or s.start == 0 for s in seqs) else "decode"
        d = self._decide(st, prefill_tokens=prefill, num_seqs=len(seqs), has_prefill=phase == "prefill")
        reqs, detail = [s.request for s in seqs], ""
        if d.action == "halve":
            sched.set_prefill_budget(d.prefill_tokens + sum(1 for s in seqs if s.num_tokens == 1))
            seqs = trim_prefill(seqs, d.prefill_tokens)
            detail = f": prefill chunk {prefill} -> {d.prefill_tokens} tokens"
        elif d.action == "defer":
            # the deferred requests keep their pages and counters (nothing of this step was committed); the
            # scheduler gives them their chunk again next step, by then with the decodes' room back
            kept = without_deferred_prefills(seqs)
            deferred = [s.request.request_id for s in seqs if s not in kept]
            seqs = kept
            detail = f" the prefill of {len(deferred)} request(s) {deferred} to a later step"
        elif d.action == "preempt":   # a decode-only step preempts its newest request (the last admitted)
            order = {id(r): i for i, r in enumerate(sched.running)}
            victim = max((s.request for s in seqs), key=lambda r: order.get(id(r), -1))
            sched.preempt(victim)
            seqs = [s for s in seqs if s.request is not victim]
            detail = f" 1 request(s) {[victim.request_id]}"
        self._log(d.action + detail, st, phase, tokens, reqs)
        if d.action == "fail":
            self._fail([s.request for s in seqs], st, phase, tokens)
            return []
        return seqs

    def _decide(self, st: StepRecovery, **step) -> Recovery:
        """The guard's decision; a shrink is applied here, and one that freed nothing asks again without it."""
        d = self.guard.next_action(st, **step)
        if d.action == "shrink" and not self.guard.shrank(st, self.guard.cache.shrink(d.slots)):
            d = self.guard.next_action(st, allow_shrink=False, **step)
        return d

    def _without_lost_states(self, seqs: list) -> list:
        """After a failed step of a hybrid model whose linear layers already wrote states: the sequences that
        continued from a state (``start > 0``) lost it, so they are preempted (they recompute from token 0) and
        leave the step; those starting at 0 simply retry. Other models: ``seqs`` unchanged."""
        if not self.host.states_lost():
            return seqs
        lost = [s for s in seqs if s.start > 0]
        for s in lost:
            self.host.scheduler.preempt(s.request)
        if lost:
            log.warning("failed step: %d request(s) %s lost their recurrent state and recompute from token 0",
                        len(lost), [s.request.request_id for s in lost])
        return [s for s in seqs if s.start == 0]

    def _fail(self, reqs: list, st: StepRecovery, phase: str, tokens: int) -> None:
        """End ``reqs`` with ``insufficient_memory`` (HTTP 503 + Retry-After at the edge)."""
        free = self.guard.read_free_now()
        msg = (f"out of memory: a {phase} step of {tokens} tokens for {len(reqs)} request(s) could not be computed "
               f"(failed allocation: {gib(st.oom_bytes) if st.oom_bytes else 'size unknown'}; "
               f"{gib(free) + ' free' if free is not None else 'free memory unknown'} on {self.device}, reserve "
               f"{gib(self.guard.reserve_bytes)}; tried: {', '.join(st.actions)}). Retry later or send a shorter "
               f"prompt.")
        self.host.fail_requests(reqs, msg)
        self.guard.count_failed(len(reqs))
        log.error("OOM: failed %d request(s) %s: %s", len(reqs), [r.request_id for r in reqs], msg)

    def _log(self, action: str, st: StepRecovery, phase: str, tokens: int, reqs: list) -> None:
        log.warning("OOM in a %s step of %d tokens (%d requests; failed allocation %s: %s); recovery %d: %s "
                    "(prefill budget now %d tokens, expert slots %d)", phase, tokens, len(reqs),
                    gib(st.oom_bytes) if st.oom_bytes else "size unknown", st.message, len(st.actions), action,
                    self.host.scheduler.prefill_budget, self.guard.cache.num_slots)


def without_deferred_prefills(seqs: list) -> list:
    """The ``defer`` rung: the step without its prefill chunks when it holds decodes too (decodes of running
    requests are never held back by a prompt that does not fit now); with prefill chunks only, the first alone."""
    decodes = [s for s in seqs if not (s.num_tokens > 1 or s.start == 0)]
    return decodes or seqs[:1]


def trim_prefill(seqs: list, limit: int) -> list:
    """The step with its prefill chunks (sequences of more than one token) cut to ``limit`` tokens in all, in
    order; decode sequences are kept. A chunk cut short no longer samples (its request just progresses less)."""
    out: list = []
    left = limit
    for s in seqs:
        if s.num_tokens <= 1:
            out.append(s)
            continue
        n = min(s.num_tokens, left)
        if n > 0:
            out.append(dataclasses.replace(s, num_tokens=n))
            left -= n
    return out

