"""The routing model's one-kernel scores (``synthetic/routing_kernel.py``, the CUDA path) against its torch form:
the hashed terms bit for bit (a profile whose known score has no ``ndtri``), every profile's scores within float32
rounding and the same routed and predicted experts, per layer and for all layers at once. Interpreter on CPU,
compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from ferrylm.synthetic.routing_profiles import PROFILES, HotComponent, RoutingProfile
from tests.kernels.interp import kernel_device, load_kernels


@pytest.fixture
def models(monkeypatch):
    """``make(profile) -> (kernel model, torch model)`` on the kernel device."""
    load_kernels("ferrylm.synthetic.routing_kernel")
    import ferrylm.synthetic.routing_model as rm

    def make(prof, e, k, layers=range(4)):
        dev = kernel_device()
        fused = rm.RoutingModel(prof, e, k, seed=5, layers=layers, device=dev)
        ref = rm.RoutingModel(prof, e, k, seed=5, layers=layers, device=dev)
        monkeypatch.setattr(fused, "_fused", lambda positions, layer=None: layer is None or layer in fused._slot)
        monkeypatch.setattr(ref, "_fused", lambda positions, layer=None: False)   # the torch form on a GPU too
        return fused, ref

    return make


def _tokens(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g)   # negative keys: signed hashes, Python's modulo
    return keys, torch.randint(0, 40000, (n,), generator=g)


def test_hashed_terms_are_bit_identical(models):
    prof = RoutingProfile("hash-only", zipf=0.8, hot=(HotComponent(6, 0.3, 2.0), HotComponent(37, 0.5, 1.5)), phi=1.0)
    fused, ref = models(prof, 96, 4)
    dev = kernel_device()
    keys, pos = (x.to(dev) for x in _tokens(33, 1))
    for layer in (0, 3):
        got = fused._kernel_scores(slice(layer, layer + 1), keys, pos, False)[0][0]
        assert torch.equal(got.cpu(), ref._known(layer, keys, pos).cpu())


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_scores_and_choices_match_the_torch_form(models, name):
    prof = PROFILES[name]
    e, k = prof.shape
    fused, ref = models(prof, e, k)
    dev = kernel_device()
    keys, pos = (x.to(dev) for x in _tokens(24, 2))
    for layer in (0, 2):
        torch.testing.assert_close(fused.scores(layer, keys, pos), ref.scores(layer, keys, pos), atol=2e-5, rtol=1e-5)
        assert torch.equal(fused.route(layer, keys, pos), ref.route(layer, keys, pos))
        assert torch.equal(fused.predict(layer, keys, pos), ref.predict(layer, keys, pos))
    ids, pred = fused.route_all(keys, pos)
    ref_ids, ref_pred = ref.route_all(keys, pos)
    assert torch.equal(ids, ref_ids) and torch.equal(pred, ref_pred)
