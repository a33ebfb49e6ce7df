"""Decode graph captures hold Python's garbage collector off (engine/cuda_graphs.graph_capture): a collection inside
a capture can free a page-locked tensor, and that free records a CUDA event the capturing stream refuses. The
capture itself is CUDA-only (tests/gpu); here torch's context is replaced to see what runs around it."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from ferrylm.engine.cuda_graphs import graph_capture


def test_the_collector_is_off_inside_a_capture_and_restored_after(monkeypatch):
    seen = {}

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        seen["mode"], seen["gc_inside"] = capture_error_mode, gc.isenabled()
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with graph_capture(object(), None):
        assert not gc.isenabled()
    assert gc.isenabled() and seen == {"mode": "thread_local", "gc_inside": False}
    with pytest.raises(RuntimeError), graph_capture(object(), None):
        raise RuntimeError("capture failed")
    assert gc.isenabled()   # restored on failure too
