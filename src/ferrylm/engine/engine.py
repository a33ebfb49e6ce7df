"""The engine core: admit requests, and per step schedule → forward → sample → report.

Pure (no I/O): ``engine/worker.py`` wraps it in a process with IPC, and ``llm.py`` drives it in-process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.kv_cache import KVPool, PagedAttention, SeqSlice
from ferrylm.engine.outputs import EngineOutput
from ferrylm.engine.request import Request, Status
from ferrylm.engine.sampler import sample
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.scheduler import Batch, Scheduler, SchedulerConfig
from ferrylm.errors import ContextLengthExceeded, FerryError

log = logging.getLogger("ferrylm.engine")


def resolve_device(name: str) -> torch.device:
    """``"auto"`` → cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` → float32 on CPU, bfloat16 on CUDA."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass(frozen=True)
class EngineLimits:
    """Derived sizes: ``max_model_len`` (tokens), KV pool ``num_pages`` x ``page_size``, ``max_prefill_length``."""

    max_model_len: int
    num_pages: int
    page_size: int
    max_prefill_length: int
    max_running_requests: int

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size


def plan_limits(cfg: EngineConfig, mcfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> EngineLimits:
    """Size the KV pool and the step budget. Explicit sizes win; otherwise ``kv_memory_fraction`` of available
    memory (host RAM on CPU, free device memory on CUDA), capped at what ``max_running_requests`` requests of full
    context could use. The memory-plan issue replaces the default with a measured plan."""
    max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
    prefill = cfg.max_prefill_length or (2048 if device.type == "cpu" else 8192)
    if cfg.num_pages is not None:
        num_pages = cfg.num_pages
    elif cfg.num_tokens is not None:
        num_pages = -(-cfg.num_tokens // cfg.page_size)
    else:
        per_tok = KVPool.bytes_per_token(num_layers=mcfg.num_layers, num_kv_heads=mcfg.num_kv_heads,
                                         head_dim=mcfg.head_dim, dtype=dtype)
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            import psutil
            free = psutil.virtual_memory().available
        want = cfg.max_running_requests * max_model_len
        tokens = max(cfg.page_size, min(want, int(free * cfg.kv_memory_fraction) // per_tok))
        num_pages = -(-tokens // cfg.page_size)
    return EngineLimits(max_model_len=max_model_len, num_pages=num_pages, page_size=cfg.page_size,
                        max_prefill_length=prefill, max_running_requests=cfg.max_running_requests)


class Engine:
    """Continuous-batching engine over one model.

    Args:
        model: a ferrylm model (``forward(input_ids [T], positions [T], attn) -> [T, H]``,
            ``compute_logits([N, H]) -> [N, V]``).
        model_config: its ModelConfig.
        config: EngineConfig; ``limits`` (derived sizes) may be passed to skip :func:`plan_limits`.
        device, dtype: where the KV pool lives and its dtype.
    """

    def __init__(self, model, model_config: ModelConfig, config: EngineConfig, *, device: torch.device,
                 dtype: torch.dtype, limits: EngineLimits | None = None):
        self.model = model
        self.mcfg = model_config
        self.config = config
        self.device = device
        self.limits = limits or plan_limits(config, model_config, device, dtype)
        self.pool = KVPool(num_layers=model_config.num_layers, num_pages=self.limits.num_pages,
                           page_size=self.limits.page_size, num_kv_heads=model_config.num_kv_heads,
                           head_dim=model_config.head_dim, dtype=dtype, device=device)
        self.scheduler = Scheduler(SchedulerConfig(self.limits.max_running_requests,
                                                   self.limits.max_prefill_length, self.limits.page_size),
                                   self.pool.allocator)
        self.requests: dict[str, Request] = {}
        self.eos_ids = tuple(model_config.eos_token_ids)
        self._pending: list[EngineOutput] = []
        self.num_steps = 0
        self.last_step_time = time.monotonic()
        if self.limits.pool_tokens < self.limits.max_model_len:
            log.warning("the KV pool holds %d tokens, fewer than the model context of %d tokens: long requests "
                        "will be rejected; raise --num-tokens/--num-pages or lower --max-model-len",
                        self.limits.pool_tokens, self.limits.max_model_len)

    # --- admission --------------------------------------------------------------------------------------------
    def check_admission(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Return the resolved max_tokens, or raise ContextLengthExceeded (the request can never run)."""
        L = self.limits.max_model_len
        pool = self.limits.pool_tokens
        if num_prompt_tokens < 1:
            raise FerryError("the prompt is empty", code="invalid_request", param="prompt")
        if num_prompt_tokens + 1 > pool:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {L} tokens. However, your prompt has {num_prompt_tokens} "
                f"tokens, and the KV cache pool holds only {pool} tokens (prompt + 1 must fit). Raise the pool "
                f"with --num-tokens / --num-pages or shorten the prompt.", param="messages")
        if num_prompt_tokens >= L:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {L} tokens. However, your prompt has {num_prompt_tokens} "
                f"tokens, which leaves no room for completion tokens. Shorten the prompt or raise --max-model-len.",
                param="messages")
        if max_tokens is None:
            return L - num_prompt_tokens
        if num_prompt_tokens + max_tokens > L:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {L} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in "
                f"the completion). Reduce the prompt or max_tokens, or raise --max-model-len.", param="max_tokens")
        return max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Admit a request or report its rejection as a terminal error output (never raises for a client
        mistake). A duplicate running id is rejected too."""
        try:
            if request_id in self.requests:
                raise FerryError(f"request id {request_id!r} is already running", code="invalid_request")
            params.validate()
            params.max_tokens = self.check_admission(len(prompt_token_ids), params.max_tokens)
        except FerryError as e:
            self._pending.append(EngineOutput(request_id, [], error_code=e.code, error_message=e.message,
                                              num_prompt_tokens=len(prompt_token_ids)))
            return
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed % (2**63))
        req = Request(request_id, list(prompt_token_ids), params, generator=gen, arrival_time=time.monotonic())
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages now. Unknown ids are ignored (it may have just finished)."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, "abort")
            self._pending.append(EngineOutput(request_id, [], finish_reason="abort",
                                              num_prompt_tokens=req.num_prompt_tokens))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- the step ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[EngineOutput]:
        """Run one batch (if any) and return every output produced since the last call."""
        self._expire_waiting()
        batch = self.scheduler.schedule()
        for r in batch.truncated:
            log.warning("request %s ended at %d tokens: the KV pool (%d tokens) cannot hold more",
                        r.request_id, r.num_tokens, self.limits.pool_tokens)
            self.requests.pop(r.request_id, None)
            self._pending.append(EngineOutput(r.request_id, [], finish_reason="length",
                                              num_prompt_tokens=r.num_prompt_tokens))
        if batch.seqs:
            self._run(batch)
            self.num_steps += 1
            self.last_step_time = time.monotonic()
        if self.config.check_invariants:
            self.scheduler.check_invariants()
        out, self._pending = self._pending, []
        return out

    def _expire_waiting(self) -> None:
        """Fail requests that waited longer than ``queue_timeout`` without being scheduled (503 queue_timeout).
        A preempted request (it has produced tokens) is not expired: it already started."""
        limit = self.config.queue_timeout
        if limit is None or not self.scheduler.waiting:
            return
        now = time.monotonic()
        for r in [r for r in self.scheduler.waiting if not r.output_token_ids and now - r.arrival_time > limit]:
            self.scheduler.finish(r, "abort")
            self.requests.pop(r.request_id, None)
            self._pending.append(EngineOutput(
                r.request_id, [], error_code="queue_timeout", num_prompt_tokens=r.num_prompt_tokens,
                error_message=f"the request waited {now - r.arrival_time:.1f} s in the queue, longer than "
                              f"--queue-timeout {limit:g} s ({self.num_running} running, {self.num_waiting} waiting)"))

    def _run(self, batch: Batch) -> None:
        ps = self.limits.page_size
        ids, pos, seqs = [], [], []
        q_start = 0
        for s in batch.seqs:
            r = s.request
            ids.extend(r.tokens(s.start, s.start + s.num_tokens))
            end = s.start + s.num_tokens
            pt = torch.tensor(r.page_table, dtype=torch.long)
            slots = (pt[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:end]
            seqs.append(SeqSlice(q_start=q_start, q_len=s.num_tokens, ctx_len=s.start, slots=slots.to(self.device)))
            pos.append(torch.arange(s.start, end))
            q_start += s.num_tokens
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.cat(pos).to(self.device)
        hidden = self.model(input_ids, positions, PagedAttention(self.pool, seqs, self.device))
        for s in batch.seqs:
            s.request.num_computed_tokens += s.num_tokens
        to_sample = [(s, seqs[i]) for i, s in enumerate(batch.seqs) if s.sample]
        if not to_sample:
            return
        last = torch.tensor([sl.q_start + sl.q_len - 1 for _, sl in to_sample], device=self.device)
        logits = self.model.compute_logits(hidden[last]).float()
        reqs = [s.request for s, _ in to_sample]
        res = sample(logits, reqs, self.eos_ids)
        for i, r in enumerate(reqs):
            self._append_token(r, res.token_ids[i], None if res.logprobs[i] is None else [res.logprobs[i]])

    def _append_token(self, r: Request, tok: int, logprobs) -> None:
        r.output_token_ids.append(tok)
        p = r.params
        reason = None
        if not p.ignore_eos and tok in self.eos_ids and r.num_output_tokens >= p.min_tokens:
            reason = "stop"
        elif tok in p.stop_token_ids and r.num_output_tokens >= p.min_tokens:
            reason = "stop"
        elif r.num_output_tokens >= p.max_tokens or r.num_tokens >= self.limits.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(r, reason)
            self.requests.pop(r.request_id, None)
        self._pending.append(EngineOutput(r.request_id, [tok], finish_reason=reason, logprobs=logprobs,
                                          num_prompt_tokens=r.num_prompt_tokens))

    def stats(self) -> dict:
        """Live figures for heartbeats and /metrics."""
        return {"num_running": self.num_running, "num_waiting": self.num_waiting,
                "kv_pages_used": self.pool.allocator.num_used, "kv_pages_total": self.pool.num_pages,
                "num_preemptions": self.scheduler.num_preemptions, "num_steps": self.num_steps}
