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

from ferrylm.bench.report import report


def _bench(fn, reps: int = 50) -> float:
    """Median ms of eager calls (host launch time included)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median"))


def _bench_graph(fn, reps: int = 50) -> float | None:
    """Median ms of ``fn`` replayed as a CUDA graph (device time, as in a captured decode step)."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=reps, return_mode="median"))
    except Exception:  # noqa: BLE001 - not capturable (a host sync): reported as None
        torch.cuda.synchronize()
        return None


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
    from ferrylm.engine.attention.metadata import decode_splits
    from ferrylm.engine.attention.triton_paged import paged_attention
    from ferrylm.engine.attention.torch_backend import PagedAttention, SeqSlice
    from ferrylm.engine.cache.kv_pool import KVLayout, KVPool
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
            gms = _bench_graph(tri)
            rows.append({"op": "attention decode", "batch": b, "kv_len": L, "impl": f"triton paged, {splits} splits",
                         "ms": ms, "graph_ms": gms, "gbs": kv_bytes / (gms or ms) / 1e6})
            pool = KVPool(layout=KVLayout(1, (0,), hkv, d, hkv, d), num_pages=0, page_size=ps, dtype=dt, device=dev)
            pool.k, pool.v = [kc], [vc]
            seqs = []
            for i in range(b):
                sl = (bt[i].long()[:, None] * ps + torch.arange(ps, device=dev)).reshape(-1)[:L]
                seqs.append(SeqSlice(q_start=i, q_len=1, ctx_len=L - 1, slots=sl))
            old = PagedAttention(pool, seqs, dev)
            ms = _bench(lambda: old._decode(0, q, d ** -0.5, None, None))
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
        cands = [("triton fused", lambda: fused_moe(x, gate, up, down, ids, w), True)]
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
            cands.append(("torch._grouped_mm", grouped, True))
        if t <= 4096:
            cands.append(("torch host-planned (old)", lambda: run_grouped(LayerExperts(gate, up, down), x, ids, w),
                          False))
        for name, fn, graphable in cands:
            try:
                out = fn()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = _bench(fn)
                gms = _bench_graph(fn) if graphable and t <= 256 else None
            except Exception as ex:  # noqa: BLE001 - a candidate this torch cannot run is reported, not fatal
                rows.append({"op": "moe layer", "tokens": t, "impl": name, "error": f"{type(ex).__name__}: {ex}"[:200]})
                continue
            best = gms or ms
            rows.append({"op": "moe layer", "tokens": t, "experts_used": used, "impl": name, "ms": ms,
                         "graph_ms": gms, "gbs": wbytes / best / 1e6, "tflops": flops / best / 1e9, "rel_err": err})
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
            gms = _bench_graph(lambda: fused_moe(x, gate, up, down, ids, w, tiles=tiles))
            rows.append({"op": "moe tiles", "tokens": t, "impl": f"gu {bn1}x{bk1} d {bn2}x{bk2} w{nw}",
                         "graph_ms": gms, "gbs": used * ebytes / gms / 1e6 if gms else None})
    return rows


def mapped_cases() -> list[tuple[str, int, int, int, int, dict]]:
    """``(shape name, experts, top-k, hidden, intermediate, {quant name: ExpertQuant | None})`` of
    :func:`mapped_rows`: Qwen3-30B-A3B's experts in bf16 and int4 (g32, bf16 scales), DeepSeek-V3's in fp8 with
    128-wide float32 scales (its published checkpoints' format; 32 of its 256 experts, to bound host memory)."""
    from ferrylm.experts.quantized import ExpertQuant, QuantFormat

    fp8 = QuantFormat("fp8", 128, torch.float32)
    return [("qwen3-30b-a3b", 128, 8, 2048, 768,
             {"bf16": None, "int4": ExpertQuant(QuantFormat("int4", 32), QuantFormat("int4", 32))}),
            ("deepseek-v3", 32, 8, 7168, 2048, {"fp8": ExpertQuant(fp8, fp8)})]


def mapped_rows(dev) -> list[dict]:
    """The offloading backends' table launch (``fused_moe(..., row_offset=...)``): one layer's experts read from
    device slot rows, from mapped pinned host rows over PCIe (zero-copy, the table path's misses), or half each,
    for each of :func:`mapped_cases`; beside a pinned DMA copy of the same bytes (the host-planned path's fetch).
    GB/s counts the experts' bytes read once (the PCIe roofline for the host rows)."""
    rows = []
    for shape, e, k, h, i, quants in mapped_cases():
        rows += [dict(r, shape=shape) for r in _mapped_case(dev, e, k, h, i, quants)]
    return rows


def _mapped_case(dev, e: int, k: int, h: int, i: int, quants: dict) -> list[dict]:
    from ferrylm.experts.executor import ExpertLayout
    from ferrylm.experts.kernels.fused_moe import MoeTiles, fused_moe
    from ferrylm.experts.slot_table import device_address
    from ferrylm.experts.kernels.installs import demand_programs

    rows = []
    for qname, q in quants.items():
        lay = ExpertLayout(h, i, torch.bfloat16, quant=q)
        host = torch.randint(0, 255, (e, lay.numel), dtype=torch.uint8).view(lay.row_dtype) if q else \
            (torch.randn(e, lay.numel) * 0.02).to(torch.bfloat16)
        if q is not None:  # sane scales: every row's scale fields small positive
            v = lay.layer_views(host)
            for part in (v.gate, v.up, v.down):
                part.scales.fill_(1e-3)
        host = host.pin_memory()
        slots = host.to(dev)
        ref = torch.zeros(1, lay.numel, dtype=lay.row_dtype, device=dev)
        views = lay.layer_views(ref)
        haddr = device_address(host, dev)
        if haddr is None:
            rows.append({"op": "moe mapped", "quant": qname, "error": "pinned memory not mapped"})
            continue
        rb = lay.nbytes
        off_dev = torch.arange(e, device=dev, dtype=torch.int64) * rb + (slots.data_ptr() - ref.data_ptr())
        off_host = torch.arange(e, device=dev, dtype=torch.int64) * rb + (haddr - ref.data_ptr())
        off_half = torch.where(torch.arange(e, device=dev) % 2 == 0, off_dev, off_host)
        dst = torch.empty(e, lay.numel, dtype=lay.row_dtype, device=dev)
        for t in (1, 4, 16, 64):
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
            w, ids = torch.topk(torch.randn(t, e, device=dev).softmax(-1), k)
            used = sorted(set(ids.reshape(-1).tolist()))
            wbytes = len(used) * rb
            idx = torch.tensor(used, device="cpu")
            src_rows = host[idx].pin_memory()
            dma = _bench_graph(lambda: dst[:len(used)].copy_(src_rows, non_blocking=True)) or \
                _bench(lambda: dst[:len(used)].copy_(src_rows, non_blocking=True))
            rows.append({"op": "moe mapped", "quant": qname, "tokens": t, "impl": "pinned DMA copy of the experts",
                         "graph_ms": dma, "gbs": wbytes / dma / 1e6, "experts_used": len(used)})
            programs = demand_programs(dev)
            cms = _bench_graph(_install_copy(ref, used, off_host, dst, rb, e, programs))
            rows.append({"op": "moe mapped", "quant": qname, "tokens": t, "impl": f"install copy kernel, grid of "
                         f"{programs} (mapped rows -> slots, the table path's installs)", "graph_ms": cms,
                         "gbs": wbytes / cms / 1e6 if cms else None, "experts_used": len(used)})
            for where, offs in (("slots (HBM)", off_dev), ("host (mapped, PCIe)", off_host), ("half each", off_half)):
                gms = _bench_graph(lambda: fused_moe(x, views.gate, views.up, views.down, ids, w, row_offset=offs))
                rows.append({"op": "moe mapped", "quant": qname, "tokens": t, "impl": f"fused, {where}",
                             "graph_ms": gms, "gbs": wbytes / gms / 1e6 if gms else None,
                             "experts_used": len(used)})
            if t in (1, 16):  # tiles for the PCIe reads
                for bn1, bk1, bn2, bk2, nw, st in ((32, 128, 64, 128, 4, 2), (64, 128, 128, 128, 4, 4),
                                                   (32, 256, 64, 256, 4, 3), (128, 64, 128, 64, 4, 4),
                                                   (64, 64, 64, 64, 4, 6), (32, 128, 64, 128, 4, 6)):
                    tiles = (MoeTiles(16, bn1, bk1, nw, st), MoeTiles(16, bn2, bk2, nw, st))
                    gms = _bench_graph(lambda: fused_moe(x, views.gate, views.up, views.down, ids, w,
                                                         row_offset=off_host, tiles=tiles))
                    rows.append({"op": "moe mapped tiles", "quant": qname, "tokens": t,
                                 "impl": f"host gu {bn1}x{bk1} d {bn2}x{bk2} w{nw} s{st}", "graph_ms": gms,
                                 "gbs": wbytes / gms / 1e6 if gms else None})
        del host, slots, dst
    return rows


def _install_copy(ref: torch.Tensor, used: list[int], off_host: torch.Tensor, dst: torch.Tensor, row_bytes: int,
                  num_experts: int, programs: int):
    """A call copying the ``used`` experts' rows from their mapped host rows (byte offsets ``off_host`` from ``ref``)
    to the first rows of ``dst`` with the table path's install kernel (``experts/kernels/installs.copy_rows``) on a
    grid of ``programs``."""
    import numpy as np

    from ferrylm.experts.kernels.installs import copy_rows, item_dtype

    dev = ref.device
    sel = torch.tensor(used, device=dev, dtype=torch.int64)
    dst_off = torch.zeros(num_experts, device=dev, dtype=torch.int64)
    dst_off[sel] = torch.arange(len(used), device=dev) * row_bytes + (dst.data_ptr() - ref.data_ptr())
    offsets = np.concatenate([off_host.cpu().numpy(), dst_off.cpu().numpy()])
    items = ref.view(-1).view(item_dtype(row_bytes, ref.data_ptr(), offsets))
    count = torch.tensor([len(used)], device=dev, dtype=torch.int64)
    return lambda: copy_rows(items, sel, count, off_host, dst_off, row_bytes, programs)


def main(args) -> int:
    if not torch.cuda.is_available():
        print("ferry bench kernels: needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    t0 = time.time()
    hbm = _hbm_gbs(dev)
    only = set((getattr(args, "only", None) or "attention,moe,mapped").split(","))
    rows = ((attention_rows(dev) if "attention" in only else []) + (moe_rows(dev) if "moe" in only else [])
            + (mapped_rows(dev) if "mapped" in only else []))
    for r in rows:
        print(json.dumps(r))
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "hbm_copy_gbs": hbm,
           "seconds": time.time() - t0, "rows": rows}
    report(f"HBM copy {hbm:.0f} GB/s", out, args.output_json)
    return 0
