"""ResidentExecutor against a naive per-token loop, routing details, and backend selection."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferrylm.experts import MOE_BACKENDS, build_executor
from ferrylm.experts.executor import LayerExperts
from ferrylm.experts.resident import ResidentExecutor, group_by_expert
from ferrylm.models.moe import softmax_topk


def _experts(e=6, h=32, i=24, seed=0, dtype=torch.float32) -> LayerExperts:
    g = torch.Generator().manual_seed(seed)
    return LayerExperts(gate=(0.2 * torch.randn(e, i, h, generator=g)).to(dtype),
                        up=(0.2 * torch.randn(e, i, h, generator=g)).to(dtype),
                        down=(0.2 * torch.randn(e, h, i, generator=g)).to(dtype))


def _naive(ex: LayerExperts, x, ids, w):
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xe = x[t].float()
            y = ex.down[e].float() @ (F.silu(ex.gate[e].float() @ xe) * (ex.up[e].float() @ xe))
            out[t] += float(w[t, j]) * y
    return out


def _routing(t, e, k, seed, active=None):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(t, e, generator=g)
    if active is not None:  # only these experts can be chosen
        mask = torch.full((e,), float("-inf"))
        mask[active] = 0
        scores = scores + mask
    return softmax_topk(scores, k, renormalize=True)


@pytest.mark.parametrize("t,k,active", [(37, 2, None), (5, 3, [0, 2, 5]), (1, 2, None)])
def test_resident_matches_naive_loop(t, k, active):
    ex = _experts()
    x = torch.randn(t, 32, generator=torch.Generator().manual_seed(1))
    ids, w = _routing(t, 6, k, seed=2, active=active)
    out = ResidentExecutor({3: ex}).run(3, x, ids, w)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, _naive(ex, x, ids, w), rtol=1e-5, atol=1e-5)


def test_resident_bfloat16_close_to_float32_reference():
    ex32 = _experts()
    ex16 = LayerExperts(gate=ex32.gate.bfloat16(), up=ex32.up.bfloat16(), down=ex32.down.bfloat16())
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    ids, w = _routing(20, 6, 2, seed=4)
    out = ResidentExecutor({0: ex16}).run(0, x, ids, w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _naive(ex16, x, ids, w), rtol=2e-2, atol=2e-2)


def test_empty_batch_and_unknown_layer():
    ex = ResidentExecutor({0: _experts()})
    out = ex.run(0, torch.zeros(0, 32), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 32)
    with pytest.raises(KeyError, match="layer 1"):
        ex.run(1, torch.zeros(1, 32), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))


def test_group_by_expert_sorts_and_counts():
    ids = torch.tensor([[2, 0], [0, 3], [3, 2]])
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    g = group_by_expert(ids, w, num_experts=5)
    assert g.counts == [2, 0, 2, 2, 0]
    assert g.token_idx.tolist() == [0, 1, 0, 2, 1, 2]
    assert g.weights.tolist() == pytest.approx([0.4, 0.7, 0.6, 0.5, 0.3, 0.5])
    with pytest.raises(ValueError, match="out of range"):
        group_by_expert(torch.tensor([[5, 0]]), torch.ones(1, 2), num_experts=5)


def test_softmax_topk_matches_torch_topk_and_renormalize_flag():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [0.1, 0.2, 0.3, 0.4]])
    ids, w = softmax_topk(logits, 2, renormalize=True)
    ref_w, ref_ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    assert torch.equal(ids, ref_ids)  # tie (experts 1 and 2) broken exactly as torch.topk does
    torch.testing.assert_close(w, ref_w / ref_w.sum(-1, keepdim=True))
    ids2, w2 = softmax_topk(logits, 2, renormalize=False)
    assert torch.equal(ids2, ref_ids) and w2.dtype == torch.float32
    torch.testing.assert_close(w2, ref_w)


def test_build_executor_names():
    layers = {0: _experts()}
    for name in ("resident", "fused"):
        assert isinstance(build_executor(name, layers, "cpu"), ResidentExecutor)
    assert {"resident", "fused"} <= set(MOE_BACKENDS)  # more backends arrive with the offload work (experts/)
    with pytest.raises(ValueError, match="unknown MoE backend 'offlod'"):
        build_executor("offlod", layers, "cpu")


def test_host_planned_step_rejects_out_of_range_ids():
    from ferrylm.experts.work import LayerWork

    h, ids, w = torch.zeros(1, 4), torch.tensor([[1, 5]]), torch.ones(1, 2)
    with pytest.raises(ValueError, match="5 experts"):
        LayerWork.from_host_ids(0, h, ids, w, ids.tolist(), num_experts=5)
    with pytest.raises(ValueError, match="out of range"):
        LayerWork.from_host_ids(0, h, -ids, w, (-ids).tolist(), num_experts=8)
    assert LayerWork.from_host_ids(0, h, ids, w, ids.tolist(), num_experts=6).needed == [1, 5]
