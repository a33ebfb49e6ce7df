"""The supervisor's side of tensor parallel: every rank's exit is watched; a follower's death fails the in-flight
requests at once and takes rank 0 down (whose exit restarts the group); rank 0's exit takes the followers down."""

from __future__ import annotations

import asyncio

import pytest

from ferrylm.errors import EngineUnavailable
from tests.supervision.harness import FakeProc, ready_supervisor, shutdown, wait_for
from tests.supervision.test_supervisor_guards import collect

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def _with_follower(tmp_path, **kw):
    sup, eng = await ready_supervisor(tmp_path, watchdog_timeout=5, **kw)
    sup.tp_size = 2
    follower = FakeProc(pid=999_998)
    sup._followers = [follower]
    return sup, eng, follower


async def test_follower_death_answers_in_flight_and_kills_rank0(tmp_path):
    sup, eng, follower = await _with_follower(tmp_path)
    try:
        task = asyncio.create_task(collect(sup, "r1"))
        await eng.recv()
        await wait_for(lambda: "r1" in sup._inflight, what="the request in flight")
        follower.exitcode = -9
        sup._on_follower_exit(follower, sup._gen, 1)
        outs, err = await asyncio.wait_for(task, 2)
        assert outs == [] and isinstance(err, EngineUnavailable) and "rank 1" in err.message, err
        assert sup._proc.killed                      # rank 0 goes: its exit restarts the whole group
        assert sup.health().status == "restarting"
        assert sup.quarantine.stats()["suspects"] == 0   # SIGKILL came from outside: not the request's doing
    finally:
        await shutdown(sup, eng)


async def test_follower_crash_strikes_the_running_step(tmp_path):
    sup, eng, follower = await _with_follower(tmp_path)
    try:
        task = asyncio.create_task(collect(sup, "r1"))
        await eng.recv()
        await eng.heartbeat(ticks=1, in_step=True, ids=("r1",))
        await wait_for(lambda: sup._watch.progress.get("in_step"), what="the step's heartbeat")
        follower.exitcode = 1
        sup._on_follower_exit(follower, sup._gen, 1)
        _, err = await asyncio.wait_for(task, 2)
        assert isinstance(err, EngineUnavailable) and "exit code 1" in err.message
        assert sup.quarantine.stats()["suspects"] == 1
    finally:
        await shutdown(sup, eng)


async def test_follower_exit_after_shutdown_is_not_a_failure(tmp_path):
    sup, eng, follower = await _with_follower(tmp_path)
    try:
        follower.exitcode = 0
        sup._on_follower_exit(follower, sup._gen, 1)
        assert not sup._proc.killed and sup.health().status == "ready"
    finally:
        await shutdown(sup, eng)


async def test_follower_failing_at_first_start_gives_up(tmp_path):
    fatal = []
    sup, eng, follower = await _with_follower(tmp_path, on_fatal=lambda: fatal.append(1))
    try:
        sup.state = "loading"
        follower.exitcode = 1
        sup._on_follower_exit(follower, sup._gen, 1)
        assert sup.state == "dead" and fatal == [1] and "rank 1 failed to start" in sup.detail
        assert sup._proc.killed
    finally:
        await shutdown(sup, eng)


async def test_rank0_exit_kills_the_followers(tmp_path):
    sup, eng, follower = await _with_follower(tmp_path, max_restarts=0)
    try:
        sup._proc.exitcode = -9
        sup._on_engine_exit(sup._proc, sup._gen)
        assert follower.killed
        assert sup.rank_pids == [sup._proc.pid, follower.pid]
        assert "tensor_parallel_pids" in sup.health().extra
    finally:
        await shutdown(sup, eng)
