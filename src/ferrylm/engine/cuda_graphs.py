"""One CUDA graph per decode step, keyed by padded batch size only.

For a model whose every kernel can run without a host decision inside the step (dense models, and MoE models whose
expert executor computes on the device through the fused kernel: ``ExpertExecutor.graph_safe``, the resident
backend on CUDA), a decode step of ``B`` sequences replays the graph of the smallest captured size ``B_pad >= B``
(1, 2, 4, 8, ... up to the largest): the model's own ``forward`` and ``compute_logits``, captured as they are (the
forward is written once; nothing here re-implements it), reading static input buffers the step fills with one
host->device copy (``engine/step_inputs.py``; padding sequences write no K/V and attend to nothing).

Hybrid models (linear-attention layers, ``engine/cache/state_pool.py``): each captured size also holds static ``[B]``
buffers of the rows' state slots and fresh flags (a :class:`~ferrylm.engine.cache.state_pool.RecurrentStep` the linear
layers read through the backend); a replay fills them with one small copy, padding rows pointing at the pool's
scratch slot. The linear layers' decode update is torch ops on those buffers (no host read), so it captures as is.

Graphs are captured at boot (``capture_all``), largest first, into one memory pool; their bytes are measured and
counted in the memory plan. A size whose capture fails for lack of memory is disabled and captured again on its
first use after ``RETRY_AFTER_S`` (a transient shortage costs speed for a while, never a restart); any other
capture failure turns graphs off for the process, with the reason logged.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass

import torch

from ferrylm.engine.attention.metadata import AttentionMetadata, decode_splits
from ferrylm.engine.attention.triton_backend import TritonPagedAttention
from ferrylm.engine.cache.kv_pool import KVPool
from ferrylm.engine.step_inputs import HostStep, PackLayout, Staging, bind_routing_keys, pack_step
from ferrylm.memory.guard import is_oom

log = logging.getLogger("ferrylm.engine")

RETRY_AFTER_S = 30.0  # seconds before a size whose capture ran out of memory is tried again


def graph_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes: powers of two below ``max_batch``, then ``max_batch`` itself (ascending)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return sizes


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool):
    """Capture into ``graph`` (memory from ``pool``, a ``torch.cuda.graph_pool_handle()``): ``torch.cuda.graph``
    with errors of this thread only, and Python's garbage collector held off for the capture: a collection inside
    it can free a page-locked tensor, whose free records a CUDA event (an operation a capturing stream refuses,
    which invalidates the whole capture). Raises what the capture raises; the collector is restored either way."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class _Captured:
    """A captured size: its static packed inputs, metadata, output logits and graph."""

    size: int
    layout: PackLayout
    packed: torch.Tensor          # [layout.size] int64 device
    meta: AttentionMetadata
    logits: torch.Tensor | None = None   # [size, V] float32, written by each replay
    graph: torch.cuda.CUDAGraph | None = None
    recurrent: object | None = None      # RecurrentStep over static slot / fresh buffers (hybrid models)
    state_rows: torch.Tensor | None = None   # [2, size] int64 device: slots, then fresh flags (0/1)


class StepGraphs:
    """Captures and replays whole decode steps (module docstring).

    Args:
        model: the ferrylm model (``forward(ids, positions, attn)``, ``compute_logits``).
        pool: the KV pool.
        device: a CUDA device.
        max_batch: the largest captured batch (``--cuda-graph-max-batch``, default ``--max-running-requests``).
        max_model_len: longest sequence (tokens): the block table's width.
        on_replay: called with the padded size after each replay (the expert executor counts the step).
    """

    def __init__(self, model, pool: KVPool, device: torch.device, max_batch: int, max_model_len: int,
                 on_replay=None):
        self.model = model
        self.pool = pool
        self.device = device
        self.sizes = graph_sizes(max_batch) or [max(1, max_batch)]
        self.pages = -(-max_model_len // pool.page_size)
        self.on_replay = on_replay
        self.mode = "cuda"
        self._graphs: dict[int, _Captured] = {}
        self._retry_at: dict[int, float] = {}
        self._pool_handle = None
        props = torch.cuda.get_device_properties(device)
        self._sms = props.multi_processor_count
        self._hkv = max(1, pool.layout.k_heads)
        self.captures = 0
        self.replays = 0
        self.graph_bytes = 0
        self.state_pool = None   # the engine's StatePool for hybrid models (set before the first capture)
        self._state_host: torch.Tensor | None = None   # pinned [2, max size] staging of the slot / fresh rows

    @property
    def enabled(self) -> bool:
        return self.mode == "cuda"

    def size_for(self, batch: int) -> int | None:
        """The captured size a decode step of ``batch`` sequences replays, capturing it first when it was not captured
        yet (or was disabled and its retry time has come); None when it runs eagerly."""
        if not self.enabled or batch > self.sizes[-1]:
            return None
        size = next(s for s in self.sizes if s >= batch)
        if size not in self._graphs:
            if time.monotonic() < self._retry_at.get(size, 0.0):
                return None
            self._capture(size)
        return size if size in self._graphs else None

    def capture_all(self) -> None:
        """Capture every size, largest first (smaller graphs reuse the pool's blocks)."""
        for size in reversed(self.sizes):
            if not self.enabled:
                return
            self._capture(size)
        log.info("captured decode CUDA graphs for batch sizes %s: %.1f MiB", sorted(self._graphs),
                 self.graph_bytes / 2**20)

    def replay(self, seqs, staging: Staging, size: int) -> tuple[torch.Tensor, HostStep]:
        """Run a decode step of ``seqs`` (one new token each) through the graph of ``size``: returns the static
        ``[size, V]`` float32 logits (rows of the real sequences first; read before the next step) and the packed
        host step."""
        cap = self._graphs[size]
        host = pack_step(seqs, self.pool.page_size, staging.next(cap.layout.size), pad_seqs=size - len(seqs),
                         pages=self.pages)
        staging.to_device(host, cap.packed)
        if cap.recurrent is not None:
            self._fill_state_rows(cap, seqs)
        cap.graph.replay()
        self.replays += 1
        if self.on_replay is not None:
            self.on_replay(size)
        return cap.logits, host

    def recurrent_of(self, size: int):
        """The static :class:`~ferrylm.engine.cache.state_pool.RecurrentStep` of a captured size (None without state)."""
        cap = self._graphs.get(size)
        return None if cap is None else cap.recurrent

    def _static(self, size: int) -> _Captured:
        layout = PackLayout(tokens=size, seqs=size, pages=self.pages, samples=size)
        packed = torch.zeros(layout.size, dtype=torch.int64, device=self.device)
        v = layout.views(packed)
        v["slot_mapping"].fill_(-1)
        v["query_start_loc"].copy_(torch.arange(size + 1, device=self.device))
        meta = AttentionMetadata(slot_mapping=v["slot_mapping"], block_table=v["block_table"],
                                 seq_lens=v["seq_lens"], query_start_loc=v["query_start_loc"], max_query_len=1,
                                 num_splits=decode_splits(size, self._hkv, self._sms))
        cap = _Captured(size=size, layout=layout, packed=packed, meta=meta)
        if self.state_pool is not None:
            from ferrylm.engine.cache.state_pool import RecurrentStep

            rows = torch.empty(2, size, dtype=torch.int64, device=self.device)
            rows[0].fill_(self.state_pool.scratch)
            rows[1].fill_(1)
            cap.state_rows = rows
            cap.recurrent = RecurrentStep(pool=self.state_pool, slots=rows[0], fresh=rows[1] == 1,
                                          query_start_loc=v["query_start_loc"], num_tokens=size, q_lens=None)
        return cap

    def _fill_state_rows(self, cap: _Captured, seqs) -> None:
        """Write the real rows' state slots and fresh flags (a decode continuing from token ``start > 0`` is never
        fresh) into the static buffers; padding rows read and write the scratch slot, as zeros."""
        size = cap.size
        if self._state_host is None or self._state_host.shape[1] < size:
            self._state_host = torch.empty(2, max(self.sizes), dtype=torch.int64, pin_memory=True)
        h = self._state_host[:, :size]
        h[0].fill_(self.state_pool.scratch)
        h[1].fill_(1)
        n = len(seqs)
        h[0, :n] = torch.tensor([s.request.state_slot for s in seqs], dtype=torch.int64)
        h[1, :n] = torch.tensor([1 if s.start == 0 else 0 for s in seqs], dtype=torch.int64)
        cap.state_rows.copy_(h, non_blocking=True)
        # NOTE: the graph reads the static bool buffer ``fresh`` (made at capture), refreshed here in place
        cap.recurrent.fresh.copy_(cap.state_rows[1] == 1)

    def _run(self, cap: _Captured) -> torch.Tensor:
        v = cap.layout.views(cap.packed)
        bind_routing_keys(self.model, v["routing_keys"])  # the graph reads its static keys
        attn = TritonPagedAttention(self.pool, cap.meta)
        if cap.recurrent is not None:
            from ferrylm.engine.cache.state_pool import WithRecurrentState

            cap.recurrent.conv_index = None   # computed inside the graph, from the static offsets
            attn = WithRecurrentState(attn, cap.recurrent)
        hidden = self.model(v["input_ids"], v["positions"], attn)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        failed: BaseException | None = None
        try:
            cap = self._static(size)
            self._run(cap)  # warm-up on padding-only inputs (writes no K/V): compiles and autotunes the kernels
            torch.cuda.synchronize(self.device)
            if self._pool_handle is None:
                self._pool_handle = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with graph_capture(g, self._pool_handle):
                cap.logits = self._run(cap)
            cap.graph = g
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: the step runs eagerly instead
            failed = e
        finally:
            rotary = getattr(getattr(self.model, "model", None), "rotary", None)
            if rotary is not None:
                rotary.clear_tables()  # no lookup cache pointing at the static positions
        if failed is not None:
            oom = is_oom(failed)
            log.warning("decode CUDA graph capture for batch size %d failed (%s: %s)%s", size,
                        "out of memory" if oom else type(failed).__name__, str(failed).split("\n")[0][:200],
                        f"; retried in {RETRY_AFTER_S:g} s" if oom else "; decode graphs are off")
            if oom:
                self._retry_at[size] = time.monotonic() + RETRY_AFTER_S
            else:
                self.mode = "off"
                self._graphs.clear()
            _check_rng(self.device)
            return
        self._graphs[size] = cap
        self._retry_at.pop(size, None)
        self.captures += 1
        self.graph_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)

    def stats(self) -> dict:
        """``mode``, captured ``keys`` (batch sizes, as ``[size, 0]`` pairs for the piecewise runner's shape),
        ``captures``, ``replays`` (= ``steps``), ``graph_bytes``, ``stage_bytes`` (0)."""
        return {"mode": self.mode, "kind": "step", "keys": [[s, 0] for s in sorted(self._graphs)],
                "steps": self.replays, "captures": self.captures, "replays": self.replays,
                "graph_bytes": self.graph_bytes, "stage_bytes": 0, "staged_layers": 0, "unstaged_layers": 0}

    def close(self) -> None:
        self._graphs.clear()
        self._pool_handle = None


def _check_rng(device: torch.device) -> None:
    """A capture that failed midway can leave the CUDA generator in capture state (torch 2.11); probe it and raise
    so the engine restarts rather than fail every sampled request.

    Raises:
        RuntimeError: the generator no longer draws."""
    try:
        torch.cuda.synchronize(device)
        torch.rand(1, device=device)
    except RuntimeError as e:
        raise RuntimeError(f"a failed CUDA graph capture left the CUDA random generator unusable ({e}); the engine "
                           f"must restart (run with --enforce-eager if this repeats)") from e
