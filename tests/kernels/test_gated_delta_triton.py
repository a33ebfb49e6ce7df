"""The Triton scan of the gated delta rule's chunk form (``models/kernels/gated_delta_triton.py``) against the torch
scan and the token recurrence: ragged lengths (not multiples of the 64-token chunk), head dims below 16 and not
powers of two (padded and masked), value blocks (Dv > 32), with and without an initial state. Interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from ferrylm.models.kernels.gated_delta import gated_delta_chunked, gated_delta_recurrent, l2_normalize, scan_chunks
from tests.kernels.interp import kernel_device, load_kernels


def _inputs(t, h, dk, dv, seed, dev):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, h, dk, generator=g)) * dk ** -0.5
    k = l2_normalize(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * 0.2
    beta = torch.rand(t, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g)
    return [x.to(dev) for x in (q, k, v, decay, beta, state)]


@pytest.mark.parametrize("t,h,dk,dv,with_state", [
    (1, 2, 16, 16, True), (37, 2, 16, 8, True), (64, 1, 16, 16, False), (70, 3, 12, 20, True),
    (130, 2, 32, 48, True), (70, 1, 128, 64, True),
])
def test_triton_scan_matches_torch(t, h, dk, dv, with_state):
    kern = load_kernels("ferrylm.models.kernels.gated_delta_triton")
    dev = kernel_device()
    q, k, v, g, beta, s0 = _inputs(t, h, dk, dv, seed=t + dk, dev=dev)
    s0 = s0 if with_state else None
    out, state = gated_delta_chunked(q, k, v, g, beta, s0, scan=kern.scan_chunks_triton)
    ref, ref_state = gated_delta_chunked(q, k, v, g, beta, s0, scan=scan_chunks)
    tol = dict(atol=2e-4, rtol=2e-4)  # GPU float32 reductions order differently; the interpreter is numpy float32
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(state, ref_state, **tol)
    if t <= 40:
        rec, rec_state = gated_delta_recurrent(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                                               None if s0 is None else s0.cpu())
        torch.testing.assert_close(out.cpu(), rec, **tol)
        torch.testing.assert_close(state.cpu(), rec_state, **tol)
