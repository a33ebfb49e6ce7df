"""Per-request sampling parameters, shared by the frontend, the engine and the offline API.

Only plain Python values live here so that the dataclass crosses the IPC boundary as a msgpack map
(``dataclasses.asdict`` → msgpack → ``SamplingParams(**d)``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from ferrylm.errors import InvalidRequest


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop.

    Semantics follow vLLM's ``SamplingParams``:

    - ``temperature`` 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_k`` <= 0 disables top-k; ``top_p`` 1.0 disables nucleus sampling; ``min_p`` 0 disables min-p.
    - ``seed`` gives the request its own ``torch.Generator`` so its samples do not depend on batch mates.
    - ``max_tokens`` None means "up to the model context" (the engine fills it in at admission).
    - ``stop`` strings are matched by the frontend detokenizer (text level); ``stop_token_ids`` and EOS by the
      engine (token level). ``ignore_eos`` disables EOS; ``min_tokens`` suppresses EOS/stop ids before that many.
    - penalties: ``presence_penalty`` / ``frequency_penalty`` (OpenAI, over generated tokens) and
      ``repetition_penalty`` (CTRL, Keskar et al. 2019, over prompt + generated tokens; 1.0 = off).
    - ``logprobs``: None = off, k >= 0 = return the sampled token's logprob and the top-k alternatives.
    - ``logit_bias``: ``[[token id, bias], ...]`` added to the logits before everything else (OpenAI's
      ``logit_bias``; bias in [-100, 100]); ids outside the vocabulary are rejected by the frontend.
    - ``grammar``: an llguidance grammar (JSON text, built by ``ferrylm.server.text.structured``) the output must
      match; tokens it forbids are masked before sampling (``engine/structured.py``). None: unconstrained.
    - ``prompt_logprobs``: None = off, k >= 0 = the logprob of every prompt token after the first, given the
      tokens before it, with the top-k alternatives (vLLM's ``prompt_logprobs``; reported on the first output).

    Raises:
        InvalidRequest: from :meth:`validate` when a value is out of range (names the field in ``param``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: list[list[float]] = field(default_factory=list)
    # set by the server, never by a client: absolute ``time.monotonic()`` seconds (system-wide on Linux, so the
    # frontend's clock is the engine's) past which the engine ends the request with ``request_timeout``
    deadline: float | None = None
    grammar: str | None = None
    prompt_logprobs: int | None = None

    MAX_N = 16
    MAX_LOGPROBS = 20
    MAX_STOP = 16
    MAX_TOP_K = 2**31 - 1
    MAX_TEMPERATURE = 100.0   # OpenAI allows 2; vLLM and llama.cpp any: past ~100 the distribution is flat anyway
    MAX_LOGIT_BIAS = 1024  # entries

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Check every field; return self. Raises InvalidRequest naming the field."""
        for f in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise InvalidRequest(f"'{f}' must be a finite number, got {v!r}", param=f)
        if not 0 <= self.temperature <= self.MAX_TEMPERATURE:
            raise InvalidRequest(f"'temperature' must be in [0, {self.MAX_TEMPERATURE:g}], got {self.temperature}",
                                 param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"'top_p' must be in (0, 1], got {self.top_p}", param="top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"'min_p' must be in [0, 1], got {self.min_p}", param="min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequest(f"'presence_penalty' must be in [-2, 2], got {self.presence_penalty}",
                                 param="presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequest(f"'frequency_penalty' must be in [-2, 2], got {self.frequency_penalty}",
                                 param="frequency_penalty")
        if self.repetition_penalty <= 0:
            raise InvalidRequest(f"'repetition_penalty' must be > 0, got {self.repetition_penalty}",
                                 param="repetition_penalty")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < -1):
            raise InvalidRequest(f"'top_k' must be -1 or 0 (off) or at least 1, got {self.top_k!r}", param="top_k")
        if self.top_k is None or self.top_k <= 0:
            self.top_k = -1
        elif self.top_k > self.MAX_TOP_K:
            self.top_k = self.MAX_TOP_K   # same meaning (no vocabulary is that large); fits the IPC's int64
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest(f"'max_tokens' must be at least 1, got {self.max_tokens}", param="max_tokens")
        if self.min_tokens < 0:
            raise InvalidRequest(f"'min_tokens' must be >= 0, got {self.min_tokens}", param="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("'min_tokens' must not exceed 'max_tokens'", param="min_tokens")
        if not 1 <= self.n <= self.MAX_N:
            raise InvalidRequest(f"'n' must be in [1, {self.MAX_N}], got {self.n}", param="n")
        if len(self.stop) > self.MAX_STOP:
            raise InvalidRequest(f"at most {self.MAX_STOP} stop strings are allowed, got {len(self.stop)}",
                                 param="stop")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must not be empty", param="stop")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise InvalidRequest(f"'logprobs' must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}",
                                 param="logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS:
            raise InvalidRequest(f"'prompt_logprobs' must be in [0, {self.MAX_LOGPROBS}], got "
                                 f"{self.prompt_logprobs}", param="prompt_logprobs")
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            raise InvalidRequest(f"at most {self.MAX_LOGIT_BIAS} 'logit_bias' entries are allowed, got "
                                 f"{len(self.logit_bias)}", param="logit_bias")
        for tok, bias in self.logit_bias:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise InvalidRequest(f"'logit_bias' keys must be token ids >= 0, got {tok!r}", param="logit_bias")
            if not isinstance(bias, (int, float)) or not math.isfinite(bias) or not -100 <= bias <= 100:
                raise InvalidRequest(f"'logit_bias' values must be in [-100, 100], got {bias!r} for token {tok}",
                                     param="logit_bias")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequest(f"'seed' must be in [-2**63, 2**63) (a 64-bit integer), got {self.seed}", param="seed")
        return self

    def to_dict(self) -> dict:
        """Plain dict for msgpack."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
