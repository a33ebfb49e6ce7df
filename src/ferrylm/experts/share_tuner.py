"""Online choice of the hybrid backend's CPU share by measured step time.

Why measured and not modelled: at decode a CPU expert sits on its layer's critical path (the layer's next half
waits for it), while a prefetched copy overlaps the layers before. Whether moving one predicted miss per layer
from the PCIe link to the CPU pays depends on the layer's own GPU time, the CPU job's fixed costs and how much host
memory bandwidth the CPU gets while the DMA reads the same DRAM; a model fed with the probed rates predicted gains
where the step got slower (docs/BENCHMARKS.md, "The figures behind choices in the code"). So the share is found
the way an autotuner finds a tile size: by timing it.

Algorithm (hill climbing, per step size): measure share 0 (every predicted miss copied: ``offload``'s policy)
over ``window`` steps, then share 1, 2, ... while each is faster than the best so far by ``min_gain``; settle on
the best. After ``revisit`` settled steps, climb again from 0 (the machine's load changes). A step's time is
the median over its window (robust to a stray slow step). A candidate whose first ``early`` steps are all slower
than the best median by more than ``early_margin`` is given up at once (exploring a losing share costs steps).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class ShareTuner:
    """Chooses how many of a layer's predicted misses go to the CPU (``share``), from step times.

    Args:
        window: steps measured per candidate share.
        revisit: steps at the settled share before climbing again.
        max_share: largest share tried (experts per layer).
        min_gain: a larger share must beat the best by this fraction of its step time to be kept.
        early, early_margin: give a candidate up after ``early`` steps that were all more than ``early_margin``
            (a fraction) slower than the best median so far.

    Attributes:
        share: the share to use for the next step.
        settled: the share chosen by the last climb (None while the first climb runs).
        trials: ``share -> median step seconds`` of the current (or last) climb.
    """

    window: int = 8
    revisit: int = 512
    max_share: int = 4
    min_gain: float = 0.03
    early: int = 2
    early_margin: float = 0.2
    share: int = 0
    settled: int | None = None
    trials: dict[int, float] = field(default_factory=dict)
    _times: list[float] = field(default_factory=list)
    _steps_settled: int = 0
    _climbing: bool = True

    def step_done(self, seconds: float) -> None:
        """Record the last step's time (seconds, measured with ``share``) and move the search on."""
        if not self._climbing:
            self._steps_settled += 1
            if self._steps_settled >= self.revisit:
                self._climbing, self.share, self.trials = True, 0, {}
            return
        self._times.append(seconds)
        if len(self._times) < self.window and not self._hopeless():
            return
        self.trials[self.share] = statistics.median(self._times)
        self._times = []
        best = min(self.trials, key=self.trials.get)
        improved = best == self.share and (self.share == 0 or self.trials[self.share]
                                           < (1 - self.min_gain) * min(t for s, t in self.trials.items()
                                                                       if s != self.share))
        if improved and self.share < self.max_share:
            self.share += 1
            return
        if not improved and best == self.share:  # faster, but not by min_gain: keep the smaller share
            best = min((s for s in self.trials if s != self.share), key=self.trials.get)
        self.share = self.settled = best
        self._climbing, self._steps_settled = False, 0

    def _hopeless(self) -> bool:
        if not self.trials or len(self._times) < self.early:
            return False
        return min(self._times) > (1 + self.early_margin) * min(self.trials.values())


@dataclass
class FixedShare:
    """The share given by ``--moe-cpu-share`` (no tuning): the :class:`ShareTuner` interface, ``share`` fixed."""

    share: int

    @property
    def settled(self) -> int:
        """Always ``share``."""
        return self.share

    def step_done(self, seconds: float) -> None:
        """Ignored: the share is fixed."""
