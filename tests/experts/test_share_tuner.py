"""The hybrid backend's CPU share tuner (experts/share_tuner.py): hill climbing on measured step times."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.experts.share_tuner import ShareTuner


def climb(tuner: ShareTuner, cost, steps: int) -> list[int]:
    """Feed ``steps`` step times ``cost(share)``; returns the share used at each step."""
    used = []
    for _ in range(steps):
        used.append(tuner.share)
        tuner.step_done(cost(tuner.share))
    return used


@pytest.mark.parametrize("times, settled", [
    ({0: 1.0, 1: 0.8, 2: 0.9, 3: 1.5}, 1),  # a minimum inside
    ({0: 1.0, 1: 1.6, 2: 0.1}, 0),  # worse at 1: never looks further (a hill climb)
    ({0: 1.0, 1: 0.99, 2: 0.5}, 0),  # 1 % faster is below min_gain: the smaller share is kept
    ({0: 1.0, 1: 0.9, 2: 0.8, 3: 0.7, 4: 0.6, 5: 0.1}, 4),  # stops at max_share
])
def test_settles_on_the_fastest_share_it_climbs_to(times, settled):
    t = ShareTuner(window=3, max_share=4)
    used = climb(t, times.__getitem__, 3 * 6 + 10)
    assert t.settled == settled and t.share == settled
    assert used[:3] == [0, 0, 0]  # starts with offload's policy
    assert used[-10:] == [settled] * 10
    assert set(t.trials) == set(range(min(settled + 2, t.max_share + 1)))


def test_climbs_again_after_revisit_steps():
    t = ShareTuner(window=2, revisit=5, max_share=3)
    climb(t, {0: 1.0, 1: 0.5, 2: 0.7}.__getitem__, 6 + 5)
    assert t.settled == 1 and t.share == 0 and t.trials == {}  # revisit: a new climb from 0
    climb(t, {0: 0.5, 1: 1.0}.__getitem__, 4)  # the machine changed: share 1 now loses
    assert t.settled == 0 and t.share == 0


def test_median_ignores_a_stray_slow_step():
    t = ShareTuner(window=3)
    for s in (1.0, 1.0, 1.0, 0.5, 9.0, 0.5, 2.0, 2.0, 2.0):  # share 0, share 1 (one stray 9.0), share 2
        t.step_done(s)
    assert t.trials == {0: 1.0, 1: 0.5, 2: 2.0} and t.settled == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=5, max_size=5), st.integers(1, 4))
def test_settled_share_is_never_slower_than_share_zero(costs, window):
    t = ShareTuner(window=window, max_share=4)
    climb(t, lambda s: costs[s], window * 6)
    assert t.settled is not None
    assert costs[t.settled] <= costs[0]
    # each share it moved past was faster than every smaller one by min_gain
    for s in range(1, t.settled + 1):
        assert costs[s] < (1 - t.min_gain) * min(costs[:s])


def test_a_clearly_losing_share_is_given_up_early():
    t = ShareTuner(window=8, early=2, early_margin=0.2)
    used = climb(t, {0: 1.0, 1: 1.5}.__getitem__, 8 + 2 + 3)
    assert used == [0] * 8 + [1, 1] + [0] * 3  # two steps at share 1, not eight
    assert t.settled == 0 and t.trials == {0: 1.0, 1: 1.5}
    t = ShareTuner(window=4, early=2, early_margin=0.2)
    climb(t, {0: 1.0, 1: 1.1, 2: 2.0}.__getitem__, 4 + 4)  # 10 % slower: inside the margin, measured in full
    assert t.trials == {0: 1.0, 1: 1.1} and t.settled == 0
