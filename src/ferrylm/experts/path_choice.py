"""Which path a one-token decode step of the offload backend takes, chosen by measured step time.

The two paths (``experts/offload.py``): the host-planned one (per layer one device->host read of the routing, DMA
copies of the misses, next-layer prefetch overlapping the copies with compute, piecewise graphs between layers) and
the device table (one CUDA graph per step, misses read by the fused kernel from mapped host memory, no host
decision inside the step). Which is faster at one token depends on the model, not only the machine: on the H200
the host-planned path won on Qwen3-30B-A3B at 24 GiB (20.4 vs 15.4 tok/s, session 7: 48 layers whose copies
dominate) while on Qwen3.5-35B-A3B the same path spends ~0.7-1 ms of host work per layer, more than its copies
need (docs/BENCHMARKS.md, sessions 10 and 12). So, as the hybrid backend's CPU share, it is found by timing:
:class:`~ferrylm.experts.share_tuner.ShareTuner` with two candidates (0 = host-planned, 1 = table), a window of
steps each, settle, revisit.

A step's time is the interval between the starts of two consecutive one-token steps (``begin_step`` to
``begin_step``: the whole engine step, the same overheads on both paths). An interval that does not end in another
one-token step (a prefill, a larger batch, an idle engine) or that exceeds ``max_interval_s`` is not counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ferrylm.experts.share_tuner import ShareTuner

HOST, TABLE = 0, 1
PATH_NAMES = {HOST: "host", TABLE: "table"}


@dataclass
class OneTokenPath:
    """Times one-token steps and says whether the next one runs from the device table.

    Args:
        tuner: the two-candidate climb (``max_share=1``); its ``share`` is the path in use.
        max_interval_s: longer intervals (an idle engine between requests) are not step times.
        clock: seconds, monotonic (tests pass a fake one).
    """

    tuner: ShareTuner = field(default_factory=lambda: ShareTuner(window=8, revisit=512, max_share=1))
    max_interval_s: float = 1.0
    clock: object = time.perf_counter
    _last_start: float | None = None

    @property
    def table(self) -> bool:
        """Whether the next one-token step runs from the device table."""
        return self.tuner.share == TABLE

    def step_begins(self, num_tokens: int) -> bool:
        """A step of ``num_tokens`` tokens is about to launch: count the previous one-token step's time when this
        one is a one-token step too; returns whether this step (if one token) runs from the table."""
        now = self.clock()
        if num_tokens != 1:
            self._last_start = None
            return self.table
        if self._last_start is not None and now - self._last_start <= self.max_interval_s:
            self.tuner.step_done(now - self._last_start)
        self._last_start = now
        return self.table

    def describe(self) -> dict:
        """``{"path", "settled", "trials"}``: the path in use, the one the last climb chose (None while the first
        climb runs) and the median step seconds of each path measured in the current or last climb."""
        t = self.tuner
        return {"path": PATH_NAMES[t.share], "settled": None if t.settled is None else PATH_NAMES[t.settled],
                "trials": {PATH_NAMES[k]: v for k, v in t.trials.items()}}
