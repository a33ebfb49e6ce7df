"""The synthetic routing model on a GPU: no device->host sync while it routes, it captures in a CUDA graph (a
replay with new positions and keys in the static buffers routes as eager does), and CUDA and CPU choose the same
experts. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ferrylm.synthetic.routing_model import RoutingModel
from ferrylm.synthetic.routing_profiles import get_profile

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("profile", ["qwen3", "olmoe", "wide512", "uniform"])
def test_routing_is_sync_free_graph_capturable_and_matches_cpu(profile):
    prof = get_profile(profile)
    e, k = prof.shape
    dev = torch.device("cuda")
    gpu = RoutingModel(prof, e, k, seed=3, layers=range(3), device=dev)
    cpu = RoutingModel(prof, e, k, seed=3, layers=range(3))
    keys = torch.randint(0, 1 << 62, (16,), device=dev)
    pos = torch.randint(0, 5000, (16,), device=dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, pred = gpu.route(1, keys, pos), gpu.predict(2, keys, pos)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(ids.cpu(), cpu.route(1, keys.cpu(), pos.cpu()))
    assert torch.equal(pred.cpu(), cpu.predict(2, keys.cpu(), pos.cpu()))

    static_keys, static_pos = keys.clone(), pos.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gpu.route(1, static_keys, static_pos)  # warm-up outside the capture
        gpu.route_all(static_keys, static_pos)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu.route(1, static_keys, static_pos)
        out_all, pred_all = gpu.route_all(static_keys, static_pos)
    new_keys, new_pos = torch.randint(0, 1 << 62, (16,), device=dev), torch.randint(0, 5000, (16,), device=dev)
    static_keys.copy_(new_keys)
    static_pos.copy_(new_pos)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gpu.route(1, new_keys, new_pos))
    assert torch.equal(out_all[gpu.layer_slot(1)], out) and torch.equal(pred_all[2], gpu.predict(2, new_keys, new_pos))
