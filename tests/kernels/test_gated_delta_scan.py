"""The fused chunk scan (``models/kernels/gated_delta_scan.py``, the CUDA path of ``scan_chunks``) against the
token-by-token recurrence and the torch scan: lengths that are and are not whole chunks, head dims that are not
powers of two (masked key rows and value columns, several value blocks), with and without a starting state, and the
caller's state left alone. Interpreter on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interp import kernel_device, load_kernels
from tests.kernels.test_gated_delta import _inputs


@pytest.fixture
def fused(monkeypatch):
    """``gated_delta`` with the fused scan taken on any device (the interpreter on CPU)."""
    load_kernels("ferrylm.models.kernels.gated_delta_scan")
    import ferrylm.models.kernels.gated_delta as gd

    monkeypatch.setattr(gd, "use_triton", lambda x: True)
    return gd


@pytest.mark.parametrize("t,h,dk,dv", [(16, 2, 16, 16), (45, 3, 24, 40), (70, 2, 16, 72)])
@pytest.mark.parametrize("with_state", [False, True])
def test_fused_scan_equals_the_recurrence(fused, t, h, dk, dv, with_state):
    dev = kernel_device()
    q, k, v, g, beta, s0 = (x.to(dev) for x in _inputs(t, h, dk, dv, seed=t + dv))
    s0 = s0 if with_state else None
    before = None if s0 is None else s0.clone()
    o, s = fused.gated_delta_chunked(q, k, v, g, beta, s0, chunk=16)
    o_r, s_r = fused.gated_delta_recurrent(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                                           None if s0 is None else s0.cpu())
    assert o.shape == (t, h, dv) and s.shape == (h, dk, dv)
    torch.testing.assert_close(o.cpu(), o_r, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(s.cpu(), s_r, atol=3e-5, rtol=1e-4)
    if before is not None:
        assert torch.equal(s0, before)


def test_fused_scan_equals_the_torch_scan(fused, monkeypatch):
    """Both CUDA and CPU paths of ``scan_chunks`` on the same solved chunks (the model's chunk of 64)."""
    q, k, v, g, beta, s0 = (x.to(kernel_device()) for x in _inputs(150, 2, 32, 32, seed=7))
    fused_o, fused_s = fused.gated_delta_chunked(q, k, v, g, beta, s0)
    monkeypatch.setattr(fused, "use_triton", lambda x: False)
    loop_o, loop_s = fused.gated_delta_chunked(q, k, v, g, beta, s0)
    torch.testing.assert_close(fused_o, loop_o, atol=3e-5, rtol=1e-4)   # 3xTF32 products on a GPU
    torch.testing.assert_close(fused_s, loop_s, atol=3e-5, rtol=1e-4)
