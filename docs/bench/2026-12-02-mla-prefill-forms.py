"""MLA prefill chunk: absorbed vs expanded form on the CPU (docs/BENCHMARKS.md, 2026-12-02). Run:
OMP_NUM_THREADS=2 PYTHONPATH=src python docs/bench/2026-12-02-mla-prefill-forms.py"""
import time, torch
import ferrylm.models.latent_attention as la
torch.manual_seed(0)
H, N, P, V, R = 16, 128, 64, 128, 512   # DeepSeek-V3 per-head shapes, 16 of its 128 heads (CPU)
proj = la.LatentProjection.of(torch.randn(H*(N+V), R)*0.05, H, N, V)
scale = (N+P)**-0.5
def t(fn, reps=3):
    fn(); best=1e9
    for _ in range(reps):
        a=time.perf_counter(); fn(); best=min(best, time.perf_counter()-a)
    return best*1e3
for prefix in (0, 2048):
    for tq in (1, 16, 64, 128, 256, 512, 1024):
        L = prefix + tq
        latent = torch.randn(L, R+P)
        qn, qp = torch.randn(tq, H, N), torch.randn(tq, H, P)
        res = {}
        for name, val in (("absorbed", True), ("expanded", False)):
            la_abs = la.absorb_wins
            la.absorb_wins = lambda *a, v=val, **k: v
            res[name] = t(lambda: la.latent_chunk_attention(qn, qp, latent, proj, scale, q_offset=prefix))
            la.absorb_wins = la_abs
        print(f"prefix {prefix:5d} chunk {tq:5d}: absorbed {res['absorbed']:8.1f} ms  expanded {res['expanded']:8.1f} ms  cost model says {'absorbed' if la.absorb_wins(tq,R,N,P,V) else 'expanded'}")
