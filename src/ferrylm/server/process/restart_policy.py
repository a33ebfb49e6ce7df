"""When a dead engine is started again: at most ``max_restarts`` restarts within any ``window_s`` seconds
(``--max-engine-restarts``), each after a backoff that doubles with the restarts of the window (0.5 s, 1 s, 2 s ...,
at most 10 s). Past the limit the supervisor gives up and the server exits non-zero.

This module must not import torch.
"""

from __future__ import annotations

from collections import deque

MAX_BACKOFF_S = 10.0


class RestartPolicy:
    """The restarts of the last ``window_s`` seconds; times are ``time.monotonic()`` seconds."""

    def __init__(self, max_restarts: int, window_s: float):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def recent(self, now: float) -> int:
        """How many restarts happened within the window before ``now``."""
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return len(self._times)

    def next_delay(self, now: float) -> float | None:
        """Count a restart at ``now`` and return its backoff in seconds; None (nothing counted) when the window
        holds ``max_restarts`` restarts already."""
        if self.recent(now) >= self.max_restarts:
            return None
        self._times.append(now)
        return min(0.5 * 2 ** (len(self._times) - 1), MAX_BACKOFF_S)
