"""The one-kernel DeltaNet chunk scan and routing scores against the torch forms they replace: median time and
error at Qwen3.5-35B-A3B's shapes. `DEV=cpu TRITON_INTERPRET=1` runs a small smoke version on a CPU."""
import json
import os
import sys
import time

import torch

if os.environ.get("DEV") == "cpu":   # a CPU smoke run: the interpreter, patched as the tests patch it
    sys.path.insert(0, os.getcwd())
    from tests.kernels.interp import _patch_index
    _patch_index()
import ferrylm.models.kernels.gated_delta as gd
import ferrylm.synthetic.routing_model as rm
from ferrylm.synthetic.routing_profiles import get_profile


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps=5):
    fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    out.sort()
    return out[len(out) // 2] * 1e3


def gdn(t, h=32, dk=128, dv=128):
    dev = os.environ.get("DEV", "cuda")
    g0 = torch.Generator(device=dev).manual_seed(0)
    q = gd.l2_normalize(torch.randn(t, h, dk, device=dev, generator=g0))
    k = gd.l2_normalize(torch.randn(t, h, dk, device=dev, generator=g0))
    v = torch.randn(t, h, dv, device=dev, generator=g0)
    g = -torch.nn.functional.softplus(torch.randn(t, h, device=dev, generator=g0)) * 0.5
    beta = torch.sigmoid(torch.randn(t, h, device=dev, generator=g0))
    s0 = torch.randn(h, dk, dv, device=dev, generator=g0) * 0.1
    res = {}
    real = gd.use_triton
    for name, flag in (("torch_loop", False), ("kernel", True)):
        gd.use_triton = (lambda w: flag)
        o, s = gd.gated_delta_chunked(q, k, v, g, beta, s0)
        res[name] = (o, s, timed(lambda: gd.gated_delta_chunked(q, k, v, g, beta, s0)))
    gd.use_triton = real
    o0, s0_, _ = res["torch_loop"]
    o1, s1, _ = res["kernel"]
    err_o = ((o1 - o0).abs().max() / o0.abs().max()).item()
    err_s = ((s1 - s0_).abs().max() / s0_.abs().max()).item()
    return {"tokens": t, "heads": h, "torch_loop_ms": res["torch_loop"][2], "kernel_ms": res["kernel"][2],
            "rel_err_o": err_o, "rel_err_state": err_s}


def routing(t, layers=40, e=256, k=8):
    prof = get_profile("qwen3")
    dev = torch.device(os.environ.get("DEV", "cuda"))
    m = rm.RoutingModel(prof, e, k, seed=1, layers=range(layers), device=dev)
    keys = torch.randint(0, 1 << 62, (t,), device=dev)
    pos = torch.randint(0, 30000, (t,), device=dev)
    real = rm.use_triton
    out = {}
    for name, flag in (("torch", False), ("kernel", True)):
        rm.use_triton = (lambda x: flag)
        if m.batches_layers(t):
            f = lambda: m.route_all(keys, pos)
        else:
            f = lambda: [m.route(layer, keys, pos) for layer in range(layers)]
        r = f()
        out[name] = (r, timed(f))
    rm.use_triton = real
    a, b = out["torch"][0], out["kernel"][0]
    same = all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, (tuple, list)) else torch.equal(a, b)
    return {"tokens": t, "layers": layers, "torch_ms": out["torch"][1], "kernel_ms": out["kernel"][1], "same": same}


if __name__ == "__main__":
    rows = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "gdn": [], "routing": []}
    for t in ((64,) if os.environ.get("DEV") == "cpu" else (1024, 8192)):
        rows["gdn"].append(gdn(t))
        print("gdn", rows["gdn"][-1], flush=True)
    for t in ((1, 16) if os.environ.get("DEV") == "cpu" else (1, 16, 8192)):
        rows["routing"].append(routing(t))
        print("routing", rows["routing"][-1], flush=True)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "ab_kernels.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
