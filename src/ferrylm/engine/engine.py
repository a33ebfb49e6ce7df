"""The engine core: admit requests, and per step schedule → forward → sample → report.

Pure (no I/O): ``engine/worker.py`` wraps it in a process with IPC, and ``llm.py`` drives it in-process.

OOM containment (``memory/ladder.py`` applying the decisions of ``memory/guard.py``): every allocation failure
inside a step (scheduling, forward, logits, sampling) is caught at the step boundary; the step's requests keep
their counters (``Scheduler.update`` advances them and appends sampled tokens only after the whole step
succeeded, so K/V a failed forward wrote past the computed tokens is simply overwritten later) and the ladder
retries, shrinks the expert cache, halves the prefill chunk, defers or preempts, or fails only that step's
requests with ``insufficient_memory``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine import prompt_logprobs
from ferrylm.engine.admission import admit
from ferrylm.engine.cache.kv_pool import KVLayout, KVPool
from ferrylm.engine.model_runner import ModelRunner
from ferrylm.engine.outputs import EngineOutput
from ferrylm.engine.cache.prefix_cache import PrefixCache, cache_seed
from ferrylm.engine.progress import StepAbandoned, StepProgress
from ferrylm.engine.request import Request, Status
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.cache.state_pool import StateLayout, StatePool
from ferrylm.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, TokenUpdate
from ferrylm.engine.structured import StructuredDecoder
from ferrylm.errors import FerryError
from ferrylm.faults import NO_FAULTS, FaultInjector
from ferrylm.memory.guard import GuardConfig, OomGuard, elastic_cache_of
from ferrylm.memory.ladder import OomLadder
from ferrylm.memory.plan import MemoryPlan
from ferrylm.models.sizes import non_expert_step_bytes

log = logging.getLogger("ferrylm.engine")


def resolve_device(name: str) -> torch.device:
    """``"auto"`` → cuda when available, else cpu.

    Raises:
        ValueError: a CUDA device is asked for but torch has no CUDA device (message names ``--device``).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                         f"{'no CUDA build' if torch.version.cuda is None else 'no visible GPU'}); use --device cpu")
    return device


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


def default_prefill_length(cfg: EngineConfig, device: torch.device) -> int:
    """``--max-prefill-length`` or its default: 512 tokens on the CPU (llama.cpp's micro-batch: a chunk there takes
    seconds, and every running stream waits for it), 8192 on a GPU."""
    return cfg.max_prefill_length or (512 if device.type == "cpu" else 8192)


def limits_with_pages(cfg: EngineConfig, mcfg: ModelConfig, device: torch.device, num_pages: int,
                      max_running_requests: int) -> EngineLimits:
    """The engine's limits with a KV pool of ``num_pages`` pages and ``max_running_requests`` (resolved: the flag
    or the plan's, ``memory/concurrency.py``); the other sizes from the flags."""
    return EngineLimits(max_model_len=cfg.max_model_len or mcfg.max_position_embeddings, num_pages=num_pages,
                        page_size=cfg.page_size, max_prefill_length=default_prefill_length(cfg, device),
                        max_running_requests=max_running_requests)


def state_snapshot_count(limits: EngineLimits) -> int:
    """Recurrent-state snapshots a hybrid model keeps for prefix caching: one per running request (the memory
    plan counts them with the state slots)."""
    return limits.max_running_requests


class Engine:
    """Continuous-batching engine over one model.

    Args:
        model: a ferrylm model (``forward(input_ids [T], positions [T], attn) -> [T, H]``,
            ``compute_logits([N, H]) -> [N, V]``).
        model_config: its ModelConfig.
        config: EngineConfig. limits: the sizes (the boot's plan, ``engine/boot.py``; ``boot.engine_for_model`` sizes
            one without the boot's profile).
        device, dtype: where the KV pool lives and its dtype.
        expert_executor: the model's routed-expert executor, whose ``stats()`` join the engine's (None: dense).
        faults: the fault injector (default: off).
        guard: the OOM guard (default: one over the executor's elastic cache, the configured prefill budget).
        memory_plan: the boot memory plan (``memory/plan.py``), reported in stats and at ``GET /v1/memory``.
        tokenizer_path: the model folder whose tokenizer compiles structured-output grammars (None: such
            requests are refused).
        model_id: what names the weights (the model path or spec), part of the prefix cache's seed.
        tp: rank 0's step broadcaster under tensor parallel (``engine/parallel/step_sync.py``), None for one rank;
            ``model`` and ``model_config`` are then this rank's shard (the KV pool holds its heads only).

    ``prefix_cache`` (:class:`~ferrylm.engine.cache.prefix_cache.PrefixCache`, None when
    ``config.enable_prefix_caching`` is off): full KV pages shared across requests by content hash.

    ``progress`` (:class:`~ferrylm.engine.progress.StepProgress`): ticks per layer and per step, the running
    step's requests and expected duration; the worker's heartbeat reports it to the watchdog.
    """

    def __init__(self, model, model_config: ModelConfig, config: EngineConfig, *, device: torch.device,
                 dtype: torch.dtype, limits: EngineLimits, expert_executor=None,
                 faults: FaultInjector = NO_FAULTS, guard: OomGuard | None = None,
                 memory_plan: MemoryPlan | None = None, tokenizer_path: str | None = None,
                 model_id: str | None = None, tp=None):
        self.model = model
        self.expert_executor = expert_executor
        self.faults = faults
        self.memory_plan = memory_plan
        if expert_executor is not None:
            expert_executor.faults = faults  # point expert_fetch
        self.mcfg = model_config
        self.config = config
        self.device = device
        self.limits = limits
        self.pool = KVPool(layout=KVLayout.of(model_config), num_pages=self.limits.num_pages,
                           page_size=self.limits.page_size, dtype=dtype, device=device,
                           kv_cache_dtype=config.kv_cache_dtype)
        # hybrid models (linear-attention layers): one recurrent-state slot per running request (engine/cache/state_pool.py)
        layout = StateLayout.of(model_config)
        self.state_pool = (StatePool(layout, self.limits.max_running_requests, dtype, device)
                           if layout is not None else None)
        self.prefix_cache = None
        self.state_snapshots = None
        if config.enable_prefix_caching:
            seed = cache_seed("ferrylm-prefix-cache-v1", model_id, model_config, str(self.pool.storage_dtype))
            # partial pages are copied on this rank only: under tensor parallel only full pages are shared
            self.prefix_cache = PrefixCache(self.pool.allocator, self.limits.page_size, seed,
                                            copy_prefix=self.pool.copy_page_prefix if tp is None else None,
                                            align=self.pool.layout.align)
            if self.state_pool is not None:   # a cached KV prefix needs the recurrent state at its end
                from ferrylm.engine.cache.state_snapshots import StateSnapshots

                self.state_snapshots = StateSnapshots(self.state_pool, state_snapshot_count(self.limits))
        self.scheduler = Scheduler(SchedulerConfig(self.limits.max_running_requests,
                                                   self.limits.max_prefill_length, self.limits.page_size),
                                   self.pool.allocator, faults, prefix_cache=self.prefix_cache,
                                   state_pool=self.state_pool, state_snapshots=self.state_snapshots)
        self.guard = guard or OomGuard(device, elastic_cache_of(expert_executor),
                                       prefill_limit=self.limits.max_prefill_length,
                                       reserve_bytes=memory_plan.reserve_bytes if memory_plan else 0,
                                       config=GuardConfig(workspace_bytes=memory_plan.workspace_bytes
                                                          if memory_plan else 0))
        self.ladder = OomLadder(self.guard, self, device, StepAbandoned)
        self.eos_ids = tuple(model_config.eos_token_ids)
        self.tp = tp
        self.runner = ModelRunner(model, self.pool, device, dtype, config, self.limits.max_model_len,
                                  expert_executor, self.eos_ids, tp=tp,
                                  max_running_requests=self.limits.max_running_requests)
        self.runner.faults = faults
        self.runner.attach_state_pool(self.state_pool)
        self.structured = StructuredDecoder(tokenizer_path, model_config.vocab_size, self.eos_ids)
        self.runner.structured = self.structured
        self.requests: dict[str, Request] = {}
        self._pending: list[EngineOutput] = []
        self.num_steps = 0
        self.last_step_time = time.monotonic()
        self.progress = StepProgress(faults=faults)
        self.progress.attach(model)
        self._bytes_per_elem = torch.empty((), dtype=dtype).element_size()

    @property
    def expert_backend(self) -> str:
        """The routed experts' backend as built (``auto`` resolved), or ``"dense"``."""
        if self.expert_executor is None:
            return "dense"
        return self.expert_executor.name

    @property
    def model_bytes(self) -> dict:
        """What a step reads of the weights (rooflines): ``dense_step_bytes`` (the model's own weights, see
        ``models/sizes.py``) and ``expert_bytes`` (one routed expert as its backend reads it; 0 for a dense model)."""
        ex = self.expert_executor
        return {"dense_step_bytes": non_expert_step_bytes(self.model),
                "expert_bytes": ex.expert_bytes if ex is not None else 0}

    @property
    def decode_graphs(self):
        """The piecewise decode graph runner (offloading executors), or None."""
        return self.runner.piecewise

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    isolate: bool = False) -> None:
        """Admit a request or report its rejection as a terminal error output (never raises for a client
        mistake, nor for a malformed message: token ids that are not ints in the vocabulary are rejected here).
        A duplicate running id is rejected too. ``isolate``: run it in steps of its own (a suspect of an earlier
        engine failure; ``server/process/quarantine.py``)."""
        try:
            if request_id in self.requests:
                raise FerryError(f"request id {request_id!r} is already running", code="invalid_request")
            if not isinstance(prompt_token_ids, (list, tuple)):
                raise FerryError("prompt token ids must be a list", code="invalid_request", param="prompt")
            params.validate()
            params.max_tokens = admit(len(prompt_token_ids), params.max_tokens,
                                      max_model_len=self.limits.max_model_len, pool_tokens=self.limits.pool_tokens)
            vocab, ids = self.mcfg.vocab_size, prompt_token_ids
            if not all(type(t) is int for t in ids) or min(ids) < 0 or max(ids) >= vocab:
                raise FerryError(f"prompt token ids must be integers in [0, {vocab})", code="invalid_request",
                                 param="prompt")
        except FerryError as e:
            self._pending.append(EngineOutput(request_id, [], error_code=e.code, error_message=e.message,
                                              num_prompt_tokens=len(prompt_token_ids)))
            return
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed % (2**63))
        req = Request(request_id, list(prompt_token_ids), params, generator=gen, arrival_time=time.monotonic(),
                      isolate=bool(isolate))
        try:
            self.structured.attach(req)
        except FerryError as e:
            self._pending.append(EngineOutput(request_id, [], error_code=e.code, error_message=e.message,
                                              num_prompt_tokens=len(prompt_token_ids)))
            return
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages now. Unknown ids are ignored (it may have just finished). During a
        step (the worker's layer-boundary poll) that leaves the step no request, the step is abandoned at the next
        layer boundary (not under tensor parallelism: the other ranks wait in the layer's all-reduce)."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, "abort")
            self._pending.append(EngineOutput(request_id, [], finish_reason="abort",
                                              num_prompt_tokens=req.num_prompt_tokens))
            p = self.progress
            if (p.in_step and self.config.tensor_parallel_size == 1
                    and not any(rid in self.requests for rid in p.step_request_ids)):
                p.abandoned = True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- the step: schedule -> run (the OOM ladder around the forward) -> Scheduler.update ---------------------
    @torch.inference_mode()
    def step(self) -> list[EngineOutput]:
        """Run one batch (if any) and return every output produced since the last call. An allocation failure
        never leaves this method (see the module docstring); any other error does (the worker then exits)."""
        self._expire_waiting()
        self._expire_deadlines()
        self.guard.tick()
        batch = self.ladder.schedule()
        self._end_truncated(batch.truncated)
        if batch.seqs:
            self.progress.begin_step(tuple(s.request.request_id for s in batch.seqs), batch.num_tokens,
                                     max(s.request.num_prompt_tokens for s in batch.seqs))
            ok = False
            try:
                ok = self.ladder.run(batch.seqs)
            finally:
                self.progress.end_step(measured=ok)
            self.num_steps += 1
            self.last_step_time = time.monotonic()
        if self.config.check_invariants:
            self.scheduler.check_invariants()
        out, self._pending = self._pending, []
        return out

    def _end_truncated(self, truncated: list[Request]) -> None:
        for r in truncated:
            log.warning("request %s ended at %d tokens: the KV pool (%d tokens) cannot hold more",
                        r.request_id, r.num_tokens, self.limits.pool_tokens)
            self.requests.pop(r.request_id, None)
            self._pending.append(EngineOutput(r.request_id, [], finish_reason="length",
                                              num_prompt_tokens=r.num_prompt_tokens, queue_time=r.take_queue_time()))

    # --- the ladder's host (memory/ladder.StepHost) -----------------------------------------------------------
    def run_step(self, seqs: list[ScheduledSeq]) -> None:
        """One attempt of the step: forward and sample (the model runner), then :meth:`Scheduler.update` commits
        it (counters advance and tokens are appended only after every allocation of the step succeeded)."""
        self.runner.faults = self.faults
        res = self.runner.execute(seqs)
        updates = self.scheduler.update(seqs, res.token_ids if res is not None else None, eos_ids=self.eos_ids,
                                        max_model_len=self.limits.max_model_len, advance=self.structured.advance)
        for u in updates:
            self._emit(u, res.logprobs[u.row])

    def states_lost(self) -> bool:
        """A failed step may have written state a retry would read again: recurrent states, or (conservatively,
        any failed step) the open blocks' pools of a pool with per-block caches."""
        rs, self.runner.last_recurrent = self.runner.last_recurrent, None
        return bool(self.pool.layout.blocks) or (self.state_pool is not None and rs is not None and bool(rs.written))

    def finished(self, request: Request) -> bool:
        return request.status is Status.FINISHED

    def fail_requests(self, requests: list[Request], message: str) -> None:
        """End ``requests`` with ``insufficient_memory`` (HTTP 503 + Retry-After at the edge), freeing their pages."""
        for r in requests:
            if r.status != Status.FINISHED:
                self.scheduler.finish(r, "abort")
            self.requests.pop(r.request_id, None)
            self._pending.append(EngineOutput(r.request_id, [], error_code="insufficient_memory",
                                              error_message=message, num_prompt_tokens=r.num_prompt_tokens,
                                              queue_time=r.take_queue_time()))

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

    def _expire_deadlines(self) -> None:
        """End every request (waiting or running) whose server-side deadline (``SamplingParams.deadline``) has
        passed with ``request_timeout`` (HTTP 408 at the edge), freeing its pages: past its deadline a request
        stops costing compute instead of grinding on for a client that has given up."""
        now = time.monotonic()
        late = [r for r in self.requests.values() if r.params.deadline is not None and now > r.params.deadline]
        for r in late:
            self.scheduler.finish(r, "abort")
            self.requests.pop(r.request_id, None)
            self._pending.append(EngineOutput(
                r.request_id, [], error_code="request_timeout", num_prompt_tokens=r.num_prompt_tokens,
                queue_time=r.take_queue_time(),
                error_message=f"the request ran past its deadline ({now - r.arrival_time:.1f} s in the engine, "
                              f"{r.num_output_tokens} tokens generated; --request-timeout or the x-request-timeout "
                              f"header sets it)"))
            log.warning("request %s ended at its deadline after %d tokens", r.request_id, r.num_output_tokens)

    def _emit(self, u: TokenUpdate, logprobs) -> None:
        """The output of a committed token (a grammar failure ends its request with an error instead)."""
        r = u.request
        if u.grammar_error is not None:   # the constraint cannot hold: end the request, never go on unconstrained
            self.requests.pop(r.request_id, None)
            self._pending.append(EngineOutput(
                r.request_id, [], error_code="grammar_failed", num_prompt_tokens=r.num_prompt_tokens,
                queue_time=r.take_queue_time(),
                error_message=f"structured output failed after {r.num_output_tokens - 1} tokens: {u.grammar_error}"))
            return
        if u.finish_reason is not None:
            self.requests.pop(r.request_id, None)
        self._pending.append(EngineOutput(r.request_id, [u.token], finish_reason=u.finish_reason,
                                          logprobs=None if logprobs is None else [logprobs],
                                          num_prompt_tokens=r.num_prompt_tokens, queue_time=r.take_queue_time(),
                                          prompt_logprobs=prompt_logprobs.take(r),
                                          num_cached_tokens=r.take_cached_tokens()))

    def stats(self) -> dict:
        """Live figures for heartbeats and /metrics (``experts``: the expert executor's counters, when MoE)."""
        d = {"busy": self.progress.in_step or self.has_work(),   # a step still computing is not idle
             "num_running": self.num_running, "num_waiting": self.num_waiting,
             "kv_pages_used": self.pool.allocator.num_used, "kv_pages_total": self.pool.num_pages,
             "num_preemptions": self.scheduler.num_preemptions, "num_steps": self.num_steps}
        if self.state_pool is not None:
            d["state_slots_used"] = self.state_pool.num_slots - self.state_pool.num_free
            d["state_slots_total"] = self.state_pool.num_slots
        if self.state_snapshots is not None:
            d["state_snapshots"] = self.state_snapshots.stats()
        if self.prefix_cache is not None:
            pc = self.prefix_cache.stats
            d["prefix_cache"] = {"queries": pc.queries, "hits": pc.hits,
                                 "cached_pages": self.pool.allocator.num_cached,
                                 "evictions": self.pool.allocator.num_evictions}
        g = self.guard.stats()
        d["oom_recoveries"] = g.pop("oom_recoveries")
        d["memory"] = g
        if self.expert_executor is not None:
            d["experts"] = self.expert_executor.stats().as_dict()
        graphs = self.runner.stats()
        if graphs is not None:
            d["decode_graphs"] = graphs
        return d
