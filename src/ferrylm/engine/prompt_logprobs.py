"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): the logprob of every prompt token after the
first, given the tokens before it, from the same forward pass that prefills the prompt (exact against our own
model, no second pass).

A prefill chunk covering prompt positions ``[start, end)`` has hidden rows whose next-token distributions
predict prompt tokens ``start + 1 .. end`` (the row of the last prompt position predicts the first generated
token: that is the ordinary sampled logprob, not a prompt one). Chunks append to ``Request.prompt_logprobs``; the
request's first output carries the whole list (``None`` first: the first token has no context). A request
recomputed after preemption has its list already and is skipped.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ferrylm.engine.outputs import LOGPROB_FLOOR, TokenLogprob


ROWS_PER_BLOCK = 128   # prompt rows whose logits exist at once: 128 x 151,936 float32 = 78 MB (and as much again)


def collect(seqs: Sequence[Any], hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Append the prompt logprobs this step's prefill chunks produce to their requests.

    Args:
        seqs: the step's scheduled sequences (``request``, ``start``, ``num_tokens``), in the order of ``hidden``.
        hidden: ``[T, H]`` hidden states of every token of the step (the plain forward; decode-graph steps have
            one row per sequence and no prompt tokens, so they never ask).
        compute_logits: the model's ``[N, H] -> [N, V]`` head.
    """
    if not any(s.request.params.prompt_logprobs is not None for s in seqs):
        return
    if hidden.shape[0] != sum(s.num_tokens for s in seqs):
        return
    q = 0
    for s in seqs:
        r = s.request
        k = r.params.prompt_logprobs
        P = r.num_prompt_tokens
        hi = min(s.start + s.num_tokens, P - 1)   # positions whose next token is still a prompt token
        if k is not None and not r.output_token_ids and s.start < hi:
            if r.prompt_logprobs is None:
                r.prompt_logprobs = []
            if len(r.prompt_logprobs) == s.start:   # not computed yet (a recompute after preemption skips)
                for a in range(s.start, hi, ROWS_PER_BLOCK):   # [rows, V] logits a block at a time
                    b = min(hi, a + ROWS_PER_BLOCK)
                    r.prompt_logprobs.extend(_entries(compute_logits(hidden[q + a - s.start:q + b - s.start]).float(),
                                                      r.prompt_token_ids[a + 1:b + 1], k))
        q += s.num_tokens


def _entries(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    lp = torch.log_softmax(logits, dim=-1).nan_to_num_(nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
    tgt = torch.tensor(targets, device=lp.device)
    tok = lp.gather(1, tgt[:, None])[:, 0]
    ranks = ((lp > tok[:, None]).sum(dim=-1) + 1).tolist()
    top_v, top_i = lp.topk(max(k, 1), dim=-1)
    top_v, top_i, tok = top_v[:, :k].tolist(), top_i[:, :k].tolist(), tok.tolist()
    return [TokenLogprob(t, tok[i], list(zip(top_i[i], top_v[i])), rank=ranks[i]) for i, t in enumerate(targets)]


def take(r: Any) -> list[TokenLogprob | None] | None:
    """The prompt logprobs to send on ``r``'s first output (``[None, ...]``, one entry per prompt token), once;
    None otherwise."""
    if r.params.prompt_logprobs is None or r.num_output_tokens != 1:
        return None
    return [None, *(r.prompt_logprobs or [])]
