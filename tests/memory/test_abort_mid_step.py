"""A client that leaves during a long prefill frees its pages at the next layer boundary (issue 26: on 2 CPU cores
they came back 14 s after the client left, at the end of the chunk). In-process on the tiny Mixtral (CPU) with
the worker's real layer poll over a zmq pipe."""

from __future__ import annotations

import time

import zmq

from ferrylm.engine import ipc
from ferrylm.engine.worker import make_layer_poll
from tests.memory.conftest import LONG, SHORT, drain, greedy, make_engine


def pipe():
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    addr = f"inproc://abort-{time.monotonic_ns()}"
    pull.bind(addr)
    push.connect(addr)
    return pull, push


def test_abort_frees_pages_at_the_next_layer_boundary(offload_model):
    eng = make_engine(offload_model, "step_delay:ms=40:min_prompt=150", prefill=256)
    eng.add_request("short", SHORT, greedy(4))
    first = [t for o in eng.step() for t in o.new_token_ids]   # the short prefill (no delay: below min_prompt)
    pull, push = pipe()
    deferred: list[bytes] = []
    poll = make_layer_poll(eng, pull, deferred)
    seen: list[tuple[int, int]] = []              # pages in use before / after the poll, at each layer boundary
    gauge: list[tuple[int, int]] = []

    def callback():
        before = eng.pool.allocator.num_used
        if not seen:                             # the client leaves during the first layer of the long prefill
            push.send(ipc.encode(ipc.AbortRequest(["long"])))
            time.sleep(0.01)
        running = eng.num_running
        poll()
        seen.append((before, eng.pool.allocator.num_used))
        gauge.append((running, eng.num_running))   # what the running-requests gauge reads (Engine.stats)

    eng.progress.layer_callback = callback
    eng.add_request("long", LONG, greedy(4))
    outs = eng.step()                            # the long prefill + the short decode, 40 ms per layer
    assert len(seen) == offload_model.config.num_layers
    (before, after), rest = seen[0], seen[1:]
    long_pages = -(-len(LONG) // 16)
    assert before - after == long_pages, seen    # freed at the first layer boundary, with layers still to run
    assert all(b == a == after for b, a in rest)
    assert gauge[0] == (2, 1) and eng.stats()["num_running"] == 1   # the gauge drops with the pages
    assert "long" not in eng.requests
    long_outs = [o for o in outs if o.request_id == "long"]
    assert [o.finish_reason for o in long_outs] == ["abort"] and not long_outs[0].new_token_ids
    eng.progress.layer_callback = poll
    short = [o for o in outs if o.request_id == "short"]
    res = drain(eng, time.monotonic())           # the short request goes on, invariants checked every step
    assert len(short) == 1 and res["short"]["finish"] == "length"
    assert eng.pool.allocator.num_used == 0 and not deferred
    ref = make_engine(offload_model)             # the short request's tokens equal a run without the abort
    ref.add_request("short", SHORT, greedy(4))
    want = drain(ref, time.monotonic())["short"]["tokens"]
    assert first + short[0].new_token_ids + res["short"]["tokens"] == want


def test_other_messages_read_mid_step_wait_for_the_loop_in_order(offload_model):
    eng = make_engine(offload_model)
    pull, push = pipe()
    deferred: list[bytes] = []
    poll = make_layer_poll(eng, pull, deferred)
    add = ipc.encode(ipc.AddRequest("x", SHORT, greedy(2).to_dict()))
    push.send(add)
    push.send(ipc.encode(ipc.AbortRequest(["x"])))   # behind the AddRequest: must not overtake it
    time.sleep(0.05)
    poll()
    assert len(deferred) == 2 and deferred[0] == add and "x" not in eng.requests


def test_a_step_whose_requests_all_left_stops_at_the_next_layer_boundary(offload_model):
    """Issue 43: the client of the only request in a long prefill chunk leaves; the chunk stops at the next layer
    boundary (not after every layer), nothing of it is committed, the engine reads busy while it computes, and the
    next request's tokens equal a run without the abort."""
    eng = make_engine(offload_model, "step_delay:ms=40:min_prompt=150", prefill=256)
    pull, push = pipe()
    deferred: list[bytes] = []
    poll = make_layer_poll(eng, pull, deferred)
    layers_run: list[bool] = []                  # busy as /health reads it, at each layer boundary

    def callback():
        if not layers_run:
            push.send(ipc.encode(ipc.AbortRequest(["long"])))
            time.sleep(0.01)
        poll()
        layers_run.append(eng.stats()["busy"])

    eng.progress.layer_callback = callback
    eng.add_request("long", LONG, greedy(4))
    outs = eng.step()
    assert offload_model.config.num_layers > 1 and layers_run == [True], layers_run   # one layer ran, not all
    assert [(o.request_id, o.finish_reason) for o in outs] == [("long", "abort")]
    assert eng.pool.allocator.num_used == 0 and not eng.stats()["busy"]
    eng.progress.layer_callback = poll
    eng.add_request("short", SHORT, greedy(4))
    got = drain(eng, time.monotonic())["short"]["tokens"]
    ref = make_engine(offload_model)
    ref.add_request("short", SHORT, greedy(4))
    assert got == drain(ref, time.monotonic())["short"]["tokens"]
