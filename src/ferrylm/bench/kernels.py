"""``ferry bench kernels``: the GPU kernel candidates side by side, at one model's shapes (default Qwen3-30B-A3B:
32 query heads, 4 KV heads, head_dim 128, page 16; 128 experts, top-8, H 2048, I 768; bf16).

* attention, prefill of one sequence (``T`` tokens): the Triton paged kernel (``engine/attention``), SDPA's flash
  kernel on contiguous K/V (a lower bound: no paging), and the torch path the engine used before (gather the
  sequence's K/V, SDPA with a mask: its peak memory is the score matrix);
* attention, decode of ``B`` sequences of ``L`` tokens: the Triton kernel (split-KV) and the gather + SDPA path;
* MoE layer at ``T`` tokens: the fused Triton kernels (``experts/kernels/fused_moe.py``), ``torch._grouped_mm``
  over the assignments sorted by expert (when this torch has it), and the host-planned torch path
  (``experts/work.py``).

Each figure is the median of ``triton.testing.do_bench`` (ms), with the bytes it must move at least (weights / KV
read once) over the time as GB/s, and the peak extra memory of one call. HBM copy bandwidth is measured first, as
the roofline.
"""

from __future__ import annotations

import json
import time

import torch


def _bench(fn, reps: int = 50) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median"))


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _hbm_gbs(dev) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = _bench(lambda: y.copy_(x), 20)
    return 2 * x.numel() / ms / 1e6


def attention_rows(dev, hq=32, hkv=4, d=128, ps=16) -> list[dict]:
    from ferrylm.engine.attention import decode_splits
    from ferrylm.engine.attention.triton_paged import paged_attention
    from ferrylm.engine.kv_cache import KVPool, PagedAttention, SeqSlice
    from ferrylm.models.attention import causal_attention

    rows = []
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    dt = torch.bfloat16
    for t in (4096, 8192):
        q = torch.randn(t, hq, d, device=dev, dtype=dt)
        kc = torch.randn(t + ps, hkv, d, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        bt = torch.arange(-(-t // ps), device=dev, dtype=torch.int32)[None]
        lens = torch.tensor([t], device=dev, dtype=torch.int32)
        qsl = torch.tensor([0, t], device=dev, dtype=torch.int32)
        tri = lambda: paged_attention(q, kc, vc, bt, lens, qsl, scale=d ** -0.5, page_size=ps, max_query_len=t)  # noqa: E731
        kk, vv = kc[:t].transpose(0, 1), vc[:t].transpose(0, 1)
        flash = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q.transpose(0, 1), kk, vv, is_causal=True, enable_gqa=True)
        flops = 4 * hq * d * t * t / 2
        for name, fn in (("triton paged", tri), ("sdpa flash, contiguous", flash)):
            ms = _bench(fn)
            rows.append({"op": "attention prefill", "tokens": t, "impl": name, "ms": ms,
                         "tflops": flops / ms / 1e9, "peak_mib": _peak(fn) / 2**20})
        if t <= 4096:
            slots = torch.arange(t, device=dev)
            old = lambda: causal_attention(q, kc[slots], vc[slots], d ** -0.5, q_offset=0)  # noqa: E731
            try:
                ms = _bench(old, 10)
                rows.append({"op": "attention prefill", "tokens": t, "impl": "torch gather + sdpa (old)", "ms": ms,
                             "tflops": flops / ms / 1e9, "peak_mib": _peak(old) / 2**20})
            except torch.OutOfMemoryError:
                rows.append({"op": "attention prefill", "tokens": t, "impl": "torch gather + sdpa (old)",
                             "error": "out of memory"})
        del q, kc, vc
    for b in (1, 16, 64):
        for L in (1024, 8192):
            pages = -(-L // ps)
            kc = torch.randn(b * pages * ps, hkv, d, device=dev, dtype=dt)
            vc = torch.randn_like(kc)
            q = torch.randn(b, hq, d, device=dev, dtype=dt)
            bt = torch.randperm(b * pages, device=dev).to(torch.int32).view(b, pages)
            lens = torch.full((b,), L, device=dev, dtype=torch.int32)
            qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
            splits = decode_splits(b, hkv, sms)
            tri = lambda: paged_attention(q, kc, vc, bt, lens, qsl, scale=d ** -0.5, page_size=ps,  # noqa: E731
                                          max_query_len=1, num_splits=splits)
            kv_bytes = 2 * b * L * hkv * d * 2
            ms = _bench(tri)
            rows.append({"op": "attention decode", "batch": b, "kv_len": L, "impl": f"triton paged, {splits} splits",
                         "ms": ms, "gbs": kv_bytes / ms / 1e6})
            pool = KVPool.__new__(KVPool)
            pool.k, pool.v, pool.page_size = [kc], [vc], ps
            seqs = []
            for i in range(b):
                sl = (bt[i].long()[:, None] * ps + torch.arange(ps, device=dev)).reshape(-1)[:L]
                seqs.append(SeqSlice(q_start=i, q_len=1, ctx_len=L - 1, slots=sl))
            old = PagedAttention(pool, seqs, dev)
            ms = _bench(lambda: old._decode(q, kc, vc, d ** -0.5))
            rows.append({"op": "attention decode", "batch": b, "kv_len": L, "impl": "torch gather + sdpa (old)",
                         "ms": ms, "gbs": kv_bytes / ms / 1e6})
            del kc, vc
    return rows


def moe_rows(dev, e=128, k=8, h=2048, i=768) -> list[dict]:
    from ferrylm.experts.executor import LayerExperts
    from ferrylm.experts.kernels.fused_moe import fused_moe
    from ferrylm.experts.resident import run_grouped

    dt = torch.bfloat16
    gate = torch.randn(e, i, h, device=dev, dtype=dt) / h ** 0.5
    up = torch.randn(e, i, h, device=dev, dtype=dt) / h ** 0.5
    down = torch.randn(e, h, i, device=dev, dtype=dt) / i ** 0.5
    w13 = torch.cat([gate, up], 1).transpose(1, 2)  # [E, H, 2I] for grouped_mm
    w2 = down.transpose(1, 2)                       # [E, I, H]
    ebytes = 3 * h * i * 2
    rows = []
    for t in (1, 4, 16, 64, 256, 4096, 8192):
        x = torch.randn(t, h, device=dev, dtype=dt)
        w, ids = torch.topk(torch.randn(t, e, device=dev).softmax(-1), k)
        used = len(set(ids.reshape(-1).tolist()))
        wbytes = used * ebytes
        flops = 2 * t * k * 3 * h * i
        ref = run_grouped(LayerExperts(gate, up, down), x, ids, w)
        cands = [("triton fused", lambda: fused_moe(x, gate, up, down, ids, w))]
        if hasattr(torch, "_grouped_mm"):
            def grouped():
                order = torch.argsort(ids.reshape(-1), stable=True)
                counts = torch.zeros(e, dtype=torch.int32, device=dev).scatter_add_(
                    0, ids.reshape(-1), torch.ones(t * k, dtype=torch.int32, device=dev))
                offs = torch.cumsum(counts, 0, dtype=torch.int32)
                xs = x[order // k]
                gu = torch._grouped_mm(xs, w13, offs=offs)
                hh = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
                y = torch._grouped_mm(hh, w2, offs=offs) * w.reshape(-1)[order, None].to(dt)
                out = torch.zeros(t * k, h, device=dev, dtype=dt).index_copy_(0, order, y)
                return out.view(t, k, h).sum(1, dtype=torch.float32).to(dt)
            cands.append(("torch._grouped_mm", grouped))
        if t <= 4096:
            cands.append(("torch host-planned (old)", lambda: run_grouped(LayerExperts(gate, up, down), x, ids, w)))
        for name, fn in cands:
            try:
                out = fn()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = _bench(fn)
            except Exception as ex:  # noqa: BLE001 - a candidate this torch cannot run is reported, not fatal
                rows.append({"op": "moe layer", "tokens": t, "impl": name, "error": f"{type(ex).__name__}: {ex}"[:200]})
                continue
            rows.append({"op": "moe layer", "tokens": t, "experts_used": used, "impl": name, "ms": ms,
                         "gbs": wbytes / ms / 1e6, "tflops": flops / ms / 1e9, "rel_err": err})
        del x
    # decode tile sweep: which tiles stream the weights fastest at one and sixteen tokens
    from ferrylm.experts.kernels.fused_moe import MoeTiles
    for t in (1, 16):
        x = torch.randn(t, h, device=dev, dtype=dt)
        w, ids = torch.topk(torch.randn(t, e, device=dev).softmax(-1), k)
        used = len(set(ids.reshape(-1).tolist()))
        for bn1, bk1, bn2, bk2, nw in ((32, 128, 64, 128, 4), (64, 128, 64, 128, 4), (32, 256, 32, 256, 4),
                                       (16, 256, 32, 256, 2), (64, 64, 128, 64, 4), (32, 128, 32, 128, 2)):
            tiles = (MoeTiles(16, bn1, bk1, nw, 4), MoeTiles(16, bn2, bk2, nw, 4))
            ms = _bench(lambda: fused_moe(x, gate, up, down, ids, w, tiles=tiles))
            rows.append({"op": "moe tiles", "tokens": t, "impl": f"gu {bn1}x{bk1} d {bn2}x{bk2} w{nw}", "ms": ms,
                         "gbs": used * ebytes / ms / 1e6})
    return rows


def main(args) -> int:
    if not torch.cuda.is_available():
        print("ferry bench kernels: needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    t0 = time.time()
    hbm = _hbm_gbs(dev)
    rows = attention_rows(dev) + moe_rows(dev)
    for r in rows:
        print(json.dumps(r))
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "hbm_copy_gbs": hbm,
           "seconds": time.time() - t0, "rows": rows}
    print(f"HBM copy {hbm:.0f} GB/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
