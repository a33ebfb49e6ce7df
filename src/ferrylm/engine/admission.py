"""Admission: can a request ever run, and with how many completion tokens. One pure function, applied by the
server before a request reaches the engine (``server/api/app.py``) and by the engine for every request it is
given (``Engine.add_request``, the offline API included)."""

from __future__ import annotations

from ferrylm.errors import ContextLengthExceeded, InvalidRequest


def admit(prompt_tokens: int, max_tokens: int | None, *, max_model_len: int, pool_tokens: int,
          default_max: int | None = None, what: str = "prompt", prompt_param: str = "prompt",
          max_param: str = "max_tokens") -> int:
    """The request's max_tokens, or the error that says why it can never run.

    Rules: the prompt is not empty; prompt + 1 token fits the whole KV pool (``pool_tokens``, 0: unknown); prompt
    + max_tokens fits the context (``max_model_len``). ``max_tokens`` None takes the rest of the context (bounded
    by the pool, so the request can finish), at most ``default_max`` (at least 1) when that is given. ``what``
    names the prompt in messages ("messages", "prompt"); ``prompt_param`` / ``max_param`` the fields.

    Raises:
        InvalidRequest: an empty prompt.
        ContextLengthExceeded: the prompt, or prompt + max_tokens, does not fit (the wording clients detect).
    """
    p, limit, pool = prompt_tokens, max_model_len, pool_tokens
    if p == 0:
        raise InvalidRequest(f"'{prompt_param}' must not be empty (the prompt has no tokens)", param=prompt_param)
    # the context first: a prompt past it is told the context (--max-model-len), never to grow the KV pool
    if p >= limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, your {what} resulted in {p} "
            f"tokens, which leaves no room for the completion. Please reduce the length of the {what} "
            f"(the limit is the server's --max-model-len, at most the model's own context).", param=prompt_param)
    if pool and p + 1 > pool:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, your {what} resulted in {p} "
            f"tokens, and this server's KV cache pool holds only {pool} tokens (the prompt plus one generated "
            f"token must fit). Shorten the {what}, or start the server with a larger KV pool (--num-tokens / "
            f"--num-pages, or more memory: --gpu-memory-limit).", param=prompt_param)
    room = min(limit, pool) - p if pool else limit - p
    if max_tokens is None:
        return room if default_max is None else max(1, min(default_max, room))
    if p + max_tokens > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{p + max_tokens} tokens ({p} in the {what}, {max_tokens} in the completion). "
            f"Please reduce the length of the {what} or completion.", param=max_param)
    return max_tokens
