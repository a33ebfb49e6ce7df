"""The engine process's boundaries (issue 18): one malformed or unexpected message never ends the message loop,
and one bad statistic never stops the heartbeats (fake model, no process)."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from ferrylm.engine import ipc, worker
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.worker import handle_message, heartbeat_message
from tests.engine.test_scheduler import greedy, make_engine, run_all

MALFORMED = [
    b"",
    b"\xc1 not msgpack",
    msgpack.packb("just a string"),
    msgpack.packb(["NoSuchMessage", {}]),
    msgpack.packb(["AddRequest", {"nonsense": 1}]),
    msgpack.packb(["AbortRequest", {"request_ids": 5}]),
    msgpack.packb(["Outputs", {"outputs": []}]),      # a message the engine never receives
]


@pytest.mark.parametrize("data", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_message_is_dropped_and_the_engine_serves_on(data):
    eng = make_engine()
    assert handle_message(eng, data) == (False, [])
    eng.add_request("ok", [1, 2, 3], greedy(2))
    assert sum(len(o.new_token_ids) for o in run_all(eng)["ok"]) == 2


@pytest.mark.parametrize("ids, params", [
    (["x", -1], {"temperature": 0.0}),      # token ids that are not ids
    ([1, 10_000], {"temperature": 0.0}),    # outside the vocabulary
    ([1, 2], "not a dict"),                 # parameters that are not a map
    ([1, 2], {"temperature": "hot"}),       # a parameter of the wrong type
])
def test_an_add_request_with_bad_fields_is_answered_invalid_request(ids, params):
    eng = make_engine()
    shutdown, now = handle_message(eng, ipc.encode(ipc.AddRequest("bad", ids, params)))
    outs = now + eng.step()
    bad = [o for o in outs if o.request_id == "bad"]
    assert not shutdown and len(bad) == 1 and bad[0].error_code == "invalid_request", outs
    assert "bad" not in eng.requests
    eng.add_request("ok", [1, 2, 3], greedy(2))
    assert run_all(eng)["ok"][-1].finish_reason == "length"


def test_shutdown_and_abort_still_work():
    eng = make_engine()
    handle_message(eng, ipc.encode(ipc.AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=50).to_dict())))
    assert "r" in eng.requests
    handle_message(eng, ipc.encode(ipc.AbortRequest(["r", "unknown"])))
    assert "r" not in eng.requests
    assert handle_message(eng, ipc.encode(ipc.Shutdown())) == (True, [])


# --- heartbeats -----------------------------------------------------------------------------------------------------
def test_a_failing_stats_read_still_sends_a_heartbeat_with_progress():
    eng = make_engine()
    eng.stats = lambda: (_ for _ in ()).throw(ValueError("a bad stats value"))
    state: dict = {"engine": eng}
    for _ in range(3):
        hb = ipc.decode(heartbeat_message(state))
        assert isinstance(hb, ipc.Heartbeat) and "ticks" in hb.progress and hb.progress["num_running"] == 0
    assert hb.stats == {"heartbeat_errors": 3}


def test_an_unencodable_stats_value_still_sends_a_heartbeat():
    eng = make_engine()
    eng.stats = lambda: {"num_running": 0, "weird": object()}
    hb = ipc.decode(heartbeat_message({"engine": eng}))
    assert isinstance(hb, ipc.Heartbeat) and hb.stats["heartbeat_errors"] == 1 and "ticks" in hb.progress


def test_the_heartbeat_thread_survives_errors(monkeypatch):
    eng = make_engine()
    calls = {"n": 0}

    def flaky_stats():
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("every other read fails")
        return {"num_running": 0}

    eng.stats = flaky_stats
    monkeypatch.setattr(worker, "HEARTBEAT_INTERVAL_S", 0.02)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    t = threading.Thread(target=worker._heartbeat_loop, args=(ctx, f"tcp://127.0.0.1:{port}", {"engine": eng}, stop),
                         daemon=True)
    t.start()
    try:
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 6 and time.monotonic() < deadline:
            if pull.poll(100):
                got.append(ipc.decode(pull.recv()))
        assert len(got) == 6 and all(isinstance(m, ipc.Heartbeat) for m in got)
        assert t.is_alive()
    finally:
        stop.set()
        t.join(5)
        pull.close(linger=0)
        ctx.term()
