"""Prompt log-probabilities on /v1/completions: ``echo`` with ``logprobs`` (the legacy shape, prompt tokens first,
``null`` for the first one: how lm-evaluation-harness scores log-likelihoods, with ``max_tokens: 0``) and vLLM's
``prompt_logprobs`` field. The numbers come from the engine's prefill (``engine/prompt_logprobs.py``).

This module must not import torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from ferrylm.engine.outputs import TokenLogprob
from ferrylm.server.api.chat_protocol import CompletionLogprobs
from ferrylm.server.api.protocol import _finite


def prompt_offsets(codec: Any, prompt_ids: Sequence[int]) -> list[int]:
    """Character offset of each prompt token's text in the decoded prompt (incremental, never half a
    character; O(tokens))."""
    detok = codec.detokenizer((), skip_special_tokens=False)
    out = []
    for t in prompt_ids:
        out.append(len(detok.text))
        detok.step((t,))
    return out


def echo_logprobs(codec: Any, prompt_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                  num_top: int) -> CompletionLogprobs:
    """The legacy logprobs of the echoed prompt: ``token_logprobs[0]`` and ``top_logprobs[0]`` are null (the
    first token has no context); later tokens carry their logprob and ``num_top`` alternatives (plus the token
    itself)."""
    lp = CompletionLogprobs()
    offsets = prompt_offsets(codec, prompt_ids)
    for i, t in enumerate(prompt_ids):
        e = entries[i] if i < len(entries) else None
        tok = codec.token_text(t)
        lp.tokens.append(tok)
        lp.text_offset.append(offsets[i])
        if e is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        lp.token_logprobs.append(_finite(e.logprob))
        top = {codec.token_text(a): _finite(v) for a, v in e.top[:num_top]}
        top.setdefault(tok, _finite(e.logprob))
        lp.top_logprobs.append(top)
    return lp


def join_logprobs(a: CompletionLogprobs, b: CompletionLogprobs | None) -> CompletionLogprobs:
    """``a`` followed by ``b`` (echoed prompt, then the completion)."""
    if b is None:
        return a
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def vllm_prompt_logprobs(codec: Any, prompt_ids: Sequence[int],
                         entries: Sequence[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {"logprob", "rank",
    "decoded_token"}}`` with the token itself and its top alternatives (ranks of alternatives: their place)."""
    out: list[dict | None] = []
    for i, t in enumerate(prompt_ids):
        e = entries[i] if i < len(entries) else None
        if e is None:
            out.append(None)
            continue
        d = {str(a): {"logprob": _finite(v), "rank": r + 1, "decoded_token": codec.token_text(a)}
             for r, (a, v) in enumerate(e.top)}
        d[str(t)] = {"logprob": _finite(e.logprob), "rank": e.rank, "decoded_token": codec.token_text(t)}
        out.append(d)
    return out
