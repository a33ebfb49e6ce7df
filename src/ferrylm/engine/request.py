"""A request's state inside the engine: token counters that catch up (vLLM v1's request model).

``num_computed_tokens`` counts tokens whose K/V are in the cache; the request needs computing while it is behind
``num_tokens`` (prompt + generated so far). Chunked prefill and preemption-by-recompute both fall out of that:
a chunk advances the counter part of the way; a preempted request resets it to 0 and keeps its tokens.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ferrylm.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    Attributes:
        request_id: unique id (string).
        prompt_token_ids: the prompt.
        params: sampling parameters (``max_tokens`` already resolved to an int by admission).
        output_token_ids: tokens generated so far.
        num_computed_tokens: tokens whose K/V are cached (0 .. num_tokens).
        page_table: KV pages owned, in order.
        generator: per-request torch.Generator when ``params.seed`` is set.
        arrival_time: ``time.monotonic()`` at arrival (seconds).
        first_scheduled_time: ``time.monotonic()`` when the scheduler first gave it a step (None before).
        queue_time_reported: its queue time went out on an output already.
        isolate: runs in steps of its own (a suspect of an earlier engine failure).
        times_passed_over: scheduling rounds in which it waited for pages while a request behind it was
            admitted (the scheduler's aging: past ``SchedulerConfig.aging_rounds`` nothing passes it any more).
        grammar: its structured-output matcher (``engine/structured.py``), None when unconstrained.
        prompt_logprobs: prompt-token logprobs gathered so far (``engine/prompt_logprobs.py``), when asked.
        page_hashes: names of its full pages so far (``engine/cache/prefix_cache.py``; tokens never change, so they
            stay valid across preemption).
        num_named_pages: leading pages of ``page_table`` the prefix cache has seen (mapped from the cache or
            named after being computed); reset when its pages are released.
        state_slot: the slot of its linear layers' recurrent state (``engine/cache/state_pool.py``) while it runs, for
            models with linear-attention layers; None otherwise.
        num_cached_tokens: prompt tokens mapped from the prefix cache at its first scheduling (None before; 0
            when nothing matched or caching is off); reported once, on its first output with tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    page_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    queue_time_reported: bool = False
    isolate: bool = False
    times_passed_over: int = 0
    grammar: object | None = None
    grammar_error: str | None = None   # why the grammar cannot go on (engine/structured.py); the request ends
    prompt_logprobs: list | None = None
    page_hashes: list[bytes] = field(default_factory=list)
    num_named_pages: int = 0
    num_cached_tokens: int | None = None
    cached_tokens_reported: bool = False
    state_slot: int | None = None   # its slot in the recurrent-state pool (engine/cache/state_pool.py), hybrid models
    routing_key: int | None = None  # synthetic routing model: the sequence's key (engine/step_inputs.routing_key)

    def take_queue_time(self) -> float | None:
        """Seconds from arrival to the first scheduling, the first time it is asked after that; else None."""
        if self.first_scheduled_time is None or self.queue_time_reported:
            return None
        self.queue_time_reported = True
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    def take_cached_tokens(self) -> int | None:
        """Prompt tokens served from the prefix cache, the first time it is asked after its first scheduling;
        else None."""
        if self.cached_tokens_reported or self.first_scheduled_time is None:
            return None
        self.cached_tokens_reported = True
        return min(self.num_cached_tokens or 0, self.num_prompt_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def min_tokens_met(self) -> bool:
        """EOS and stop ids may end it: ``params.min_tokens`` outputs are there, or its output grammar is complete
        (allows nothing but EOS). The grammar's end wins over ``min_tokens``: no other token could follow."""
        return self.num_output_tokens >= self.params.min_tokens or \
            (self.grammar is not None and self.grammar.is_stopped())

    def token_at(self, i: int) -> int:
        """Token id at absolute position ``i``."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``start .. end - 1``."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n: end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
