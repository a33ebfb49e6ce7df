"""The boot's warmup on the model runner: forward steps at the largest sizes the engine will run, without a
scheduler or an Engine, so that the workspace (the peak memory of a step above the weights and pools) can be
measured before the memory plan sizes the KV pool and the expert slots (``engine/boot.py``).

Steps: prefill chunks of ``prefill_tokens`` new tokens in all (requests no longer than the context, at most
``max_running_requests`` of them) through every layer, prefills of ``short_prompts`` tokens (on CUDA, 24 and 100:
kernels whose tiles depend on the step size compile now), then ``decode_seqs`` two-token prompts and one decode
step of all of them. On the CPU nothing is measured or compiled: one prefill just long enough to time a token
(``PREFILL_SIZED_TOKENS``, the watchdog's first estimates) and a decode step of two requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.cache.kv_pool import KVLayout, KVPool, pages_needed
from ferrylm.engine.cache.state_pool import StateLayout, StatePool
from ferrylm.engine.model_runner import ModelRunner
from ferrylm.engine.progress import PREFILL_SIZED_TOKENS, StepProgress
from ferrylm.engine.request import Request, Status
from ferrylm.engine.sampling_params import SamplingParams
from ferrylm.engine.scheduler import ScheduledSeq
from ferrylm.faults import NO_FAULTS
from ferrylm.memory.guard import is_oom
from ferrylm.memory.budget import MemoryPlanError, gib
from ferrylm.memory.probe import estimate_workspace, free_bytes, measure_peak, release_cached
from ferrylm.models.registry import get_model_class

# on the CPU no peak can be measured: a short warmup still runs every path, the workspace is estimated
CPU_WARMUP_PREFILL = PREFILL_SIZED_TOKENS
CPU_WARMUP_DECODE = 2
SHORT_PROMPTS = (24, 100)


@dataclass(frozen=True)
class WarmupShape:
    """The largest step of each kind the warmup runs: ``prefill_tokens`` (tokens), ``decode_seqs`` (requests),
    bounded by ``max_model_len`` and ``max_running_requests``; ``short_prompts``: the lengths of the single
    prefills run besides (tokens)."""

    prefill_tokens: int
    decode_seqs: int
    max_model_len: int
    max_running_requests: int
    short_prompts: tuple[int, ...] = SHORT_PROMPTS

    @property
    def prompt_len(self) -> int:
        return max(1, min(self.prefill_tokens, self.max_model_len - 1))

    @property
    def num_prefills(self) -> int:
        return max(1, min(self.max_running_requests, -(-self.prefill_tokens // self.prompt_len)))

    def pages(self, page_size: int) -> int:
        """KV pages the warmup holds at its largest step."""
        return (self.num_prefills * pages_needed(self.prompt_len + 1, page_size)
                + max(1, self.decode_seqs) * pages_needed(3, page_size) + 1)


@dataclass(frozen=True)
class Workspace:
    """What the warmup measured: ``bytes`` (peak above the weights and pools), ``source`` (``"measured"`` on
    CUDA, ``"estimated"`` on the CPU), ``graph_bytes`` (the captured CUDA graphs' pool) and ``step_times`` (the
    watchdog's first estimates)."""

    bytes: int
    source: str
    graph_bytes: int
    step_times: StepProgress


@torch.inference_mode()
def warm_up(runner: ModelRunner, pool: KVPool, state_pool: StatePool | None, shape: WarmupShape, vocab: int,
            progress: StepProgress) -> None:
    """Run the warmup's steps (module docstring) on ``runner`` over ``pool``: pages and state slots are taken from
    the pools and given back. No fault injection; a failure raises.

    Raises:
        torch.OutOfMemoryError: the warmup does not fit the device. RuntimeError: the pool cannot hold it.
    """
    faults = runner.faults
    runner.faults = NO_FAULTS
    executor = runner.executor
    executor_faults = executor.faults if executor is not None else None
    if executor is not None:
        executor.faults = NO_FAULTS
    try:
        per, n = shape.prompt_len, shape.num_prefills
        lens = [min(per, shape.prefill_tokens - i * per) for i in range(n)]
        _step(runner, pool, state_pool, progress, [[(i + j) % vocab for j in range(m)] for i, m in enumerate(lens)])
        for m in sorted({min(m, per) for m in shape.short_prompts}):
            _step(runner, pool, state_pool, progress, [[(7 + j) % vocab for j in range(m)]])
        prompts = [[(i + 1) % vocab, (i + 2) % vocab] for i in range(max(1, shape.decode_seqs))]
        _step(runner, pool, state_pool, progress, prompts, decode=True)
    finally:
        runner.faults = faults
        if executor is not None:
            executor.faults = executor_faults


def _step(runner: ModelRunner, pool: KVPool, state_pool: StatePool | None, progress: StepProgress,
          prompts: list[list[int]], decode: bool = False) -> None:
    """One prefill step of ``prompts`` (then, with ``decode``, one decode step of all of them); frees what it took."""
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = fit_to_pages(prompts, pool.allocator.num_free, pool.page_size)
    reqs = [Request(f"warmup-{i}", p, greedy, status=Status.RUNNING) for i, p in enumerate(prompts)]
    try:
        for r in reqs:
            r.page_table = pool.allocator.allocate(pages_needed(r.num_tokens + 1, pool.page_size))
            if state_pool is not None:
                r.state_slot = state_pool.allocate()
        _run(runner, progress, [ScheduledSeq(r, 0, r.num_tokens) for r in reqs])
        if decode:
            _run(runner, progress, [ScheduledSeq(r, r.num_tokens - 1, 1) for r in reqs])
    finally:
        for r in reqs:
            pool.allocator.free(reversed(r.page_table))
            if state_pool is not None and r.state_slot is not None:
                state_pool.free(r.state_slot)


def fit_to_pages(prompts: list[list[int]], free_pages: int, page_size: int) -> list[list[int]]:
    """``prompts`` cut from the end so that each, with one token to sample, fits the ``free_pages`` pages of
    ``page_size`` tokens: no step the engine runs holds more than its pool (an explicit ``--num-pages`` smaller than
    the prefill chunk), so neither does the warmup's.

    Raises:
        RuntimeError: not one page is free.
    """
    out: list[list[int]] = []
    for p in prompts:
        room = free_pages * page_size - 1
        if room < 1:
            break
        out.append(p[:room])
        free_pages -= pages_needed(len(out[-1]) + 1, page_size)
    if not out:
        raise RuntimeError("warmup did not finish: the KV pool has no free page")
    return out


def _run(runner: ModelRunner, progress: StepProgress, seqs: list[ScheduledSeq]) -> None:
    progress.begin_step(tuple(s.request.request_id for s in seqs), sum(s.num_tokens for s in seqs))
    res = runner.execute(seqs)
    progress.end_step()   # the first measurement of a full prefill chunk: the watchdog's estimate
    for s in seqs:
        s.request.num_computed_tokens += s.num_tokens
    if res is not None:
        for s, tok in zip([s for s in seqs if s.sample], res.token_ids):
            s.request.output_token_ids.append(int(tok))


def profile_workspace(model, executor, mcfg: ModelConfig, config: EngineConfig, device: torch.device,
                      dtype: torch.dtype, shape: WarmupShape, weights_bytes: int, tp=None) -> Workspace:
    """Warm up a model runner over a KV pool just large enough for ``shape`` and return the :class:`Workspace`.
    On CUDA the runner also captures its decode graphs, whose pool is measured (it stays allocated in the engine,
    beside the workspace); on the CPU a short warmup runs and the workspace is estimated.

    Raises:
        MemoryPlanError: the warmup itself ran out of memory.
    """
    run_shape = shape
    if device.type != "cuda":
        run_shape = WarmupShape(min(shape.prefill_tokens, CPU_WARMUP_PREFILL), min(shape.decode_seqs,
                                CPU_WARMUP_DECODE), shape.max_model_len, shape.max_running_requests, ())
    pool = KVPool(layout=KVLayout.of(mcfg), num_pages=run_shape.pages(config.page_size), page_size=config.page_size,
                  dtype=dtype, device=device, kv_cache_dtype=config.kv_cache_dtype)
    layout = StateLayout.of(mcfg)
    state_pool = StatePool(layout, shape.max_running_requests, dtype, device) if layout is not None else None
    runner = ModelRunner(model, pool, device, dtype, config, shape.max_model_len, executor,
                         tuple(mcfg.eos_token_ids), tp=tp, max_running_requests=shape.max_running_requests)
    runner.attach_state_pool(state_pool)
    progress = StepProgress()
    progress.attach(model)
    try:
        peak = measure_peak(device, lambda: warm_up(runner, pool, state_pool, run_shape, mcfg.vocab_size, progress))
    except Exception as e:
        if not is_oom(e):
            raise
        msg = str(e).split("\n")[0][:200]
        del e, runner, pool, state_pool
        release_cached(device)
        raise MemoryPlanError(
            f"memory plan does not fit: the warmup (a prefill of {run_shape.prefill_tokens} tokens, a decode of "
            f"{run_shape.decode_seqs} requests) ran out of memory after the weights ({gib(weights_bytes)}) were "
            f"loaded ({msg}); {gib(free_bytes(device))} free now. To fix: lower --max-prefill-length / "
            f"--max-running-requests, or free device memory, or --moe-backend offload.") from None
    graph_bytes = 0
    if device.type == "cuda":
        runner.capture_graphs()
        graph_bytes = runner.graph_bytes
    runner.close()
    del runner, pool, state_pool
    release_cached(device)
    if peak is not None:
        return Workspace(peak, "measured", graph_bytes, progress)
    return Workspace(_estimate(mcfg, shape, dtype), "estimated", graph_bytes, progress)


def _estimate(mcfg: ModelConfig, shape: WarmupShape, dtype: torch.dtype) -> int:
    """The CPU's workspace estimate at ``shape`` (``memory/probe.estimate_workspace`` plus the model's extra)."""
    est = estimate_workspace(hidden_size=mcfg.hidden_size, intermediate_size=mcfg.moe_intermediate_size
                             if mcfg.is_moe else mcfg.intermediate_size, num_heads=mcfg.num_heads,
                             num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim, vocab_size=mcfg.vocab_size,
                             num_experts_per_tok=mcfg.num_experts_per_tok, prefill_tokens=shape.prefill_tokens,
                             decode_seqs=shape.max_running_requests, max_model_len=shape.max_model_len,
                             dtype_bytes=torch.empty((), dtype=dtype).element_size())
    extra = getattr(get_model_class(mcfg.architecture), "workspace_extra_bytes", None)
    if extra is not None:   # e.g. the chunk form's scratch of the Gated DeltaNet layers at the largest chunk
        est += int(extra(mcfg, shape.prefill_tokens))
    return est
