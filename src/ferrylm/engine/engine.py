"""The engine core: admit requests, and per step schedule → forward → sample → report.

Pure (no I/O): ``engine/worker.py`` wraps it in a process with IPC, and ``llm.py`` drives it in-process.

OOM containment (``memory/guard.py``): every allocation failure inside a step (scheduling, forward, logits,
sampling) is caught at the step boundary; the step's requests keep their counters (``num_computed_tokens``
advances and sampled tokens are appended only after the whole step succeeded, so K/V a failed forward wrote past
the computed tokens is simply overwritten later) and the guard's ladder retries, halves the prefill chunk, shrinks
the expert cache, preempts, or fails only that step's requests with ``insufficient_memory``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine import prompt_logprobs
from ferrylm.engine.cache.kv_pool import KVLayout, KVPool
from ferrylm.engine.model_runner import ModelRunner, has_prefill
from ferrylm.engine.outputs import EngineOutput
from ferrylm.engine.cache.prefix_cache import PrefixCache, cache_seed
from ferrylm.engine.progress import StepAbandoned, StepProgress
from ferrylm.engine.request import Request, Status
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.cache.state_pool import StateLayout, StatePool
from ferrylm.engine.scheduler import Batch, ScheduledSeq, Scheduler, SchedulerConfig
from ferrylm.engine.structured import StructuredDecoder
from ferrylm.errors import ContextLengthExceeded, FerryError
from ferrylm.faults import NO_FAULTS, FaultInjector
from ferrylm.memory.guard import GuardConfig, OomGuard, StepRecovery, elastic_cache_of, is_oom
from ferrylm.memory.plan import MemoryPlan, gib
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
    """``--max-prefill-length`` or its default: 2048 tokens on the CPU, 8192 on a GPU."""
    return cfg.max_prefill_length or (2048 if device.type == "cpu" else 8192)


def limits_with_pages(cfg: EngineConfig, mcfg: ModelConfig, device: torch.device, num_pages: int) -> EngineLimits:
    """The engine's limits with a KV pool of ``num_pages`` pages (the other sizes from the flags)."""
    return EngineLimits(max_model_len=cfg.max_model_len or mcfg.max_position_embeddings, num_pages=num_pages,
                        page_size=cfg.page_size, max_prefill_length=default_prefill_length(cfg, device),
                        max_running_requests=cfg.max_running_requests)


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
        config: EngineConfig. limits: the sizes (the boot's plan, ``engine/boot.py``; ``boot.engine_for_model``
            sizes one without the boot's profile).
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
        if expert_executor is not None and hasattr(expert_executor, "faults"):
            expert_executor.faults = faults  # point expert_fetch
        self.mcfg = model_config
        self.config = config
        self.device = device
        self.limits = limits
        self.pool = KVPool(layout=KVLayout.of(model_config), num_pages=self.limits.num_pages,
                           page_size=self.limits.page_size, dtype=dtype, device=device)
        # hybrid models (linear-attention layers): one recurrent-state slot per running request (engine/cache/state_pool.py)
        layout = StateLayout.of(model_config)
        self.state_pool = (StatePool(layout, self.limits.max_running_requests, dtype, device)
                           if layout is not None else None)
        self.prefix_cache = None
        self.state_snapshots = None
        if config.enable_prefix_caching:
            seed = cache_seed("ferrylm-prefix-cache-v1", model_id, model_config, str(dtype))
            self.prefix_cache = PrefixCache(self.pool.allocator, self.limits.page_size, seed)
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
        self.eos_ids = tuple(model_config.eos_token_ids)
        self.tp = tp
        self.runner = ModelRunner(model, self.pool, device, dtype, config, self.limits.max_model_len,
                                  expert_executor, self.eos_ids, tp=tp)
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
        return str(getattr(self.expert_executor, "name", type(self.expert_executor).__name__))

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

    # --- admission --------------------------------------------------------------------------------------------
    def check_admission(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Return the resolved max_tokens, or raise ContextLengthExceeded (the request can never run)."""
        L = self.limits.max_model_len
        pool = self.limits.pool_tokens
        if num_prompt_tokens < 1:
            raise FerryError("the prompt is empty", code="invalid_request", param="prompt")
        if num_prompt_tokens >= L:   # the context first (a bigger KV pool would not help)
            raise ContextLengthExceeded(
                f"This model's maximum context length is {L} tokens. However, your prompt has {num_prompt_tokens} "
                f"tokens, which leaves no room for completion tokens. Shorten the prompt (the limit is the "
                f"server's --max-model-len, at most the model's own context).", param="messages")
        if num_prompt_tokens + 1 > pool:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {L} tokens. However, your prompt has {num_prompt_tokens} "
                f"tokens, and the KV cache pool holds only {pool} tokens (prompt + 1 must fit). Shorten the "
                f"prompt, or raise the pool with --num-tokens / --num-pages (or more memory: --gpu-memory-limit).",
                param="messages")
        if max_tokens is None:
            return L - num_prompt_tokens
        if num_prompt_tokens + max_tokens > L:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {L} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in "
                f"the completion). Reduce the prompt or max_tokens, or raise --max-model-len.", param="max_tokens")
        return max_tokens

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
            params.max_tokens = self.check_admission(len(prompt_token_ids), params.max_tokens)
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

    # --- the step ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[EngineOutput]:
        """Run one batch (if any) and return every output produced since the last call. An allocation failure
        never leaves this method (see the module docstring); any other error does (the worker then exits)."""
        self._expire_waiting()
        self._expire_deadlines()
        self.guard.tick()
        batch = self._schedule_guarded()
        self._end_truncated(batch.truncated)
        if batch.seqs:
            self.progress.begin_step(tuple(s.request.request_id for s in batch.seqs), batch.num_tokens,
                                     max(s.request.num_prompt_tokens for s in batch.seqs))
            ok = False
            try:
                ok = self._run_guarded(batch.seqs)
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

    # --- OOM containment --------------------------------------------------------------------------------------
    def _schedule_guarded(self) -> Batch:
        """``scheduler.schedule()``; an allocation failure while a request's pages are allocated is retried,
        then the budget halved, then that request failed (the others are scheduled)."""
        st: StepRecovery | None = None
        while True:
            try:
                return self.scheduler.schedule()
            except Exception as e:
                if not is_oom(e):
                    raise
                st = st or self.guard.begin()
                self.guard.note_oom(st, e)
            req, self.scheduler.growing = self.scheduler.growing, None
            if req is None:
                raise RuntimeError(f"allocation failure while scheduling, not pinned on a request: {st.message}")
            self.guard.release()
            chunk = min(req.num_tokens - req.num_computed_tokens, self.scheduler.prefill_budget)
            action = self.guard.next_action(st, prefill_tokens=chunk, num_seqs=1)
            detail = ""
            if action == "halve":
                self.scheduler.set_prefill_budget(self.guard.halved(chunk))
                detail = f" to {self.scheduler.prefill_budget} tokens"
            self._log_recovery(action + detail, st, "scheduling", chunk, [req])
            if action == "fail":
                self._fail_oom([req], st, "scheduling", chunk)
                st = None

    def _run_guarded(self, seqs: list[ScheduledSeq]) -> bool:
        """Run the step's sequences; on an allocation failure climb the guard's ladder until the (possibly
        smaller) step succeeds or its requests are failed. Returns False when the step was abandoned (its requests
        all aborted mid-step), so its duration teaches the estimates nothing."""
        st: StepRecovery | None = None
        while seqs:
            try:
                self._run(Batch(seqs=seqs, preempted=[], truncated=[]))
                break
            except StepAbandoned:   # every request aborted at a layer boundary: nothing to commit
                log.info("step of %d token(s) abandoned at a layer boundary: its requests were all aborted",
                         sum(s.num_tokens for s in seqs))
                return False
            except Exception as e:
                if not is_oom(e):
                    raise
                st = st or self.guard.begin()
                self.guard.note_oom(st, e)
            # NOTE: outside the except block: the exception, its traceback and the step's tensors are unreachable
            self.guard.release()
            seqs = [s for s in seqs if s.request.status is not Status.FINISHED]   # aborted during the attempt
            seqs = self._drop_lost_states(seqs)
            if not seqs:
                break
            prefill = sum(s.num_tokens for s in seqs if s.num_tokens > 1)
            tokens = sum(s.num_tokens for s in seqs)
            phase = "prefill" if has_prefill(seqs) else "decode"
            action = self.guard.next_action(st, prefill_tokens=prefill, num_seqs=len(seqs),
                                            has_prefill=phase == "prefill")
            reqs, detail = [s.request for s in seqs], ""
            if action == "halve":
                n = self.guard.halved(prefill)
                self.scheduler.set_prefill_budget(n + sum(1 for s in seqs if s.num_tokens == 1))
                seqs = _trim_prefill(seqs, n)
                detail = f": prefill chunk {prefill} -> {n} tokens"
            elif action == "defer":
                # NOTE: the deferred requests keep their pages and counters (nothing of this step was committed);
                # the scheduler gives them their chunk again next step, by then with the decodes' room back
                kept = _without_deferred_prefills(seqs)
                deferred = [s.request.request_id for s in seqs if s not in kept]
                seqs = kept
                detail = f" the prefill of {len(deferred)} request(s) {deferred} to a later step"
            elif action == "preempt":
                victims = self._preemption_victims(seqs)
                for r in victims:
                    self.scheduler.preempt(r)
                seqs = [s for s in seqs if s.request not in victims]
                detail = f" {len(victims)} request(s) {[r.request_id for r in victims]}"
            self._log_recovery(action + detail, st, phase, tokens, reqs)
            if action == "fail":
                self._fail_oom([s.request for s in seqs], st, phase, tokens)
                seqs = []
        if st is None:
            budget = self.guard.step_succeeded()
            if budget is not None:
                self.scheduler.set_prefill_budget(budget)
        return True

    def _drop_lost_states(self, seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """After a failed step of a hybrid model whose linear layers already wrote states: the sequences that
        continued from a state (``start > 0``) lost it (it was partly advanced), so they are preempted (they
        recompute from token 0, like any preemption) and leave the step; those starting at 0 simply retry (their
        state is read as zeros). Other models: ``seqs`` unchanged."""
        rs = self.runner.last_recurrent
        self.runner.last_recurrent = None
        if self.state_pool is None or rs is None or not rs.written:
            return seqs
        lost = [s for s in seqs if s.start > 0]
        for s in lost:
            self.scheduler.preempt(s.request)
        if lost:
            log.warning("failed step: %d request(s) %s lost their recurrent state and recompute from token 0",
                        len(lost), [s.request.request_id for s in lost])
        return [s for s in seqs if s.start == 0]

    def _preemption_victims(self, seqs: list[ScheduledSeq]) -> list[Request]:
        """A decode-only step preempts its newest request (the last admitted). (A step with a prefill defers
        its prefill chunks instead: :func:`_without_deferred_prefills`.)"""
        order = {id(r): i for i, r in enumerate(self.scheduler.running)}
        return [max((s.request for s in seqs), key=lambda r: order.get(id(r), -1))]

    def _fail_oom(self, reqs: list[Request], st: StepRecovery, phase: str, tokens: int) -> None:
        """End ``reqs`` with ``insufficient_memory`` (HTTP 503 + Retry-After at the edge), freeing their pages."""
        free = self.guard.read_free_now()
        msg = (f"out of memory: a {phase} step of {tokens} tokens for {len(reqs)} request(s) could not be computed "
               f"(failed allocation: {gib(st.oom_bytes) if st.oom_bytes else 'size unknown'}; "
               f"{gib(free) + ' free' if free is not None else 'free memory unknown'} on {self.device}, reserve "
               f"{gib(self.guard.reserve_bytes)}; tried: {', '.join(st.actions)}). Retry later or send a shorter "
               f"prompt.")
        for r in reqs:
            if r.status != Status.FINISHED:
                self.scheduler.finish(r, "abort")
            self.requests.pop(r.request_id, None)
            self._pending.append(EngineOutput(r.request_id, [], error_code="insufficient_memory", error_message=msg,
                                              num_prompt_tokens=r.num_prompt_tokens, queue_time=r.take_queue_time()))
        self.guard.count_failed(len(reqs))
        log.error("OOM: failed %d request(s) %s: %s", len(reqs), [r.request_id for r in reqs], msg)

    def _log_recovery(self, action: str, st: StepRecovery, phase: str, tokens: int, reqs: list[Request]) -> None:
        log.warning("OOM in a %s step of %d tokens (%d requests; failed allocation %s: %s); recovery %d: %s "
                    "(prefill budget now %d tokens, expert slots %d)", phase, tokens, len(reqs),
                    gib(st.oom_bytes) if st.oom_bytes else "size unknown", st.message, len(st.actions), action,
                    self.scheduler.prefill_budget, self.guard.cache.num_slots)

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

    def _run(self, batch: Batch) -> None:
        """Forward and sample the batch (the model runner), then advance every sequence's counters and append the
        sampled tokens."""
        self.runner.faults = self.faults
        res = self.runner.execute(batch.seqs)
        # NOTE: counters advance and tokens are appended only here, after every allocation of the step succeeded
        # (the OOM guard retries a failed step from the same counters). A request aborted during the step (the
        # worker's layer-boundary poll) already gave its pages back: nothing is committed for it.
        for s in batch.seqs:
            if s.request.status is not Status.FINISHED:
                s.request.num_computed_tokens += s.num_tokens
        if self.state_snapshots is not None and self.scheduler.prefix_cache is not None:
            self._save_snapshots(batch.seqs)
        if res is not None:
            for i, s in enumerate([s for s in batch.seqs if s.sample]):
                if s.request.status is Status.FINISHED:
                    continue
                self._append_token(s.request, res.token_ids[i],
                                   None if res.logprobs[i] is None else [res.logprobs[i]])

    def _save_snapshots(self, seqs: list[ScheduledSeq]) -> None:
        """Keep the state of every sequence of the (successful) step whose computed tokens end on a page boundary,
        under that page's name (``engine/cache/state_snapshots.py``)."""
        ps = self.limits.page_size
        for s in seqs:
            r = s.request
            n = r.num_computed_tokens
            if r.status is Status.FINISHED or r.state_slot is None or n == 0 or n % ps:
                continue
            self.state_snapshots.save(self.prefix_cache.names(r, n // ps)[-1], r.state_slot)

    def _append_token(self, r: Request, tok: int, logprobs) -> None:
        r.output_token_ids.append(tok)
        grammar_error = self.structured.advance(r, tok)
        if grammar_error is not None:   # the constraint cannot hold: end the request, never go on unconstrained
            self.scheduler.finish(r, "abort")
            self.requests.pop(r.request_id, None)
            self._pending.append(EngineOutput(
                r.request_id, [], error_code="grammar_failed", num_prompt_tokens=r.num_prompt_tokens,
                queue_time=r.take_queue_time(),
                error_message=f"structured output failed after {r.num_output_tokens - 1} tokens: {grammar_error}"))
            return
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
            d["experts"] = self.expert_executor.stats()
        graphs = self.runner.stats()
        if graphs is not None:
            d["decode_graphs"] = graphs
        return d


def _without_deferred_prefills(seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The OOM guard's ``defer``: the step without its prefill chunks when it holds decodes too (decodes of running
    requests are never held back by a prompt that does not fit now); with prefill chunks only, the first of
    them alone."""
    decodes = [s for s in seqs if not (s.num_tokens > 1 or s.start == 0)]
    if decodes:
        return decodes
    return seqs[:1]


def _trim_prefill(seqs: list[ScheduledSeq], limit: int) -> list[ScheduledSeq]:
    """The step with its prefill chunks (sequences of more than one token) cut to ``limit`` tokens in all, in
    order; decode sequences are kept. A chunk cut short no longer samples (its request just progresses less)."""
    out: list[ScheduledSeq] = []
    left = limit
    for s in seqs:
        if s.num_tokens <= 1:
            out.append(s)
            continue
        n = min(s.num_tokens, left)
        if n > 0:
            out.append(ScheduledSeq(s.request, s.start, n))
            left -= n
    return out
