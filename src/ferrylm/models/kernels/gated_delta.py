"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule",
eq. 10) and the short causal convolution in front of it: torch implementations (the prefill path on every device;
the decode step's Triton kernel is tested against them).

Per head, with a state ``S`` of ``[Dk, Dv]`` (keys index the rows), a token ``t`` with unit-norm key ``k_t``,
query ``q_t`` (scaled by ``Dk ** -0.5``), value ``v_t``, log decay ``g_t <= 0`` and write strength ``beta_t``::

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t))^T     (the delta rule, gated)
    o_t = S_t^T q_t

Chunk form (the WY / UT-transform form of Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length", §3.2, with the decay of the gated variant folded in): in a chunk of ``C`` tokens starting
from the state ``S_0``, with ``G_t = exp(sum_{s<=t} g_s)`` the decay accumulated from the chunk start and
``u_t = beta_t (v_t - G_t S_0^T k_t - sum_{s<t} (G_t / G_s)(k_t . k_s) u_s)`` the written values:

    (I + A) U = diag(beta) V - diag(beta G) K S_0,     A[t, s] = beta_t (G_t / G_s) (k_t . k_s) for s < t, else 0
    O   = diag(G) Q S_0 + ((Q K^T) * D) U,             D[t, s] = G_t / G_s for s <= t, else 0
    S_C = G_C S_0 + (K * (G_C / G))^T U

so a chunk costs a unit lower-triangular solve and a few ``C x C`` / ``C x D`` matrix products, and only the
scan over chunks is sequential. Ratios ``G_t / G_s`` are taken as ``exp(gamma_t - gamma_s)`` of the cumulative log
decays (masked to the lower triangle before the exponential, so nothing overflows).

All functions compute in float32 and take the heads already expanded (``H`` = value heads: a key head serving
several value heads is repeated by the caller).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ferrylm.triton_util import use_triton

log = logging.getLogger("ferrylm.models")

DEFAULT_CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (the query/key normalisation of Gated DeltaNet), float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for ``B`` independent sequences (decode). Fixed shapes, no host reads: safe to
    capture in a CUDA graph.

    Args:
        q, k: ``[B, H, Dk]`` float32 (``k`` unit-norm, ``q`` unit-norm times ``Dk ** -0.5``).
        v: ``[B, H, Dv]`` float32. g: ``[B, H]`` log decay (<= 0). beta: ``[B, H]`` in (0, 1).
        state: ``[B, H, Dk, Dv]`` float32, the state before the token (not modified).

    Returns:
        ``(o [B, H, Dv], new state [B, H, Dk, Dv])`` float32.
    """
    s = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    delta = (v - predicted) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token for one sequence: the test reference of :func:`gated_delta_chunked` (a Python
    loop over tokens: not a serving path).

    Args:
        q, k: ``[T, H, Dk]``; v: ``[T, H, Dv]``; g, beta: ``[T, H]`` (as :func:`gated_delta_step`).
        state: ``[H, Dk, Dv]`` initial state, or None for zeros.

    Returns:
        ``(o [T, H, Dv], final state [H, Dk, Dv])`` float32.
    """
    t, h, dk = k.shape
    s = torch.zeros(h, dk, v.shape[-1], dtype=torch.float32, device=v.device) if state is None else state.float()
    out = []
    for i in range(t):
        o, s = gated_delta_step(q[i:i + 1].float(), k[i:i + 1].float(), v[i:i + 1].float(), g[i:i + 1].float(),
                                beta[i:i + 1].float(), s[None])
        s = s[0]
        out.append(o[0])
    return (torch.stack(out) if out else v.new_zeros((0, h, v.shape[-1]), dtype=torch.float32)), s


def chunk_major(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[T, H, ...]`` -> ``[n, H, C, ...]`` float32 (a new tensor), ``n = ceil(T / C)``, the last chunk zero-padded."""
    t = x.shape[0]
    n = -(-t // chunk)
    x = x.float()
    x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, n * chunk - t))
    x = x.reshape(n, chunk, *x.shape[1:])
    return x.transpose(1, 2).clone(memory_format=torch.contiguous_format)


def _decay_ratios(gamma: torch.Tensor, strict: bool) -> torch.Tensor:
    """``exp(gamma_t - gamma_s)`` on the lower triangle of each chunk (``s < t`` when ``strict``, else ``s <= t``),
    zero above: ``gamma [..., C]`` -> ``[..., C, C]``."""
    c = gamma.shape[-1]
    keep = torch.ones(c, c, dtype=torch.bool, device=gamma.device).tril(-1 if strict else 0)
    return torch.where(keep, gamma[..., :, None] - gamma[..., None, :], float("-inf")).exp_()


def chunk_solve(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int = DEFAULT_CHUNK
                ) -> torch.Tensor:
    """The chunk-local solve of the chunk form (module docstring): ``W = (I + A)^-1 [diag(beta) V | diag(beta G) K]``
    for every chunk at once, so that ``U = W_v - W_k S_0``.

    Args:
        k: ``[T, H, Dk]``; v: ``[T, H, Dv]``; g, beta: ``[T, H]``. chunk: tokens per chunk ``C``.

    Returns:
        ``[n, H, C, Dv + Dk]`` float32, ``n = ceil(T / C)`` (rows past ``T`` are zero: a padded token has
        ``beta = 0``).

    Memory: ``~4 * H * n * C * (3 * (Dk + Dv) + 5 * C)`` bytes of scratch.
    """
    kb, bb = chunk_major(k, chunk), chunk_major(beta, chunk)
    gamma = chunk_major(g, chunk).cumsum(-1)              # log G_t within each chunk
    a = (kb @ kb.transpose(-1, -2)).mul_(_decay_ratios(gamma, strict=True)).mul_(bb[..., :, None])   # A
    a.diagonal(dim1=-2, dim2=-1).fill_(1.0)               # I + A
    rhs = torch.cat([chunk_major(v, chunk) * bb[..., None], kb * (bb * gamma.exp())[..., None]], dim=-1)
    return torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)


SCAN_SEGMENT = 16   # chunks whose start states are kept at once (their outputs are taken together)


def scan_chunks(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, w: torch.Tensor, state: torch.Tensor,
                chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk form after the solve. Only the state recurrence is sequential: chunk by chunk ``U = W_v - W_k S``
    and ``S <- G_C S + (K * (G_C / G))^T U``, with the outputs ``O = diag(G) Q S + ((Q K^T) * D) U``. On CUDA the
    whole scan is one Triton kernel (``gated_delta_scan.py``); elsewhere three batched kernels a chunk (every head at
    once) and the outputs as two batched products per :data:`SCAN_SEGMENT` chunks, from the states at their starts.

    Args:
        q, k: ``[T, H, Dk]``; g: ``[T, H]``; w: :func:`chunk_solve`'s ``[n, H, C, Dv + Dk]``, overwritten (its
        value columns become ``U`` off CUDA); state: ``[H, Dk, Dv]`` float32 (not modified).

    Returns:
        ``(o [T, H, Dv], final state [H, Dk, Dv])`` float32.

    Memory: ``~4 * H * n * C * (2 * Dk + 2 * Dv + 2 * C)`` bytes of operands and outputs, plus
    ``4 * H * (SCAN_SEGMENT + 1) * Dk * Dv`` for the states.
    """
    t, h, dk = k.shape
    n, dv = w.shape[0], w.shape[-1] - dk
    qb, kb = chunk_major(q, chunk), chunk_major(k, chunk)                  # [n, H, C, Dk], new tensors
    gamma = chunk_major(g, chunk).cumsum(-1)                                # [n, H, C]
    g_end = gamma[..., -1:]
    attn = (qb @ kb.transpose(-1, -2)).mul_(_decay_ratios(gamma, strict=False))  # [n, H, C, C]
    k_to_end = kb.mul_((g_end - gamma).exp()[..., None])                    # [n, H, C, Dk]
    q_decayed = qb.mul_(gamma.exp()[..., None])                             # [n, H, C, Dk]
    end_decay = g_end.exp()                                                 # [n, H, 1]
    if use_triton(w):   # the whole scan as one kernel (models/kernels/gated_delta_scan.py)
        from ferrylm.models.kernels.gated_delta_scan import scan_chunks_fused

        o, final = scan_chunks_fused(w, k_to_end, q_decayed, attn, end_decay[..., 0].contiguous(), state)
        return o.transpose(1, 2).reshape(n * chunk, h, dv)[:t], final
    attn, q_decayed = attn.flatten(0, 1), q_decayed.flatten(0, 1)
    k_to_end, end_decay = k_to_end.transpose(-1, -2), end_decay[..., None]
    w_v, w_k = w[..., :dv], w[..., dv:]
    o = torch.empty(n, h, chunk, dv, dtype=torch.float32, device=w.device)
    states = torch.empty(min(n, SCAN_SEGMENT) + 1, h, dk, dv, dtype=torch.float32, device=w.device)
    states[0] = state
    # the per-chunk views made once (one call each) instead of indexed in the loop: the loop is launch-bound
    s_at, u_at, wk_at = states.unbind(0), w_v.unbind(0), w_k.unbind(0)
    kt_at, decay_at = k_to_end.unbind(0), end_decay.unbind(0)
    for c0 in range(0, n, SCAN_SEGMENT):
        m = min(n - c0, SCAN_SEGMENT)
        for i in range(m):
            u = u_at[c0 + i].baddbmm_(wk_at[c0 + i], s_at[i], alpha=-1.0)
            torch.mul(s_at[i], decay_at[c0 + i], out=s_at[i + 1])
            s_at[i + 1].baddbmm_(kt_at[c0 + i], u)
        rows = slice(c0 * h, (c0 + m) * h)
        seg = o[c0:c0 + m].flatten(0, 1)
        torch.bmm(q_decayed[rows], states[:m].flatten(0, 1), out=seg)
        seg.baddbmm_(attn[rows], w_v[c0:c0 + m].flatten(0, 1))
        states[0] = states[m]
    return o.transpose(1, 2).reshape(n * chunk, h, dv)[:t], states[0].clone()


SOLVE_SCRATCH_BYTES = 256 << 20   # the chunk solve runs on groups of heads whose scratch fits this


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor | None = None, chunk: int = DEFAULT_CHUNK
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk form (module docstring) for one sequence of any length: :func:`chunk_solve` on groups of heads
    (the last chunk zero-padded: a padded token has ``beta = 0`` and ``g = 0``, so it writes nothing and decays
    nothing), then :func:`scan_chunks` over the chunks.

    Args:
        q, k: ``[T, H, Dk]``; v: ``[T, H, Dv]``; g, beta: ``[T, H]``; state: ``[H, Dk, Dv]`` or None (zeros).
        chunk: tokens per chunk ``C``.

    Returns:
        ``(o [T, H, Dv], final state [H, Dk, Dv])`` float32.

    Memory: ``4 * H * n * C * (Dk + Dv)`` bytes for the solved chunks, at most :data:`SOLVE_SCRATCH_BYTES` for the
    solve, then :func:`scan_chunks`'s.
    """
    t, h, dk = k.shape
    dv = v.shape[-1]
    s = torch.zeros(h, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.float()
    if t == 0:
        return v.new_zeros((0, h, dv), dtype=torch.float32), s
    n = -(-t // chunk)
    w = torch.empty(n, h, chunk, dv + dk, dtype=torch.float32, device=v.device)
    per_head = 4 * n * chunk * (3 * (dk + dv) + 5 * chunk)
    group = max(1, SOLVE_SCRATCH_BYTES // per_head)
    for lo in range(0, h, group):
        hi = min(h, lo + group)
        w[:, lo:hi] = chunk_solve(k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], chunk)
    return scan_chunks(q, k, g, w, s, chunk)


# --- the short causal convolution ------------------------------------------------------------------------------


def conv_window_index(query_start_loc: torch.Tensor, num_tokens: int, kernel: int,
                      one_token_each: bool = False) -> torch.Tensor:
    """Rows of ``cat([prev.reshape(B * (K-1), C), x])`` (:func:`causal_conv_varlen`) that token ``t``'s window
    reads, oldest first: ``[T, K]`` int64. Device ops only (no host read: ``num_tokens`` is the host's ``T``).

    Args:
        query_start_loc: ``[B + 1]`` offsets of each sequence's tokens in the flattened batch (any int dtype).
        num_tokens: ``T``. kernel: ``K``.
        one_token_each: every sequence has one token (a decode step, ``T == B``): the index is built from
            ``arange`` alone (what a captured decode graph runs).
    """
    qsl = query_start_loc.long()
    b = qsl.shape[0] - 1
    dev = qsl.device
    if one_token_each:
        seq = torch.arange(b, device=dev)
        start = seq
    else:
        lens = qsl[1:] - qsl[:-1]
        seq = torch.repeat_interleave(torch.arange(b, device=dev), lens, output_size=num_tokens)   # [T]
        start = qsl[:-1][seq]
    local = torch.arange(num_tokens, device=dev) - start                                     # position in its chunk
    pos = local[:, None] + torch.arange(kernel, device=dev)[None, :] - (kernel - 1)           # [T, K]
    from_tokens = b * (kernel - 1) + start[:, None] + pos
    from_state = seq[:, None] * (kernel - 1) + (kernel - 1) + pos
    return torch.where(pos >= 0, from_tokens, from_state)


def causal_conv_varlen(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor, query_start_loc: torch.Tensor,
                       index: torch.Tensor | None = None, dilation: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU over a flattened batch of sequences, each continuing from its own last
    ``W - 1`` inputs (Gated DeltaNet's short convolution, as Mamba's ``causal_conv1d``; with ``dilation`` the taps
    are ``dilation`` inputs apart, PLE's convolution).

    Args:
        x: ``[T, C]`` the step's inputs (sequence ``i``'s tokens are rows ``qsl[i] .. qsl[i+1]-1``).
        weight: ``[C, K]`` filter taps, tap ``K - 1`` on the current input.
        prev: ``[B, W - 1, C]`` each sequence's previous inputs, oldest first (zeros for a sequence starting now);
            the window ``W = (K - 1) * dilation + 1``.
        query_start_loc: ``[B + 1]`` (every sequence has at least one token).
        index: :func:`conv_window_index` of the batch for ``W`` when already computed (shared by the layers of a
            step).

    Returns:
        ``(y [T, C] in x's dtype, new prev [B, W - 1, C])``: ``y_t = silu(sum_j w[:, j] * x_{t - (K - 1 - j) d})``
        in float32, and each sequence's last ``W - 1`` inputs after the step (state rows where it has fewer tokens).
    """
    t, c = x.shape
    b, km1, _ = prev.shape
    if index is None:
        index = conv_window_index(query_start_loc, t, km1 + 1)
    ext = torch.cat([prev.reshape(b * km1, c).to(x.dtype), x])
    w = weight.float()
    acc = ext[index[:, 0]].float() * w[:, 0]
    for j in range(1, weight.shape[1]):   # K taps (4): one gather + multiply-add each, no [T, K, C] temporary
        acc = acc + ext[index[:, j * dilation]].float() * w[:, j]
    last = index[query_start_loc[1:].long() - 1]         # [B, K]: the window of each sequence's last token
    new_prev = ext[last[:, 1:]]                           # its newest K - 1 inputs
    return F.silu(acc).to(x.dtype), new_prev
