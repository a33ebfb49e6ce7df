"""The routing model's scores as one Triton kernel (CUDA; Triton's CPU interpreter in tests): what
:meth:`ferrylm.synthetic.routing_model.RoutingModel._known_score` and its fresh field compute in a few hundred small
torch kernels over ``[T, E]`` (the splitmix64 hashes, the uniforms, ``ndtri``), in one pass per step.

The integer hashes give the torch path's bits exactly (wrapping 64-bit products, logical shifts, Python's modulo
of a signed hash); the float32 terms are added in the torch path's order with no fused multiply-add
(``enable_fp_fusion=False``); ``ndtri`` is Cephes' rational approximation as torch's ``calc_ndtri`` (the branch for
``y < exp(-32)`` is never taken: a uniform from 24 bits is at least ``2^-25``), within a few float32 ulps of torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOW: tl.constexpr = tl.constexpr(0.1353352814912796)   # float32(exp(-2)): the central branch's bound
_HIGH: tl.constexpr = tl.constexpr(0.8646647334098816)  # float32(1) - float32(exp(-2))


@triton.jit
def _mix(x):
    """splitmix64's finaliser on uint64."""
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _fold(h, v):
    """One step of ``hash_fold``: ``mix(h ^ (v * GOLD))`` (``v`` any integer, reinterpreted as uint64)."""
    v = tl.zeros([], tl.int64) + v
    return _mix(h ^ (v.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15))


@triton.jit
def _uniform(h):
    """uint64 hash -> float32 uniform in (0, 1) from its top 24 bits."""
    return ((h >> 40).to(tl.float32) + 0.5) * 5.9604644775390625e-08


@triton.jit
def _polevl(x, c0, c1, c2, c3, c4, c5, c6, c7, c8, N: tl.constexpr):
    a = x * 0.0 + c0
    a = a * x + c1
    a = a * x + c2
    a = a * x + c3
    a = a * x + c4
    if N > 4:
        a = a * x + c5
        a = a * x + c6
        a = a * x + c7
    if N > 7:
        a = a * x + c8
    return a


@triton.jit
def _ndtri(y0):
    """Inverse of the standard normal CDF, float32, for ``y0`` in ``[2^-25, 1 - 2^-25]``."""
    flip = y0 > _HIGH
    y = tl.where(flip, 1.0 - y0, y0)
    # central: |y - 0.5| <= 0.5 - exp(-2)
    yc = y - 0.5
    y2 = yc * yc
    p0 = _polevl(y2, -5.99633501014107895267E1, 9.80010754185999661536E1, -5.66762857469070293439E1,
                 1.39312609387279679503E1, -1.23916583867381258016E0, 0.0, 0.0, 0.0, 0.0, 4)
    q0 = _polevl(y2, 1.0, 1.95448858338141759834E0, 4.67627912898881538453E0, 8.63602421390890590575E1,
                 -2.25462687854119370527E2, 2.00260212380060660359E2, -8.20372256168333339912E1,
                 1.59056225126211695515E1, -1.18331621121330003142E0, 8)
    central = (yc + yc * tl.div_rn(y2 * p0, q0)) * 2.50662827463100050242E0
    # tail: z = sqrt(-2 log y) in [2, 8)
    yt = tl.where(y > _LOW, 0.1, y)
    x = tl.sqrt_rn(-2.0 * tl.log(yt))
    x0 = x - tl.div_rn(tl.log(x), x)
    z = tl.div_rn(1.0, x)
    p1 = _polevl(z, 4.05544892305962419923E0, 3.15251094599893866154E1, 5.71628192246421288162E1,
                 4.40805073893200834700E1, 1.46849561928858024014E1, 2.18663306850790267539E0,
                 -1.40256079171354495875E-1, -3.50424626827848203418E-2, -8.57456785154685413611E-4, 8)
    q1 = _polevl(z, 1.0, 1.57799883256466749731E1, 4.53907635128879210584E1, 4.13172038254672030440E1,
                 1.50425385692907503408E1, 2.50464946208309415979E0, -1.42182922854787788574E-1,
                 -3.80806407691578277194E-2, -9.33259480895457427372E-4, 8)
    tail = x0 - tl.div_rn(z * p1, q1)
    tail = tl.where(flip, tail, -tail)
    return tl.where(y > _LOW, central, tail)


@triton.jit
def _field(hk, m, pos, labels):
    """``F_m``: ``ndtri`` of the hash of ``(seed, key, 0x1F1E1D + m, position, label)``; ``hk`` the hash of
    ``(seed, key)`` ``[BT]``, labels ``[BE]``."""
    h = _fold(_fold(hk, 0x1F1E1D + m), pos)
    return _ndtri(_uniform(_fold(h[:, None], labels[None, :])))


@triton.jit
def _scores_kernel(layer_ptr, log_pop_ptr, label_ptr, key_ptr, pos_ptr, period_ptr, prob_ptr, bonus_ptr, cont_ptr,
                   known_ptr, score_ptr, T, E, seed_hash, zipf, w_field, w_fresh, J: tl.constexpr,
                   DEPTH: tl.constexpr, SCORE: tl.constexpr, BT: tl.constexpr,
                   BE: tl.constexpr):
    i = tl.program_id(0)
    rt = tl.program_id(1) * BT + tl.arange(0, BT)
    re = tl.program_id(2) * BE + tl.arange(0, BE)
    mt, me = rt < T, re < E
    layer = tl.load(layer_ptr + i)
    keys = tl.load(key_ptr + rt, mask=mt, other=0)
    pos = tl.load(pos_ptr + rt, mask=mt, other=0)
    labels = tl.load(label_ptr + i * E + re, mask=me, other=0)
    experts = re.to(tl.int64)
    hk = _fold(seed_hash.to(tl.uint64, bitcast=True), keys)
    hkl = _fold(hk, layer)
    score = tl.broadcast_to(zipf * tl.load(log_pop_ptr + i * E + re, mask=me, other=0.0)[None, :], [BT, BE])
    for j in tl.static_range(J):
        period = tl.load(period_ptr + j).to(tl.uint64)
        h = _fold(_fold(hkl, 0x407 + j)[:, None], experts[None, :])
        hs = h.to(tl.int64, bitcast=True)
        # Python's modulo of the signed hash
        phase = tl.where(hs >= 0, h % period, period - 1 - ((h ^ 0xFFFFFFFFFFFFFFFF) % period))
        epoch = (pos.to(tl.uint64)[:, None] + phase) // period
        u = _uniform(_fold(_fold(_fold(hkl, 0x4070 + j)[:, None], experts[None, :]), epoch))
        cold_hot = (u < tl.load(prob_ptr + j)).to(tl.float32)
        hot = tl.where(tl.load(cont_ptr + j) != 0, _ndtri(u), cold_hot)
        score = score + tl.load(bonus_ptr + j) * hot
    for d in tl.static_range(1, DEPTH + 1):   # the earlier layers' fields (none when DEPTH = 0)
        score = score + w_field * _field(hk, layer - d, pos, labels)
    out = (i * T + rt).to(tl.int64)[:, None] * E + re[None, :]
    m = mt[:, None] & me[None, :]
    tl.store(known_ptr + out, score, mask=m)
    if SCORE:
        tl.store(score_ptr + out, score + w_fresh * _field(hk, layer, pos, labels), mask=m)


def routing_scores(layers: torch.Tensor, log_pop: torch.Tensor, labels: torch.Tensor, keys: torch.Tensor,
                   positions: torch.Tensor, hot: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   seed_hash: int, zipf: float, w_field: float, depth: int, w_fresh: float, with_score: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Known scores (and with ``with_score`` the full scores) of ``Ls`` layers for ``T`` tokens.

    Args:
        layers: ``[Ls]`` int64 layer indices. log_pop: ``[Ls, E]`` float32; labels: ``[Ls, E]`` int64 (each
            layer's tables). keys, positions: ``[T]`` int64.
        hot: the profile's hot components as ``(period int64, prob float32, bonus float32, continuous int32)``,
            each ``[J]`` (``J`` may be 0).
        seed_hash: ``hash_fold``'s value after the model seed (a signed 64-bit int). zipf, w_field, w_fresh: the
            profile's weights (``w_field`` = 0 and ``depth`` = 0 without earlier layers' fields).

    Returns:
        ``(known [Ls, T, E], score [Ls, T, E] or None)`` float32. No host sync: capturable.
    """
    ls, e = log_pop.shape
    t = keys.shape[0]
    known = torch.empty(ls, t, e, dtype=torch.float32, device=keys.device)
    score = torch.empty_like(known) if with_score else known
    if t == 0:
        return known, (score if with_score else None)
    period, prob, bonus, cont = hot
    num_hot = period.shape[0]
    if num_hot == 0:   # never read then, but an empty tensor's null pointer is no valid kernel argument
        period = prob = bonus = cont = log_pop
    bt, be = 8, min(64, triton.next_power_of_2(e))   # no spills at 4 warps (ptxas, sm_90a: 180 registers)
    _scores_kernel[(ls, triton.cdiv(t, bt), triton.cdiv(e, be))](
        layers, log_pop, labels, keys, positions, period, prob, bonus, cont, known, score, t, e, seed_hash, zipf,
        w_field, w_fresh, J=num_hot, DEPTH=depth, SCORE=with_score, BT=bt, BE=be, num_warps=4, enable_fp_fusion=False)
    return known, (score if with_score else None)
