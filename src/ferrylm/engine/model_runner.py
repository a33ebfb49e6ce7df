"""The model runner: a scheduled batch in, sampled tokens out.

``Engine.step`` is schedule -> ``ModelRunner.execute`` -> output processing. The runner owns what a step needs on the
device: the staging buffers its inputs travel through (``engine/step_inputs.py``: one non-blocking host->device
copy per step), the attention backend (``engine/attention``), the CUDA graphs, and sampling. Per step it picks:

1. a whole-step CUDA graph (``engine/cuda_graphs.py``) for decode steps when the model has no host decision inside
   the step (dense, or an expert executor that is ``graph_safe``);
2. else the piecewise decode graphs (``engine/decode_graph.py``) for executors that decide copies per layer
   (offload, hybrid);
3. else the eager forward: the model's ``forward`` over the flattened batch with the step's attention backend.

All three run the model's own ``forward`` code except the piecewise runner, which still composes the layers itself
(hybrid, and offload where its device table cannot run). Before every step the executor's ``begin_step`` makes its
host decisions for the step: the offload backend's slot installs and table
(``experts/slot_table.py``), so its decode steps need no host decision inside and run as one graph.
"""

from __future__ import annotations

import functools
import logging

import torch

from ferrylm.config import EngineConfig
from ferrylm.engine import prompt_logprobs
from ferrylm.engine.attention import backend_factory, resolve_backend
from ferrylm.engine.attention.metadata import AttentionMetadata, decode_splits
from ferrylm.engine.cuda_graphs import StepGraphs
from ferrylm.engine.decode_graph import DecodeGraphConfig, DecodeGraphRunner
from ferrylm.engine.expert_choice import expert_options
from ferrylm.engine.cache.kv_pool import KVPool
from ferrylm.engine.sampler import SampleResult, sample
from ferrylm.engine.step_inputs import HostStep, Staging, bind_routing_keys, pack_step, routing_key
from ferrylm.faults import NO_FAULTS, FaultInjector
from ferrylm.memory.guard import is_oom
from ferrylm.models.capabilities import ModelCapabilities
from ferrylm.models.moe import SparseMoeBlock
from ferrylm.models.quant_linear import dense_kernel

log = logging.getLogger("ferrylm.engine")


def has_prefill(seqs) -> bool:
    """A step computes part of a prompt (a chunk of several tokens, or a request's first token)."""
    return any(s.num_tokens > 1 or s.start == 0 for s in seqs)


class ModelRunner:
    """Runs a batch through the model and samples (module docstring).

    Args:
        model: the ferrylm model.
        pool: the engine's KV pool.
        device, dtype: compute device and activation dtype.
        config: the engine config (``attention_backend``, ``decode_graphs``, ``cuda_graph_max_batch``, ...).
        max_model_len: the context limit (tokens).
        max_running_requests: the engine's (resolved) limit; decode graphs go up to it unless
            ``cuda_graph_max_batch`` says otherwise.
        expert_executor: the MoE executor (None: dense or a test double).
        eos_ids: EOS token ids (banned before ``min_tokens``).
        tp: rank 0's :class:`~ferrylm.engine.parallel.step_sync.StepBroadcaster` under tensor parallel (the
            followers run each step's forward on their shard: it is broadcast right before the forward); None for
            one rank. With it every step runs eager (CUDA graphs with the collectives inside: not yet).

    Raises:
        ValueError: an attention backend or graph mode that cannot run on ``device`` (message names the flag).
    """

    def __init__(self, model, pool: KVPool, device: torch.device, dtype: torch.dtype, config: EngineConfig,
                 max_model_len: int, expert_executor=None, eos_ids: tuple[int, ...] = (), tp=None, *,
                 max_running_requests: int):
        self.model = model
        self.pool = pool
        self.device = device
        self.dtype = dtype
        self.config = config
        self.executor = expert_executor
        self.eos_ids = eos_ids
        self.faults: FaultInjector = NO_FAULTS
        self.state_pool = None  # the engine's StatePool (engine/cache/state_pool.py) for models with linear layers
        self.last_recurrent = None  # the RecurrentStep of the last eager step (the engine's OOM recovery reads it)
        self.structured = None  # the engine's StructuredDecoder (engine/structured.py): grammar masks on the logits
        self.attention = resolve_backend(config.attention_backend, device)
        self._attention_backend = backend_factory(self.attention)   # a step's backend from (pool, meta, device, faults)
        if self.attention == "torch":  # on a CPU with the native kernels: decode attends over the pool in place
            kernel = dense_kernel(device, expert_options(config))
            if kernel is not None:
                self._attention_backend = functools.partial(self._attention_backend, native=kernel)
        self.max_model_len = max_model_len
        self.graph_max_batch = config.cuda_graph_max_batch or max_running_requests   # largest graph batch
        self.staging = Staging(device)
        self.step_graphs: StepGraphs | None = None
        self.piecewise: DecodeGraphRunner | None = None
        self.tp = tp
        self._tp_runner = tp.runner_id() if tp is not None else 0   # names this runner's KV pool to the followers
        self._graph_mode = "off" if tp is not None else DecodeGraphConfig(mode=config.decode_graphs).resolved(device)
        stack = getattr(model, "model", None)
        caps: ModelCapabilities = model.capabilities   # what the family allows (models/capabilities.py)
        self._is_stack = hasattr(stack, "layers") and caps.graph_capture
        self._piecewise = caps.piecewise_graphs
        self._moe0 = next((layer.mlp for layer in getattr(stack, "layers", [])
                           if isinstance(layer.mlp, SparseMoeBlock)), None)  # the first MoE block: its executor
        self._configure(self._model_executor())

    def _model_executor(self):
        """The executor the model's MoE blocks call now (benches swap it), else the one given."""
        return self._moe0.executor if self._moe0 is not None else self.executor

    def _configure(self, executor) -> None:
        """Choose the graph path for ``executor``: whole-step graphs when it is ``graph_safe`` (or the model is
        dense), else the piecewise runner (none for a model without ``capabilities.piecewise_graphs``); drop the graphs of the previous executor. Both carry the engine's
        recurrent-state pool for models with linear-attention layers (static slot buffers per graph row)."""
        self.close()
        self.executor = executor
        self.step_graphs = self.piecewise = None
        if self._graph_mode == "off" or not self._is_stack:
            return
        max_batch = self.graph_max_batch
        safe = executor is None or executor.graph_safe
        if self._graph_mode == "cuda" and self.attention == "triton" and safe:
            self.step_graphs = StepGraphs(self.model, self.pool, self.device, max_batch, self.max_model_len,
                                          on_replay=None if executor is None else executor.count_replayed_step)
        if self._piecewise and self.step_graphs is None:  # executors that decide on the host inside a step
            self.piecewise = DecodeGraphRunner(self.model, self.pool, self.device, DecodeGraphConfig(
                mode=self.config.decode_graphs, max_batch=max_batch,
                max_kv_len=self.config.cuda_graph_max_len), self.dtype, self.pool.page_size)
        self.attach_state_pool(self.state_pool)

    def attach_state_pool(self, pool) -> None:
        """Give the runner and its graph runners (before they capture) the engine's recurrent-state pool."""
        self.state_pool = pool
        for g in (self.step_graphs, self.piecewise):
            if g is not None:
                g.state_pool = pool

    def capture_graphs(self) -> None:
        """Capture the whole-step graphs now (boot, after the KV pool and the warmup). No-op without them."""
        if self.step_graphs is not None:
            self.step_graphs.capture_all()

    @property
    def graph_bytes(self) -> int:
        """Device bytes the captured graphs hold (their private memory pools)."""
        return sum(int(g.graph_bytes) for g in (self.step_graphs, self.piecewise) if g is not None)

    # --- the step ---------------------------------------------------------------------------------------------
    def execute(self, seqs) -> SampleResult | None:
        """Forward ``seqs`` (the scheduler's ``ScheduledSeq`` list) and sample the sequences that sample.

        Returns:
            the sampled tokens (one per sampling sequence, in order) or None when none samples.

        Raises:
            Allocation failures (``torch.OutOfMemoryError`` ...) from the forward, the logits or sampling: the
            engine's OOM guard handles them; the step's counters have not advanced.
        """
        if self._moe0 is not None and self._moe0.executor is not self.executor:
            self._configure(self._moe0.executor)  # the executor was swapped: its graphs are stale
        faults = self.faults
        self.last_recurrent = None
        if self.executor is not None:  # host decisions of the executor, made between steps (experts/slot_table.py)
            self.executor.begin_step(sum(s.num_tokens for s in seqs))
        logits = None
        decode = not has_prefill(seqs)
        if decode and not faults.enabled:
            logits = self._decode_graphed(seqs)
        if logits is None:
            logits = self._eager(seqs)
        to_sample = [s for s in seqs if s.sample]
        if not to_sample:
            return None
        reqs = [s.request for s in to_sample]
        if self.structured is not None:
            self.structured.mask_logits(logits, reqs)  # rows with a grammar; a no-op without any
        return sample(logits, reqs, self.eos_ids)

    def _decode_graphed(self, seqs) -> torch.Tensor | None:
        """Logits ``[N, V]`` of a decode step run through a graph (N = sampling sequences), or None when no graph
        takes it."""
        b = len(seqs)
        if self.step_graphs is not None:
            size = self.step_graphs.size_for(b)
            if size is not None:
                # a failed replay may have advanced the states (the engine then recomputes the requests)
                self.last_recurrent = self.step_graphs.recurrent_of(size)
                logits, host = self.step_graphs.replay(seqs, self.staging, size)
                return _rows(logits, host.sample_rows, b)
            return None
        g = self.piecewise
        longest = max(s.start + 1 for s in seqs)
        if g is None or not g.accepts(b, longest):
            return None
        failed = False
        slots = None
        if self.state_pool is not None:   # a failed run may have advanced states: the engine recomputes them
            slots = [s.request.state_slot for s in seqs]
            self.last_recurrent = _STATES_WRITTEN
        try:
            hidden = g.run([s.request.tokens(s.start, s.start + 1)[0] for s in seqs], [s.start for s in seqs],
                           [s.request.page_table for s in seqs], [routing_key(s.request) for s in seqs], slots)
        except Exception as e:  # a new key's buffers or first run did not fit: plain forward from now on
            if not is_oom(e):
                raise
            failed = True
        if failed:  # outside the except block: the failure's frames and tensors are gone
            g.disable(b, longest)
            if self.state_pool is not None:
                # NOTE: not the plain forward in this step: linear layers may have advanced their states already;
                # the engine's OOM handling preempts the requests whose state was lost
                raise torch.OutOfMemoryError(f"decode graph buffers for batch {b} did not fit (recurrent states "
                                             f"may be advanced)")
            return None
        rows = [i for i, s in enumerate(seqs) if s.sample]
        sel = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=hidden.device)]
        self._check_logits(len(rows))
        return self.model.compute_logits(sel).float()

    def _eager(self, seqs) -> torch.Tensor:
        """The plain forward of a step: logits ``[N, V]`` float32 of the sampling sequences' last tokens."""
        faults = self.faults
        host = pack_step(seqs, self.pool.page_size, self.staging.next(_packed_bound(seqs)))
        dev = self.staging.to_device(host)
        v = host.layout.views(dev)
        if faults.enabled:
            prefill = has_prefill(seqs)
            faults.set_step(max(s.request.num_prompt_tokens for s in seqs), "prefill" if prefill else "decode")
            if prefill:
                faults.check("prefill_workspace", nbytes=8 * host.num_tokens * self.model.config.hidden_size
                             * torch.empty((), dtype=self.dtype).element_size())
        attn = self._attention_backend(self.pool, self._metadata(host, v), self.device, faults)
        if self.state_pool is not None:  # linear layers reach their sequences' states through the backend
            from ferrylm.engine.cache.state_pool import WithRecurrentState, recurrent_step

            rs = recurrent_step(self.state_pool, seqs, v["query_start_loc"], self.device)
            rs.faults = faults
            self.last_recurrent = rs
            attn = WithRecurrentState(attn, rs)
        bind_routing_keys(self.model, v["routing_keys"])
        if self.tp is None:
            hidden = self.model(v["input_ids"], v["positions"], attn)
        else:
            hidden = self._forward_tp(host, v, attn)
        prompt_logprobs.collect(seqs, hidden, self.model.compute_logits)  # only when a request asked for them
        rows = host.sample_rows
        if not rows:
            return hidden[:0]
        self._check_logits(len(rows))
        sel = hidden if len(rows) == hidden.shape[0] else hidden[v["sample_rows"]]
        return self.model.compute_logits(sel).float()

    def _forward_tp(self, host: HostStep, v: dict[str, torch.Tensor], attn) -> torch.Tensor:
        """The forward under tensor parallel: broadcast the step to the followers, then run it (its all-reduces
        meet theirs).

        Raises:
            TensorParallelError: the broadcast failed, or the forward ran out of memory: the followers may be inside
                the step's collectives, so the step can be neither retried nor shrunk by the OOM guard; the worker
                reports it and the group is restarted. Other errors (a sticky device error ...) pass unchanged,
                as fatal as at TP = 1.
        """
        from ferrylm.engine.parallel.group import oom_inside_step

        self.tp.send_step(self._tp_runner, self.pool.num_pages, self.pool.page_size, host, self.staging.current())
        try:
            hidden = self.model(v["input_ids"], v["positions"], attn)
        except Exception as e:
            if not is_oom(e):
                raise
            oom = type(e).__name__
        else:
            self.tp.step_done()
            return hidden
        raise oom_inside_step(oom)   # outside the except block: the failed step's frames are gone

    def _metadata(self, host: HostStep, v: dict[str, torch.Tensor]) -> AttentionMetadata:
        return step_metadata(host, v, self.device, self.attention, self.pool)

    def _check_logits(self, n: int) -> None:
        if self.faults.enabled:
            self.faults.check("logits", nbytes=4 * n * self.model.config.vocab_size)

    # --- bookkeeping ------------------------------------------------------------------------------------------
    def stats(self) -> dict | None:
        """The graphs' stats (``decode_graphs`` in the engine's stats), or None without graphs: the whole-step
        graphs' when there are any (with the piecewise runner's under ``piecewise`` when both serve), else the
        piecewise runner's."""
        if self.step_graphs is None:
            return None if self.piecewise is None else self.piecewise.stats()
        d = self.step_graphs.stats()
        if self.piecewise is not None:
            d["piecewise"] = self.piecewise.stats()
        return d

    def close(self) -> None:
        for g in (self.step_graphs, self.piecewise):
            if g is not None:
                g.close()


class _Written:
    """Stands for a recurrent step whose states were (possibly) written: what the engine's OOM recovery reads."""

    written = True


_STATES_WRITTEN = _Written()


def step_metadata(host: HostStep, v: dict[str, torch.Tensor], device: torch.device, attention: str,
                  pool: KVPool) -> AttentionMetadata:
    """The attention metadata of an eager step: the packed views ``v`` (on ``device``) and the host figures of
    ``host``; split-KV decode for the Triton backend on CUDA. Shared by rank 0 and the tensor-parallel followers."""
    splits = 1
    if host.max_query_len == 1 and device.type == "cuda" and attention == "triton":
        splits = decode_splits(host.num_seqs, max(1, pool.layout.k_heads),
                               torch.cuda.get_device_properties(device).multi_processor_count)
    return AttentionMetadata(slot_mapping=v["slot_mapping"], block_table=v["block_table"],
                             seq_lens=v["seq_lens"], query_start_loc=v["query_start_loc"],
                             max_query_len=host.max_query_len, num_splits=splits, host_seqs=host.host_seqs)


def _rows(logits: torch.Tensor, rows: list[int], batch: int) -> torch.Tensor:
    """The sampling rows of a graph's static logits (all of the first ``batch`` rows when every sequence samples)."""
    if rows == list(range(batch)):
        return logits[:batch]
    return logits[torch.tensor(rows, device=logits.device)]


def _packed_bound(seqs) -> int:
    """An upper bound of a step's packed size (int64 elements), for the staging buffer."""
    t = sum(s.num_tokens for s in seqs)
    b = len(seqs)
    p = max((len(s.request.page_table) for s in seqs), default=1)
    return 4 * t + 3 * b + 1 + b * max(1, p)
