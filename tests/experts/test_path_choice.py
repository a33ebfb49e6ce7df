"""The offload backend's one-token path chooser (experts/path_choice.py) on a fake clock: it measures the host path,
then the table, settles on the faster, counts only intervals between two one-token steps, and revisits."""

from __future__ import annotations

import pytest

from ferrylm.experts.path_choice import OneTokenPath
from ferrylm.experts.share_tuner import ShareTuner


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def decode(path: OneTokenPath, clock: Clock, steps: int, host_s: float, table_s: float) -> list[bool]:
    """Run ``steps`` one-token steps, each taking the time of the path the chooser picked; the paths used."""
    used = []
    for _ in range(steps):
        table = path.step_begins(1)
        used.append(table)
        clock.now += table_s if table else host_s
    return used


def test_settles_on_the_table_when_it_is_faster():
    clock = Clock()
    path = OneTokenPath(tuner=ShareTuner(window=4, revisit=100, max_share=1), clock=clock)
    used = decode(path, clock, 30, host_s=0.030, table_s=0.020)
    assert used[0] is False  # the host-planned path is measured first
    assert any(used[:12]) and all(used[-10:])
    d = path.describe()
    assert d["settled"] == "table" and d["path"] == "table"
    assert d["trials"] == {"host": pytest.approx(0.030), "table": pytest.approx(0.020)}


def test_keeps_the_host_path_when_the_table_is_slower():
    clock = Clock()
    path = OneTokenPath(tuner=ShareTuner(window=4, revisit=100, max_share=1), clock=clock)
    used = decode(path, clock, 30, host_s=0.010, table_s=0.025)
    assert any(used) and not any(used[-10:])
    assert path.describe()["settled"] == "host"


def test_only_intervals_between_one_token_steps_count():
    clock = Clock()
    path = OneTokenPath(tuner=ShareTuner(window=2, revisit=100, max_share=1), clock=clock, max_interval_s=1.0)
    path.step_begins(1)
    clock.now += 0.010
    path.step_begins(512)   # a prefill chunk: the interval before it is not a one-token step's time
    clock.now += 3.0
    path.step_begins(1)
    clock.now += 5.0        # idle engine: longer than max_interval_s, not counted
    path.step_begins(1)
    assert path.tuner.trials == {} and path.tuner._times == []
    clock.now += 0.012
    path.step_begins(1)
    assert path.tuner._times == [pytest.approx(0.012)]


def test_revisits_after_the_settled_window():
    clock = Clock()
    path = OneTokenPath(tuner=ShareTuner(window=2, revisit=5, max_share=1), clock=clock)
    decode(path, clock, 8, host_s=0.010, table_s=0.030)
    assert path.describe()["settled"] == "host"
    used = decode(path, clock, 12, host_s=0.030, table_s=0.010)  # the machine changed: the table is faster now
    assert path.describe()["settled"] == "table"
    assert used[3:10] == [True] * 7  # after the second climb, the settled steps run from the table
