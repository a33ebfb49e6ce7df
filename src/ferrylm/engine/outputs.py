"""What the engine reports back per request per step: plain data, msgpack-friendly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

LOGPROB_FLOOR = -9999.0  # the logprob reported for tokens of probability 0 (OpenAI's value; JSON has no -inf)


@dataclass
class TokenLogprob:
    """Logprob of one generated token and, when asked, of the top alternatives at that position.

    ``top`` is a list of ``(token_id, logprob)`` pairs, best first (length = requested ``logprobs``).
    Logprobs are natural-log probabilities (float, <= 0) of the distribution after temperature/penalties.
    ``rank``: 1 + the number of tokens more likely than this one (prompt logprobs only; None elsewhere).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> "TokenLogprob | None":
        if d is None:
            return None
        return cls(d["token_id"], d["logprob"], [tuple(x) for x in d.get("top", [])], d.get("rank"))


@dataclass
class EngineOutput:
    """New tokens for one request from one engine step.

    Attributes:
        request_id: the engine request id (the frontend's id, with ``-i`` per choice when n > 1).
        new_token_ids: tokens generated this step (usually 1).
        finish_reason: None while running; ``"stop"`` (EOS / stop token) or ``"length"`` (max_tokens or context)
            when this is the request's last output; ``"abort"`` when it was aborted by the frontend.
        logprobs: one :class:`TokenLogprob` per new token when the request asked for logprobs, else None.
        error_code / error_message: set when the engine failed this request (e.g. ``insufficient_memory``,
            ``context_length_exceeded``); the output is then terminal.
        num_prompt_tokens: prompt length as the engine counted it (for usage).
        prompt_logprobs: when the request asked (``SamplingParams.prompt_logprobs``), on its first output: one
            entry per prompt token, None for the first.
        queue_time: seconds (the engine's monotonic clock) from the engine receiving the request to its first
            scheduling (first prefill chunk); set once, on the request's first output after it was scheduled
            (None on every other output and for a request never scheduled).
        num_cached_tokens: prompt tokens whose K/V came from the prefix cache (``engine/cache/prefix_cache.py``), on the
            request's first output with a token (None on every other output).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error_code: str | None = None
    error_message: str | None = None
    num_prompt_tokens: int = 0
    queue_time: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error_code is not None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineOutput":
        lps = d.get("logprobs")
        if lps is not None:
            lps = [TokenLogprob.from_dict(lp) for lp in lps]
        plps = d.get("prompt_logprobs")
        if plps is not None:
            plps = [TokenLogprob.from_dict(lp) for lp in plps]
        return cls(request_id=d["request_id"], new_token_ids=list(d["new_token_ids"]),
                   finish_reason=d.get("finish_reason"), logprobs=lps, error_code=d.get("error_code"),
                   error_message=d.get("error_message"), num_prompt_tokens=d.get("num_prompt_tokens", 0),
                   queue_time=d.get("queue_time"), prompt_logprobs=plps,
                   num_cached_tokens=d.get("num_cached_tokens"))
