"""The fused MoE kernels against the torch reference path (``experts.resident.run_grouped``: the host-planned /
grouped GEMM chains every backend shares): resident stacks and slot-cache rows read through ``slot_of``, decode and
prefill tile shapes, tail sizes. On CPU through Triton's interpreter (float32); on a GPU in bfloat16."""

from __future__ import annotations

import pytest
import torch

from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.executor import ExpertMath, LayerExperts
from ferrylm.experts.resident import run_grouped
from tests.kernels.interp import kernel_device, load_kernels


def _experts(e, i, h, gen):
    return (torch.randn(e, i, h, generator=gen) / h ** 0.5, torch.randn(e, i, h, generator=gen) / h ** 0.5,
            torch.randn(e, h, i, generator=gen) / i ** 0.5)


@pytest.mark.parametrize("t,e,k,h,i,slots", [(1, 16, 4, 64, 32, False), (5, 16, 4, 64, 48, False),
                                             (40, 8, 2, 96, 40, False), (3, 16, 4, 64, 32, True),
                                             (70, 8, 2, 64, 32, True)])
def test_fused_moe_matches_the_reference(t, e, k, h, i, slots):
    m = load_kernels("ferrylm.experts.kernels.fused_moe")
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(t * 7 + e)
    gate, up, down = _experts(e, i, h, gen)
    x = torch.randn(t, h, generator=gen)
    w, ids = torch.topk(torch.randn(t, e, generator=gen).softmax(-1), k)
    ref = run_grouped(LayerExperts(gate.to(dtype).double(), up.to(dtype).double(), down.to(dtype).double()),
                      x.to(dtype).double(), ids, w.double())
    x, ids, w = x.to(dev, dtype), ids.to(dev), w.to(dev)
    used = torch.zeros((), dtype=torch.int64, device=dev)
    if slots:  # experts scattered over a larger slot buffer, found through slot_of
        lay = ExpertLayout(h, i, dtype)
        packed = torch.zeros(e + 5, lay.numel, dtype=dtype, device=dev)
        where = torch.randperm(e + 5, generator=gen)[:e]
        for j in range(e):
            packed[where[j]] = torch.cat([gate[j].reshape(-1), up[j].reshape(-1), down[j].reshape(-1)]).to(dev, dtype)
        v = lay.layer_views(packed)
        out = m.fused_moe(x, v.gate, v.up, v.down, ids, w, slot_of=where.to(dev, torch.int32), used_experts=used)
    else:
        out = m.fused_moe(x, gate.to(dev, dtype), up.to(dev, dtype), down.to(dev, dtype), ids, w,
                          used_experts=used)
    assert out.dtype == dtype and out.shape == (t, h)
    rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-5), rel
    assert int(used) == len(set(ids.reshape(-1).tolist()))


@pytest.mark.parametrize("t,slots", [(1, False), (3, True), (40, False)])
def test_fused_moe_with_gpt_oss_biases_and_clamp_matches_the_reference(t, slots):
    """Expert biases picked by expert id (also when the rows sit in other slots) and the clamped SwiGLU, with a
    limit that clamps a good share of the gate / up values."""
    m = load_kernels("ferrylm.experts.kernels.fused_moe")
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    e, k, h, i = 8, 2, 64, 32
    gen = torch.Generator().manual_seed(t)
    gate, up, down = _experts(e, i, h, gen)
    bias = [torch.randn(e, n, generator=gen) for n in (i, i, h)]
    x = 2 * torch.randn(t, h, generator=gen)
    w, ids = torch.topk(torch.randn(t, e, generator=gen).softmax(-1), k)
    math = ExpertMath(*(b.to(dtype).double() for b in bias), alpha=1.702, limit=0.7)
    ref = run_grouped(LayerExperts(gate.to(dtype).double(), up.to(dtype).double(), down.to(dtype).double(),
                                   math=math), x.to(dtype).double(), ids, w.double())
    plain = run_grouped(LayerExperts(gate.double(), up.double(), down.double()), x.double(), ids, w.double())
    assert (ref - plain).abs().max() > 0.1
    x, ids, w, dmath = x.to(dev, dtype), ids.to(dev), w.to(dev), math.to(dev)
    dmath = ExpertMath(*(b.to(dtype) for b in (dmath.gate_bias, dmath.up_bias, dmath.down_bias)), 1.702, 0.7)
    if slots:
        lay = ExpertLayout(h, i, dtype)
        packed = torch.zeros(e + 3, lay.numel, dtype=dtype, device=dev)
        where = torch.randperm(e + 3, generator=gen)[:e]
        for j in range(e):
            packed[where[j]] = torch.cat([gate[j].reshape(-1), up[j].reshape(-1), down[j].reshape(-1)]).to(dev, dtype)
        v = lay.layer_views(packed)
        out = m.fused_moe(x, v.gate, v.up, v.down, ids, w, slot_of=where.to(dev, torch.int32), math=dmath)
    else:
        out = m.fused_moe(x, gate.to(dev, dtype), up.to(dev, dtype), down.to(dev, dtype), ids, w, math=dmath)
    rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-5), rel


def test_moe_align_groups_by_expert_in_padded_blocks():
    m = load_kernels("ferrylm.experts.kernels.fused_moe")
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3]])
    sorted_ids, block_expert, num_padded, counts = m.moe_align(ids, 5, 4)
    flat = ids.reshape(-1)
    assert counts.tolist() == [1, 3, 1, 3, 0]
    n = int(num_padded)
    assert n == 16  # four used experts, one block of 4 rows each
    rows = sorted_ids[:n].view(-1, 4)
    for b, row in enumerate(rows.tolist()):
        real = [a for a in row if a < flat.numel()]
        assert all(int(flat[a]) == int(block_expert[b]) for a in real)
        assert real == sorted(real) and real
    assert sorted(a for a in sorted_ids.tolist() if a < flat.numel()) == list(range(flat.numel()))


@pytest.mark.parametrize("t,e,k,bm", [(1, 128, 8, 16), (3, 16, 4, 16), (16, 128, 8, 16), (9, 5, 2, 4),
                                      (40, 64, 6, 16)])
def test_small_align_kernel_equals_the_torch_grouping(t, e, k, bm):
    m = load_kernels("ferrylm.experts.kernels.fused_moe")
    dev = kernel_device()
    gen = torch.Generator().manual_seed(t * 31 + e)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(dev)
    used = torch.full((), 5, dtype=torch.int64, device=dev)
    s1, b1, n1, dest = m.align_small(ids, e, bm, used)
    s2, b2, n2, counts = m.moe_align(ids, e, bm)
    assert int(n1) == int(n2)
    n = int(n1)
    assert torch.equal(s1[:n].cpu(), s2[:n].cpu())
    assert torch.equal(b1[:n // bm].cpu(), b2[:n // bm].cpu())
    assert torch.equal(dest.cpu(), m.expert_rank_rows(ids).cpu())
    assert int(used) == 5 + int((counts > 0).sum())
