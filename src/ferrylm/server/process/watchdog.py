"""What the engine's heartbeats say about its progress, and when it counts as stalled.

Progress is a changed tick counter in the heartbeat (the engine ticks per layer and per step, ``engine/progress.py``)
or an output. The deadline is ``max(watchdog_timeout, STALL_MARGIN x the expected time between ticks of the running
step)``, and at least STALL_MARGIN x the slowest time per tick observed lately, so a step that is long by nature (a
2048-token prefill chunk on a CPU) or a saturated host is not a hang, and a hang inside a short step is found at
``watchdog_timeout``. The supervisor acts on the verdict (``supervisor.py``); this module only judges.

This module must not import torch.
"""

from __future__ import annotations

import collections

STALL_MARGIN = 4.0            # x the expected time between progress ticks of the running step
TICK_GAPS_KEPT = 16           # observed times per tick the watchdog's deadline follows (the slowest of them)


class ProgressWatch:
    """The progress of one engine generation as its messages report it. Times are the frontend's
    ``time.monotonic()`` seconds.

    Args:
        watchdog_timeout: seconds without progress (while requests run) or without a heartbeat after which a ready
            engine is stalled; None turns the verdict off.
    """

    def __init__(self, watchdog_timeout: float | None):
        self.watchdog_timeout = watchdog_timeout
        self.last_heartbeat = 0.0     # last message of any kind from the engine
        self.last_progress = 0.0      # last moment the engine was known to make progress
        self.progress: dict = {}      # the last heartbeat's progress report (engine/progress.py)
        self._last_ticks: int | None = None
        self._last_tick_time: float | None = None   # when the tick count last changed
        # seconds per tick observed lately (heartbeats that saw the count move): the deadline follows the engine's
        # real pace, so a slow but progressing engine (a saturated CPU) is not taken for a hang
        self._tick_gaps: collections.deque[float] = collections.deque(maxlen=TICK_GAPS_KEPT)

    def reset(self, now: float) -> None:
        """A new generation starts at ``now``: nothing it reported yet, nothing held against it."""
        self.progress, self._last_ticks, self._last_tick_time = {}, None, None
        self._tick_gaps.clear()
        self.last_heartbeat = self.last_progress = now

    def on_heartbeat(self, progress: dict, stats: dict, last_step_age: float, now: float) -> None:
        """A heartbeat with its ``progress`` report and ``stats`` (for the running / waiting counts of an engine
        that reports no progress) arrived at ``now``."""
        self.progress = progress
        running = progress.get("num_running", stats.get("num_running"))
        waiting = progress.get("num_waiting", stats.get("num_waiting"))
        ticks = progress.get("ticks")
        if not running and not waiting:
            # NOTE: idle is not stuck; but waiting requests are work (an engine that hangs before it schedules
            # them must be found: with nothing running every waiting request fits)
            self.last_progress = now
            # the observed pace counts busy time only: an idle spell is no slow tick
            self._last_tick_time = now
            if ticks is not None:
                self._last_ticks = ticks
        elif ticks is not None:
            if ticks != self._last_ticks:                  # a layer or a step boundary since the last beat
                self.last_progress = now
                try:
                    moved = int(ticks) - int(self._last_ticks) if self._last_ticks is not None else 0
                except (TypeError, ValueError):
                    moved = 0
                if moved > 0 and self._last_tick_time is not None:
                    self._tick_gaps.append((now - self._last_tick_time) / moved)
                self._last_tick_time = now
            self._last_ticks = ticks
        else:  # an engine without progress reports: the loop iteration's age
            self.last_progress = max(self.last_progress, now - float(last_step_age))

    def step(self) -> dict:
        """The running step as the last heartbeat described it (in_step, step_age_s, step_tokens,
        expected_step_s), for /health; {} before any report."""
        p = self.progress
        return {k: p.get(k) for k in ("in_step", "step_age_s", "step_tokens", "expected_step_s")} if p else {}

    def suspects(self) -> list[str]:
        """The requests of the step the engine was running at its last heartbeat ([] between steps)."""
        p = self.progress
        ids = p.get("step_request_ids") if isinstance(p, dict) and p.get("in_step") else None
        return [r for r in ids if isinstance(r, str)] if isinstance(ids, list) else []

    def stall_deadline(self) -> float:
        """Seconds without progress after which the running engine is stalled: ``watchdog_timeout``, or more when
        the running step is expected to take longer than that between two progress ticks: STALL_MARGIN x the
        larger of its expected duration / ticks per step and the slowest time per tick observed over the last
        TICK_GAPS_KEPT moves of the tick count (a saturated host slows every layer down; its ticks still come, at
        its own pace). A hang stops the ticks, so it never feeds the observed pace."""
        wd = float(self.watchdog_timeout or 0.0)
        p = self.progress
        try:
            if p.get("in_step"):
                per_tick = float(p.get("expected_step_s") or 0.0) / max(1, int(p.get("ticks_per_step") or 1))
                observed = max(self._tick_gaps) if self._tick_gaps else 0.0
                return max(wd, STALL_MARGIN * per_tick, STALL_MARGIN * observed)
        except (TypeError, ValueError, AttributeError):
            pass
        return wd

    def stall_reason(self, now: float, num_in_flight: int) -> str | None:
        """Why the engine is stalled at ``now`` with ``num_in_flight`` requests in flight: no progress past
        :meth:`stall_deadline` while requests run, or no heartbeat for ``watchdog_timeout``; None when it is not
        (or the watchdog is off)."""
        wd = self.watchdog_timeout
        if not wd:
            return None
        no_progress = now - self.last_progress
        no_heartbeat = now - self.last_heartbeat
        deadline = self.stall_deadline()
        if num_in_flight and no_progress > deadline:
            step = self.progress if self.progress.get("in_step") else {}
            where = (f"inside a step of {step.get('step_tokens')} tokens running for {step.get('step_age_s')} s, "
                     f"expected {step.get('expected_step_s')} s" if step else "between steps")
            return (f"{num_in_flight} requests in flight but no progress for {no_progress:.1f} s, {where} (deadline "
                    f"{deadline:.1f} s, --watchdog-timeout {wd:g}; last heartbeat {no_heartbeat:.1f} s ago)")
        if no_heartbeat > wd:
            return f"no heartbeat for {no_heartbeat:.1f} s (--watchdog-timeout {wd:g})"
        return None
