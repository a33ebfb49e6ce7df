"""The gated delta rule's chunk form against its token-by-token recurrence and against transformers' torch
reference (``torch_chunk_gated_delta_rule``), for lengths that are and are not multiples of the chunk (and past one
scan segment of chunks), with and without an initial state, grouped value heads; the varlen causal convolution
against ``F.conv1d`` per sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferrylm.models.kernels.gated_delta import (causal_conv_varlen, gated_delta_chunked, gated_delta_recurrent,
                                                gated_delta_step, l2_normalize)


def _inputs(t: int, h: int, dk: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, h, dk, generator=g), torch.randn(t, h, dk, generator=g)
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * 0.3      # log decay in (-0.3, 0]
    beta = torch.rand(t, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g)
    return l2_normalize(q) * dk ** -0.5, l2_normalize(k), v, decay, beta, state


@pytest.mark.parametrize("t,chunk", [(1, 16), (15, 16), (16, 16), (17, 16), (63, 64), (65, 64), (150, 64), (300, 16)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(t, chunk, with_state):
    q, k, v, g, beta, s0 = _inputs(t, 3, 16, 8, seed=t)
    s0 = s0 if with_state else None
    o_c, s_c = gated_delta_chunked(q, k, v, g, beta, s0, chunk=chunk)
    o_r, s_r = gated_delta_recurrent(q, k, v, g, beta, s0)
    assert o_c.shape == (t, 3, 8) and s_c.shape == (3, 16, 8)
    torch.testing.assert_close(o_c, o_r, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_c, s_r, atol=2e-5, rtol=1e-4)


def test_chunk_form_leaves_its_inputs_alone_and_any_head_grouping_agrees(monkeypatch):
    """One head and a whole number of chunks make every reshape inside a view of the caller's tensors: nothing may
    be written through them. Solving one head at a time (a tiny scratch budget) gives the same result."""
    import ferrylm.models.kernels.gated_delta as gd

    q, k, v, g, beta, s0 = _inputs(32, 1, 16, 8, seed=3)
    before = [x.clone() for x in (q, k, v, g, beta, s0)]
    o, s = gated_delta_chunked(q, k, v, g, beta, s0, chunk=16)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, g, beta, s0)))
    rec, rec_s = gated_delta_recurrent(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, rec, atol=1e-5, rtol=1e-5)
    q, k, v, g, beta, s0 = _inputs(40, 4, 16, 8, seed=4)
    whole = gated_delta_chunked(q, k, v, g, beta, s0, chunk=16)
    monkeypatch.setattr(gd, "SOLVE_SCRATCH_BYTES", 1)
    per_head = gated_delta_chunked(q, k, v, g, beta, s0, chunk=16)
    torch.testing.assert_close(per_head, whole, atol=1e-6, rtol=1e-6)


def test_chunks_continue_from_the_state_they_hand_over():
    """Splitting a sequence anywhere and passing the state on gives the unsplit result (what chunked prefill over
    several engine steps relies on)."""
    q, k, v, g, beta, s0 = _inputs(100, 2, 8, 8, seed=5)
    whole, s_whole = gated_delta_chunked(q, k, v, g, beta, s0)
    a, s_a = gated_delta_chunked(q[:37], k[:37], v[:37], g[:37], beta[:37], s0, chunk=16)
    b, s_b = gated_delta_chunked(q[37:], k[37:], v[37:], g[37:], beta[37:], s_a, chunk=16)
    torch.testing.assert_close(torch.cat([a, b]), whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_b, s_whole, atol=2e-5, rtol=1e-4)


def test_step_batches_independent_sequences():
    q, k, v, g, beta, _ = _inputs(4, 2, 8, 4, seed=9)
    states = torch.randn(4, 2, 8, 4)
    o, s = gated_delta_step(q, k, v, g, beta, states)
    for i in range(4):
        o_i, s_i = gated_delta_recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], states[i])
        torch.testing.assert_close(o[i], o_i[0])
        torch.testing.assert_close(s[i], s_i)


@pytest.mark.parametrize("t", [5, 64, 97])
def test_chunked_matches_transformers_reference(t):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(t)
    hk, hv, dk, dv = 2, 4, 16, 8                          # grouped value heads: a key head serves two value heads
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g, beta = -torch.rand(t, hv, generator=gen), torch.rand(t, hv, generator=gen)
    s0 = torch.randn(hv, dk, dv, generator=gen)
    ref, ref_state = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                  initial_state=s0[None], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    qn = (l2_normalize(q) * dk ** -0.5).repeat_interleave(2, dim=1)
    kn = l2_normalize(k).repeat_interleave(2, dim=1)
    out, state = gated_delta_chunked(qn, kn, v, g, beta, s0)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state, ref_state[0], atol=1e-5, rtol=1e-4)


def test_varlen_conv_matches_conv1d_per_sequence():
    gen = torch.Generator().manual_seed(0)
    c, kernel = 6, 4
    lens = [1, 7, 2, 11]
    x = torch.randn(sum(lens), c, generator=gen)
    w = torch.randn(c, kernel, generator=gen)
    prev = torch.randn(len(lens), kernel - 1, c, generator=gen)
    prev[2] = 0   # a sequence starting now
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    y, new_prev = causal_conv_varlen(x, w, prev, qsl)
    for i, n in enumerate(lens):
        lo, hi = int(qsl[i]), int(qsl[i + 1])
        full = torch.cat([prev[i], x[lo:hi]])             # [K - 1 + n, C]
        want = F.silu(F.conv1d(full.T[None], w[:, None, :], groups=c)[0].T)
        torch.testing.assert_close(y[lo:hi], want)
        torch.testing.assert_close(new_prev[i], full[-(kernel - 1):])
