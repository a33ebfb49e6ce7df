"""Sampler: per-request parameters inside one batch."""

from __future__ import annotations

import math

import torch

from ferrylm.engine.request import Request
from ferrylm.engine.sampler import _draw, sample
from ferrylm.engine.sampling_params import SamplingParams


def req(prompt=(5,), out=(), seed=None, **kw) -> Request:
    r = Request("r", list(prompt), SamplingParams(**kw), output_token_ids=list(out))
    if seed is not None:
        r.generator = torch.Generator().manual_seed(seed)
    return r


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def batch(*rows):
    return LOGITS.repeat(len(rows), 1).clone(), list(rows)


def test_greedy_and_top_k_1_take_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    res = sample(logits.clone(), [req(temperature=0.0), req(temperature=1.0, top_k=1)])
    assert res.token_ids == [1, 0]


def test_seeded_row_is_independent_of_batch_mates():
    alone = [sample(*batch(req(seed=7, temperature=1.0))).token_ids[0]]
    r = req(seed=7, temperature=1.0)
    mixed = sample(*batch(req(temperature=1.0), r, req(temperature=0.0))).token_ids[1]
    assert [mixed] == alone
    draws = [sample(*batch(req(seed=s, temperature=1.0))).token_ids[0] for s in range(40)]
    assert len(set(draws)) > 1  # different seeds do sample different tokens


def test_top_p_and_min_p_restrict_support():
    seen_p, seen_min = set(), set()
    for i in range(300):
        r1 = req(temperature=1.0, top_p=0.7)
        r1.generator = torch.Generator().manual_seed(i)
        r2 = req(temperature=1.0, min_p=0.35)  # keeps p >= 0.35 * 0.5 = 0.175: tokens 0, 1
        r2.generator = torch.Generator().manual_seed(10_000 + i)
        t = sample(*batch(r1, r2)).token_ids
        seen_p.add(t[0])
        seen_min.add(t[1])
    assert seen_p == {0, 1}      # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 are cut
    assert seen_min == {0, 1}


def test_temperature_flattens_distribution():
    counts = [0, 0, 0, 0]
    for i in range(400):
        r = req(temperature=5.0, seed=i)
        counts[sample(*batch(r)).token_ids[0]] += 1
    assert counts[3] > 40  # p(3) is 0.05 at T=1, ~0.19 at T=5


def test_penalties():
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]])
    # repetition penalty over the prompt: token 0 (positive logit) is divided by 2 → token 1 wins
    assert sample(logits.clone(), [req(prompt=(0,), temperature=0.0, repetition_penalty=2.0)]).token_ids == [1]
    # frequency penalty over generated tokens: 2 occurrences x 0.1 = 0.2 → token 1 wins
    assert sample(logits.clone(), [req(out=(0, 0), temperature=0.0, frequency_penalty=0.1)]).token_ids == [1]
    # presence penalty is per distinct token
    assert sample(logits.clone(), [req(out=(0, 0), temperature=0.0, presence_penalty=0.05)]).token_ids == [0]
    assert sample(logits.clone(), [req(out=(0,), temperature=0.0, presence_penalty=0.2)]).token_ids == [1]


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    r = req(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert sample(logits.clone(), [r], eos_ids=(0,)).token_ids == [2]
    r = req(out=(3, 3), temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert sample(logits.clone(), [r], eos_ids=(0,)).token_ids == [0]


def test_logprobs_match_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    res = sample(logits.clone(), [req(temperature=0.0, logprobs=2)])
    lp = res.logprobs[0]
    ref = torch.log_softmax(logits, -1)[0]
    assert lp.token_id == 2 and math.isclose(lp.logprob, ref[2].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [2, 1]
    assert math.isclose(lp.top[1][1], ref[1].item(), rel_tol=1e-6)
    assert sample(logits.clone(), [req(temperature=0.0)]).logprobs == [None]


def test_extreme_parameters_never_fail_the_batch():
    """Found by the fuzzer: one request's temperature 1e308 / top_p 1e-308 made the probabilities NaN and
    torch.multinomial raised, which killed the engine with every request in flight. Such a row now takes its
    argmax; its batch mates are unaffected; reported logprobs stay finite numbers."""
    mate = req(seed=7, temperature=1.0)
    alone = sample(*batch(req(seed=7, temperature=1.0))).token_ids[0]
    rows = [req(temperature=1e308, top_p=1e-308), req(temperature=1e-40, seed=1, logprobs=2),
            req(prompt=(1,), out=(0, 1), repetition_penalty=1e-30, logprobs=1), req(top_p=1e-45, seed=2),
            req(min_tokens=3, stop_token_ids=[0, 1, 2, 3], logprobs=3), mate]
    res = sample(*batch(*rows), eos_ids=(0,))
    assert res.token_ids[-1] == alone
    assert res.token_ids[1] == 0 and res.token_ids[3] == 0   # the limit of temperature -> 0 / top_p -> 0: argmax
    for lp in res.logprobs:
        if lp is not None:
            assert math.isfinite(lp.logprob) and all(math.isfinite(v) for _, v in lp.top)


def test_logit_bias_is_added_before_sampling():
    """OpenAI logit_bias: +100 makes a token certain, -100 removes it, for greedy and sampled rows; ids past the
    vocabulary are skipped (the frontend rejects them)."""
    logits, _ = batch(None, None)
    res = sample(logits.clone(), [req(temperature=0.0, logit_bias=[[3, 100.0]]),
                                  req(temperature=1.0, logit_bias=[[0, -100.0], [1, -100.0], [2, -100.0], [99, 5.0]],
                                      seed=1)])
    assert res.token_ids == [3, 3]
    res = sample(logits[:1].clone(), [req(temperature=0.0, logit_bias=[[0, -1.0]], logprobs=1)])
    expected = torch.log_softmax(LOGITS - torch.tensor([1.0, 0, 0, 0]), -1)
    assert res.token_ids == [1] and math.isclose(res.logprobs[0].logprob, float(expected[1]), abs_tol=1e-6)



def test_greedy_ids_take_the_first_largest_logit_like_torch():
    """The CPU's greedy pick (numpy's argmax) is torch.argmax's: the first of equal maxima, NaN as the largest."""
    from ferrylm.engine.sampler import greedy_ids

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 151_936, generator=g)
    logits[1, [7, 99, 150_000]] = 50.0                    # ties: the first
    logits[2, 1234] = float("nan")                        # NaN wins
    logits[3] = float("-inf")                             # all banned: index 0
    logits[4, -1] = float("inf")
    got = greedy_ids(logits)
    assert got.dtype == torch.int64 and got.tolist() == torch.argmax(logits, dim=-1).tolist()
    assert got.tolist()[1:] == [7, 1234, 0, 151_935]


def test_draws_follow_the_distribution_and_skip_zero_mass():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    n = 20000
    ids, ok = _draw(probs.repeat(n, 1), [req() for _ in range(n)])
    counts = torch.bincount(ids, minlength=5).double() / n
    assert bool(ok.all())
    assert counts[1] == 0 and counts[4] == 0
    sigma = (probs * (1 - probs) / n).sqrt()
    assert bool(((counts - probs).abs() <= 4 * sigma + 1e-12).all()), counts


def test_a_row_without_mass_is_flagged():
    probs = torch.tensor([[0.0, 0.0], [float("nan"), 1.0], [0.4, 0.6]])
    _, ok = _draw(probs, [req(), req(), req()])
    assert ok.tolist() == [False, False, True]
