"""Piecewise CUDA graphs for decode steps.

A decode step of a MoE model on the GPU is bound by the host: ~45 small kernels per layer (norms, q/k/v, RoPE, the
KV write, attention, the router), each costing more host time to launch than the GPU takes to run it. Capturing them
in CUDA graphs turns each run of kernels into one launch (the idea of vLLM's and SGLang's CUDA graphs; piecewise, as
vLLM's piecewise capture, because the routed experts cannot be captured: which experts are missing, what to copy and
where is decided on the host from the router's output every layer).

One decode step is cut at every MoE layer's experts. Piece ``j`` runs, inside one graph:
  * its input: the token embedding (piece 0) or ``resid + moe_out (+ shared)`` of the previous MoE layer;
  * every dense decoder layer up to the next MoE layer (whole);
  * that MoE layer's attention half (``DecoderLayer.attention_residual``), its post-attention norm, its router
    (top-k ids and weights), its shared expert, and the next MoE layer's predicted experts when the executor
    prefetches (``ExpertExecutor.next_layer_predictor``).
Between two pieces the executor runs eagerly (``ExpertExecutor.run`` with the piece's prediction) and its output is copied into the one
static ``moe_out`` buffer the next piece reads. The last piece ends with the final norm.

Executors with a ``stage_layout`` (offload, hybrid) go further (``ExpertExecutor.run`` with a ``stage``): once a layer's experts are
resident they stack the experts' slot rows into a static :class:`~ferrylm.experts.work.ExpertStage` and copy one
index, and the NEXT piece computes the expert GEMMs, the weighting and the per-token sum
(:func:`~ferrylm.experts.work.staged_moe_output`) inside its graph; so between two graph launches the host only
plans, issues copies and stacks rows. A layer the executor computes itself (waves, CPU work) reaches the piece
through the stage's ``extra`` buffer, the staged sum made exactly zero. Stages exist for batch sizes whose
``min(B * k, E)`` expert rows fit ``STAGE_MAX_BYTES``.

Graphs need fixed shapes and addresses. They are keyed by the batch size ``B`` (exact: padding tokens would route
to experts and cost real copies) and a KV-length bucket ``L`` (powers of two from ``MIN_KV_BUCKET`` tokens):
attention gathers each sequence's first ``L`` cache slots through a ``[B, L]`` slot table (expanded inside the graph
from the sequences' page tables, padded with their first page) and masks the slots past the sequence's length. GQA attention runs with the query heads of one KV head as that head's query rows
(``[B, Hkv, G, D]`` against ``[B, Hkv, L, D]``), so K/V are never expanded. The step's inputs (token ids, positions,
lengths, page tables) reach the device in one host->device copy into a static buffer; RoPE rows are written into
static buffers in piece 0 and bound to the model's rotary module (``RotaryEmbedding.bind_tables``).

The first step of a key runs the pieces eagerly (warm-up: cuBLAS handles, kernels chosen) and then captures them;
later steps of that key replay. Mode ``eager`` runs the same pieces without capture (CPU tests, debugging), so the
piece logic is checked in CI. Graphs of all keys share one memory pool; a capture that runs out of memory disables
the graphs for that key (the step runs eagerly) and is logged: graphs are an optimisation, never a failure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ferrylm.config import DECODE_GRAPH_MODES
from ferrylm.engine.attention.torch_backend import StaticDecodeAttention
from ferrylm.engine.cache.kv_pool import KVPool
from ferrylm.engine.cuda_graphs import graph_capture
from ferrylm.engine.step_inputs import bind_routing_keys
from ferrylm.experts.work import SMALL_STEP_TOKENS, ExpertStage, is_small_step, staged_moe_output
from ferrylm.memory.guard import is_oom

log = logging.getLogger("ferrylm.engine")

MIN_KV_BUCKET = 256     # tokens: the smallest KV-length bucket
STAGE_MAX_BYTES = 128 << 20  # bytes: expert staging rows of one batch size at most (else its experts run eagerly)


@dataclass(frozen=True)
class DecodeGraphConfig:
    """How decode steps are run.

    Attributes:
        mode: ``auto`` (CUDA graphs on a CUDA device, off elsewhere), ``off`` (the plain eager forward; serve flag
            ``--enforce-eager``), ``eager`` (the piecewise path without capture: tests, debugging), ``cuda``
            (CUDA graphs; needs a CUDA device).
        max_batch: largest decode batch run through graphs (sequences); larger batches run the plain forward.
        max_kv_len: largest KV-length bucket (tokens); longer sequences run the plain forward.
    """

    mode: str = "auto"
    max_batch: int = 16
    max_kv_len: int = 8192

    def resolved(self, device: torch.device) -> str:
        """``off``, ``eager`` or ``cuda`` for ``device``. Raises ValueError for an unknown mode or ``cuda`` on a
        device that is not CUDA."""
        if self.mode not in DECODE_GRAPH_MODES:
            raise ValueError(f"decode graph mode must be one of {DECODE_GRAPH_MODES}, got {self.mode!r}")
        if self.mode == "auto":
            return "cuda" if device.type == "cuda" else "off"
        if self.mode == "cuda" and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device (use --enforce-eager on this device)")
        return self.mode


def kv_bucket(num_tokens: int) -> int:
    """The KV-length bucket (tokens) of a sequence holding ``num_tokens`` tokens: the smallest power of two
    ``>= max(num_tokens, MIN_KV_BUCKET)``."""
    b = MIN_KV_BUCKET
    while b < num_tokens:
        b *= 2
    return b


@dataclass
class _Piece:
    """One graph's worth of a decode step: dense layers ``dense`` (whole), then MoE layer ``moe`` (its attention
    half and router; None for the last piece)."""

    dense: list[int]
    moe: int | None


@dataclass
class _Keyed:
    """Static buffers, piece outputs and graphs of one ``(B, L)`` key."""

    batch: int
    kv_len: int
    pages: int                           # page-table columns: ceil(L / page_size)
    packed: torch.Tensor                 # [B * (4 + pages)] int64: ids | positions | lengths | page tables | keys
    cos: torch.Tensor                    # [B, D] RoPE rows (activation dtype)
    sin: torch.Tensor
    moe_out: torch.Tensor                # [B, H] the last MoE layer's routed output (written between pieces)
    stage: ExpertStage | None = None     # staged expert GEMMs (computed in the next piece), see below
    outputs: list[dict] = field(default_factory=list)   # per piece: the tensors it produced
    graphs: list | None = None
    state_slots: torch.Tensor | None = None   # [B] int64 recurrent-state slot of each row (hybrid models)

    @property
    def ids(self) -> torch.Tensor:
        return self.packed[:self.batch]

    @property
    def positions(self) -> torch.Tensor:
        return self.packed[self.batch:2 * self.batch]

    @property
    def lengths(self) -> torch.Tensor:
        return self.packed[2 * self.batch:3 * self.batch]

    @property
    def page_table(self) -> torch.Tensor:
        """``[B, pages]`` each sequence's pages, padded with its first page."""
        return self.packed[3 * self.batch:(3 + self.pages) * self.batch].view(self.batch, self.pages)

    @property
    def routing_keys(self) -> torch.Tensor:
        """``[B]`` each sequence's routing key (a synthetic model's routing model; ``step_inputs.routing_key``)."""
        return self.packed[(3 + self.pages) * self.batch:]


class DecodeGraphRunner:
    """Runs decode-only steps of a ferrylm decoder (``LlamaForCausalLM`` and its subclasses) piecewise, with the
    pieces captured in CUDA graphs (module docstring).

    Args:
        model: the model (``model.model`` a ``DecoderStack``: ``embed_tokens``, ``layers``, ``norm``, ``rotary``;
            MoE layers' ``mlp`` a ``SparseMoeBlock``).
        pool: the engine's KV pool.
        device: the compute device.
        config: :class:`DecodeGraphConfig`.
        dtype: activation dtype.
        page_size: tokens per KV page.

    Raises:
        ValueError: see :meth:`DecodeGraphConfig.resolved`.
    """

    def __init__(self, model, pool: KVPool, device: torch.device, config: DecodeGraphConfig, dtype: torch.dtype,
                 page_size: int):
        from ferrylm.models.moe import SparseMoeBlock

        self.mode = config.resolved(device)
        self.config = config
        self.model = model
        self.stack = model.model
        self.pool = pool
        self.device = device
        self.dtype = dtype
        self.page_size = page_size
        self.state_pool = None    # the engine's StatePool for models with linear-attention layers (set before use)
        self._keys: dict[tuple[int, int], _Keyed] = {}
        self._stages: dict[int, ExpertStage | None] = {}  # batch size -> its stage (shared by its KV buckets)
        self._stage_rows: torch.Tensor | None = None       # the rows every batch size's stage views
        self._broken: set[tuple[int, int]] = set()         # keys disabled after an allocation failure
        self._pool_handle = None
        self.steps = 0      # decode steps run here (eager pieces or replays)
        self.captures = 0
        self.replays = 0
        self.graph_bytes = 0      # device bytes the captures reserved (graph pool), measured at each capture
        self.staged_layers = 0    # MoE layer steps whose expert GEMMs ran in the next piece (ExpertStage)
        self.unstaged_layers = 0  # ... that a staging executor computed eagerly instead (e.g. in waves)
        pieces, dense = [], []
        for i, layer in enumerate(self.stack.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                pieces.append(_Piece(dense, i))
                dense = []
            else:
                dense.append(i)
        pieces.append(_Piece(dense, None))
        self.pieces = pieces
        first = next((p.moe for p in pieces if p.moe is not None), None)
        self._moe0 = None if first is None else self.stack.layers[first].mlp  # the first MoE block (its executor)
        self._sig = self._signature()

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def accepts(self, batch: int, max_tokens: int) -> bool:
        """True when a decode step of ``batch`` sequences, the longest holding ``max_tokens`` tokens (its new one
        included), runs here."""
        return (self.enabled and 1 <= batch <= self.config.max_batch and max_tokens <= self.config.max_kv_len
                and not self._keys_broken(batch, max_tokens))

    def _keys_broken(self, batch: int, max_tokens: int) -> bool:
        return (batch, kv_bucket(max_tokens)) in self._broken

    def stats(self) -> dict:
        """``mode``, graph ``keys`` ``[batch, KV bucket]`` captured now, ``steps`` run here, ``captures`` and
        ``replays`` so far, MoE layer steps ``staged_layers`` / ``unstaged_layers``, device bytes of the graph pool
        (``graph_bytes``, measured at capture) and of the expert stages (``stage_bytes``). Neither is part of the
        boot memory plan: they are allocated on first use of a key (the stages' rows: one buffer of at most
        ``STAGE_MAX_BYTES``); a capture that runs out of memory leaves its key eager."""
        keys = list(self._keys.items())  # stats() may run on the heartbeat thread while a step adds a key
        return {"mode": self.mode, "keys": sorted([k[0], k[1]] for k, v in keys if v.graphs),
                "steps": self.steps, "captures": self.captures, "replays": self.replays,
                "staged_layers": self.staged_layers, "unstaged_layers": self.unstaged_layers,
                "graph_bytes": self.graph_bytes,
                "stage_bytes": (0 if self._stage_rows is None else self._stage_rows.nbytes)
                + sum(st.index.nbytes + st.extra.nbytes for st in list(self._stages.values()) if st is not None)}

    # --- the step -----------------------------------------------------------------------------------------------
    def run(self, token_ids: list[int], positions: list[int], page_tables: list[list[int]],
            routing_keys: list[int] | None = None, state_slots: list[int] | None = None) -> torch.Tensor:
        """Decode one new token per sequence.

        Args:
            token_ids: ``[B]`` the new token of each sequence.
            positions: ``[B]`` its position (= tokens already cached).
            page_tables: each sequence's KV pages (covering ``positions[b] + 1`` tokens).
            routing_keys: ``[B]`` each sequence's routing key (synthetic models' routing model; default 0).
            state_slots: ``[B]`` each sequence's recurrent-state slot (models with linear-attention layers, whose
                runner has a ``state_pool``): the linear layers read and write them (fresh when the position is 0).

        Returns:
            ``[B, H]`` final-normed hidden states (a static buffer: read it before the next step).

        Raises:
            torch.OutOfMemoryError (or another allocation failure) while a new key's buffers are made or its
            first, eager run needs memory: the caller may mark the key broken (:meth:`disable`) and run the plain
            forward instead.
        """
        if self._stale():  # before any key is looked up: no graph of the old signature may run
            self.reset()
        b = len(token_ids)
        lens = [p + 1 for p in positions]
        key = self._key(b, kv_bucket(max(lens)))
        table: list[int] = []
        for pt in page_tables:  # page tables padded with their first page (those slots are masked)
            table.extend(pt[:key.pages] + [pt[0]] * (key.pages - len(pt)))
        keys = list(routing_keys) if routing_keys is not None else [0] * b
        host = torch.tensor(list(token_ids) + list(positions) + lens + table + keys, dtype=torch.int64)
        key.packed.copy_(host, non_blocking=False)
        if key.state_slots is not None:
            key.state_slots.copy_(torch.tensor(state_slots, dtype=torch.int64), non_blocking=False)
        if key.graphs is not None:
            out = self._replay(key)
        else:
            out = self._run_pieces(key)
            if self.mode == "cuda":
                self._capture(key)
        self.steps += 1
        return out

    def disable(self, batch: int, max_tokens: int) -> None:
        """Run decode steps of ``batch`` sequences in the KV bucket of ``max_tokens`` with the plain forward from
        now on (after :meth:`run` raised an allocation failure for them, or their capture ran out of memory)."""
        kv = kv_bucket(max_tokens)
        self._broken.add((batch, kv))
        self._keys.pop((batch, kv), None)
        log.warning("decode graphs for batch %d, KV bucket %d tokens disabled after an allocation failure; those "
                    "steps run the plain forward", batch, kv)

    def _key(self, batch: int, kv_len: int) -> _Keyed:
        k = self._keys.get((batch, kv_len))
        if k is None:
            cfg = self.stack.rotary
            h = self.stack.embed_tokens.weight.shape[1]
            pages = -(-kv_len // self.page_size)
            k = _Keyed(batch=batch, kv_len=kv_len, pages=pages,
                       packed=torch.zeros(batch * (4 + pages), dtype=torch.int64, device=self.device),
                       cos=torch.zeros(batch, cfg.head_dim, dtype=self.dtype, device=self.device),
                       sin=torch.zeros(batch, cfg.head_dim, dtype=self.dtype, device=self.device),
                       moe_out=torch.zeros(batch, h, dtype=self.dtype, device=self.device))
            if self.state_pool is not None:   # linear-attention layers: each row's state slot, filled per step
                k.state_slots = torch.full((batch,), self.state_pool.scratch, dtype=torch.int64, device=self.device)
            self._keys[(batch, kv_len)] = k  # before the stage: a failure there still marks the key
            k.stage = self._stage_for(batch)
        return k

    def _stage_for(self, batch: int) -> ExpertStage | None:
        """The expert stage of ``batch`` when the executor stages (offload, hybrid), the step is planned on the host
        (``is_small_step``) and its ``min(B * k, E)`` rows fit the shared rows buffer (at most
        ``STAGE_MAX_BYTES``, allocated once for the largest batch that can stage); else None (the experts' output
        reaches the next piece through ``moe_out``)."""
        if batch in self._stages:
            return self._stages[batch]
        mlp = self._moe0
        stage = None
        layout = None if mlp is None else mlp.executor.stage_layout
        if layout is not None and is_small_step(batch):
            k, e = mlp.top_k, mlp.num_experts
            cap = min(SMALL_STEP_TOKENS * k, e, STAGE_MAX_BYTES // layout.nbytes)
            m = min(batch * k, e)
            if m <= cap:
                if self._stage_rows is None:
                    self._stage_rows = torch.zeros(cap, layout.numel, dtype=layout.row_dtype, device=self.device)
                stage = ExpertStage.create(self._stage_rows[:m], layout, batch, k,
                                           self.stack.embed_tokens.weight.shape[1], self.dtype)
        self._stages[batch] = stage
        return stage

    def _run_pieces(self, key: _Keyed) -> torch.Tensor:
        """Run every piece eagerly (the executor between them); records each piece's outputs in ``key``."""
        key.outputs = []
        for j in range(len(self.pieces)):
            key.outputs.append(self._piece(key, j))
            self._experts(key, j)
        return key.outputs[-1]["hidden"]

    def _replay(self, key: _Keyed) -> torch.Tensor:
        for j, g in enumerate(key.graphs):
            g.replay()
            self._experts(key, j)
        self.replays += 1
        return key.outputs[-1]["hidden"]

    def _experts(self, key: _Keyed, j: int) -> None:
        """The routed experts of piece ``j``'s MoE layer, eagerly, into ``key.moe_out``."""
        piece = self.pieces[j]
        if piece.moe is None:
            return
        o = key.outputs[j]
        stage = key.stage
        out = self.stack.layers[piece.moe].mlp.executor.run(piece.moe, o["normed"], o["ids"], o["weights"],
                                                            ids_and_predicted=o.get("planned"), stage=stage)
        if stage is None:
            key.moe_out.copy_(out)
        elif out is None:  # staged: the next piece computes the experts
            self.staged_layers += 1
            stage.set_staged()
        else:              # computed eagerly (waves, CPU work)
            self.unstaged_layers += 1
            stage.set_eager(out)

    def _piece(self, key: _Keyed, j: int) -> dict:
        """The kernels of piece ``j`` on ``key``'s static buffers (captured as one graph). Returns its outputs."""
        stack, piece = self.stack, self.pieces[j]
        pos = key.positions
        out: dict = {}
        if j == 0:  # the step's RoPE rows and attention indices, once: every later piece reads them
            bind_routing_keys(self.model, key.routing_keys)
            stack.rotary.fill_tables(pos, key.cos, key.sin)
            x = stack.embed_tokens(key.ids)
            out["attn"] = attn = self._attention(key)
        else:
            prev = key.outputs[j - 1]
            routed = key.moe_out if key.stage is None else \
                staged_moe_output(key.stage, prev["normed"], prev["weights"])
            shared = prev.get("shared")  # the order of SparseMoeBlock.forward: resid + (routed + shared)
            x = prev["resid"] + (routed if shared is None else routed + shared)
            attn = key.outputs[0]["attn"]
        stack.rotary.bind_tables(pos, key.cos, key.sin)
        for i in piece.dense:
            x = stack.layers[i](pos, x, attn)
        if piece.moe is None:
            out["hidden"] = stack.norm(x)
            return out
        layer = stack.layers[piece.moe]
        h = layer.attention_residual(pos, x, attn)
        normed = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        ids, weights = mlp.route(normed)
        out.update(resid=h, normed=normed, ids=ids, weights=weights, shared=mlp.shared_output(normed))
        predict = mlp.executor.next_layer_predictor(piece.moe, key.batch)
        if predict is not None:
            out["planned"] = torch.cat([ids, predict(normed)])
        return out

    def _attention(self, key: _Keyed):
        """The step's attention backend from ``key``'s page tables and lengths: slot table ``[B, L]`` (each page
        expanded to its slots), the new tokens' slots, the ``[B, L]`` mask of held positions; for a hybrid model
        wrapped with the rows' recurrent state (``engine/cache/state_pool.py``: static slots, fresh where the position
        is 0)."""
        ps = self.page_size
        slot_table = (key.page_table[:, :, None] * ps + torch.arange(ps, device=self.device)).view(key.batch, -1)
        slot_table = slot_table[:, :key.kv_len]
        mask = torch.arange(key.kv_len, device=self.device)[None, :] < key.lengths[:, None]
        new_slots = slot_table.gather(1, (key.lengths - 1)[:, None])[:, 0]
        attn = StaticDecodeAttention(self.pool, slot_table, new_slots, mask)
        if key.state_slots is None:
            return attn
        from ferrylm.engine.cache.state_pool import RecurrentStep, WithRecurrentState

        return WithRecurrentState(attn, RecurrentStep(
            pool=self.state_pool, slots=key.state_slots, fresh=key.positions == 0,
            query_start_loc=torch.arange(key.batch + 1, device=self.device), num_tokens=key.batch, q_lens=None))

    # --- capture ------------------------------------------------------------------------------------------------
    def _capture(self, key: _Keyed) -> None:
        """Capture ``key``'s pieces (after an eager run of them on the same buffers). On failure the failure is
        logged and: out of memory, the key takes the plain forward from now on (:meth:`disable`); anything else,
        graphs are off for the process."""
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        graphs = []
        key.outputs = []  # piece j of the capture reads piece j-1's captured outputs
        try:
            for j in range(len(self.pieces)):
                g = torch.cuda.CUDAGraph()
                with graph_capture(g, self._pool_handle):
                    key.outputs.append(self._piece(key, j))
                graphs.append(g)
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: fall back to the plain forward
            oom = is_oom(e)
            log.warning("decode CUDA graph capture for batch %d, KV bucket %d tokens failed (%s: %s)", key.batch,
                        key.kv_len, "out of memory" if oom else type(e).__name__, str(e).split("\n")[0][:200])
            if oom:
                self.disable(key.batch, key.kv_len)
            else:  # not a shortage: something this runner cannot capture; no more graphs in this process
                self.mode = "off"
                self.reset()
            self._check_rng()
            return
        key.graphs = graphs
        self.captures += 1
        added = torch.cuda.memory_reserved(self.device) - before
        self.graph_bytes += max(0, added)
        log.info("captured decode CUDA graphs: batch %d, KV bucket %d tokens, %d pieces, +%.1f MiB%s", key.batch,
                 key.kv_len, len(graphs), added / 2**20,
                 f", expert stage {key.stage.rows.nbytes / 2**20:.1f} MiB" if key.stage is not None else "")

    def _check_rng(self) -> None:
        """After a failed capture: a capture that failed before its end leaves the CUDA generator in capture state
        (torch 2.11: every later random draw raises). Probe it; if it is broken, raise, so the engine process
        exits and is restarted (a sampler that fails every request is worse than a restart).

        Raises:
            RuntimeError: the generator no longer draws."""
        try:
            torch.cuda.synchronize(self.device)
            torch.rand(1, device=self.device)
        except RuntimeError as e:
            raise RuntimeError(f"a failed CUDA graph capture left the CUDA random generator unusable ({e}); "
                               f"the engine must restart (run with --enforce-eager if this repeats)") from e

    def _signature(self) -> tuple:
        """What the graphs depend on besides the model's weights: the KV pool's tensor lists (made once by
        ``KVPool``; new lists mean new memory) and the executor (its prediction and staging are captured): the
        objects themselves, compared by identity (ids are reused)."""
        return self.pool.k, self.pool.v, (None if self._moe0 is None else self._moe0.executor)

    def _stale(self) -> bool:
        return any(a is not b for a, b in zip(self._signature(), self._sig))

    def reset(self) -> None:
        """Drop every key's graphs and buffers (they are captured again on use), e.g. after the MoE blocks were
        pointed at another executor."""
        self._keys.clear()
        self._stages.clear()
        self._stage_rows = None
        self.stack.rotary.clear_tables()  # no binding to the dropped buffers
        self._pool_handle = None  # a fresh pool: the old one goes with its graphs (reusing its handle asserts)
        self._sig = self._signature()

    def close(self) -> None:
        """Drop every graph and static buffer."""
        self.reset()

