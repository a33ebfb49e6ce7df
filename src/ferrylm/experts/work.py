"""The expert math every backend shares, so that they agree wherever their kernels do.

Expert (Jiang et al. 2024, "Mixtral of Experts", eq. 3): ``expert_e(x) = W_down[e] @ (silu(W_gate[e] @ x) *
(W_up[e] @ x))``; the layer output is ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])``.

One layer's step (:class:`LayerWork`), in one of two modes:

* small steps (at most ``SMALL_STEP_TOKENS`` tokens: decode) are planned on the host. The executor reads the
  step's ``[T, k]`` expert ids to the host once (one device->host sync per layer, which it needs anyway to decide
  what to copy; :meth:`LayerWork.from_host_ids`), and every index the device needs (token rows, assignment
  positions, where each contribution goes) is built in Python from those few ints and sent in ONE host->device
  copy per compute call (``non_blocking``: no stream sync). On CUDA the chosen experts run as three batched GEMMs
  with the tokens padded per expert (a few kernels per layer instead of a few per expert); on a CPU one GEMM
  chain per expert (gathering weights would double a memory-bound decode's traffic).
* large steps (prefill chunks): :func:`group_by_expert` sorts the assignments by expert on the device (one sync
  for the counts) and one GEMM chain runs per expert over its contiguous token group.

In both modes each expert's output is weighted (float32 product, stored in the activation dtype) and
:meth:`LayerWork.combine` places every contribution at ``(token, rank of its expert among the token's experts)``
and sums the ``k`` of each token in float32, in ascending expert order: deterministic, and independent of which
backend computed which expert where.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferrylm.experts.executor import ExpertMath, LayerExperts
from ferrylm.experts.quantized import dense

# NOTE: steps with at most this many tokens (decode) are planned on the host and, on CUDA, run batched GEMMs.
SMALL_STEP_TOKENS = 8


def is_small_step(num_tokens: int) -> bool:
    """True when a step of ``num_tokens`` tokens is planned on the host (:meth:`LayerWork.from_host_ids`)."""
    return 0 < num_tokens <= SMALL_STEP_TOKENS


@dataclass
class ExpertGroups:
    """Token → expert assignments sorted by expert.

    Attributes:
        token_idx: ``[T * k]`` int64 token row of each assignment, grouped by expert (ascending expert id; within
            an expert, ascending token order).
        weights: ``[T * k]`` routing weight of each assignment, same order.
        counts: assignments per expert, a host list of length ``E``; expert ``e`` owns the slice
            ``[sum(counts[:e]), sum(counts[:e + 1]))``.
        order: ``[T * k]`` the sorting permutation of the flattened ``[T, k]`` assignments.
    """

    token_idx: torch.Tensor
    weights: torch.Tensor
    counts: list[int]
    order: torch.Tensor | None = None

    def positions(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``[T * k]`` int64: where each assignment (this order) goes in the token-major ``[T, k]`` sum,
        ``token * k + rank``, ``rank`` its expert's place among the token's experts in ascending id (the summation
        order of :meth:`LayerWork.combine`). Needs ``order`` (:func:`group_by_expert` sets it)."""
        k = topk_ids.shape[1]
        rank = torch.argsort(torch.argsort(topk_ids, dim=1, stable=True), dim=1, stable=True)
        return self.token_idx * k + rank.reshape(-1)[self.order]


def group_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort a step's ``[T, k]`` assignments by expert id (one device→host sync for the counts).

    Raises:
        ValueError: an id is ``>= num_experts``; RuntimeError (from ``torch.bincount``): a negative id.
    """
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # negative ids make bincount raise
    if len(counts) > num_experts:
        raise ValueError(f"expert id {len(counts) - 1} out of range: the layer has {num_experts} experts")
    return ExpertGroups(token_idx=order // k, weights=topk_weights.reshape(-1)[order], counts=counts, order=order)


def swiglu_expert(x: torch.Tensor, gate, up, down, math: ExpertMath | None = None, e: int = 0) -> torch.Tensor:
    """One expert, ``down @ (silu(gate @ x) * (up @ x))`` for ``x [N, H]``; ``gate``/``up`` ``[I, H]``,
    ``down`` ``[H, I]`` -> ``[N, H]`` (with ``math``: expert ``e``'s biases and clamped SwiGLU,
    :class:`~ferrylm.experts.executor.ExpertMath`). Quantized weights
    (:class:`~ferrylm.experts.quantized.QuantTensor`) are dequantized to ``x``'s dtype first (the reference path)."""
    gate, up, down = (dense(w, x.dtype) for w in (gate, up, down))
    if math is not None:
        return math.expert(x, gate, up, down, e)
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def swiglu_batched(x: torch.Tensor, gate, up, down, math: ExpertMath | None = None,
                   ids: torch.Tensor | None = None) -> torch.Tensor:
    """``m`` experts at once: ``x [m, n, H]``, ``gate``/``up`` ``[m, I, H]``, ``down`` ``[m, H, I]`` ->
    ``[m, n, H]`` (quantized weights dequantized first, as :func:`swiglu_expert`; with ``math``, the experts'
    ids ``[m]`` on the device pick their biases)."""
    gate, up, down = (dense(w, x.dtype) for w in (gate, up, down))
    if math is not None:
        return math.batched(x, gate, up, down, ids)
    g = torch.bmm(x, gate.transpose(1, 2))
    u = torch.bmm(x, up.transpose(1, 2))
    return torch.bmm(F.silu(g) * u, down.transpose(1, 2))


@dataclass
class ExpertStage:
    """Static buffers through which an executor hands one small step's routed-expert GEMMs to a CUDA graph (the
    next decode graph computes them: ``engine/decode_graph.py``), so no kernel of the expert math is launched from
    the host.

    Attributes:
        rows: ``[M, S]`` expert rows (``M`` experts at most, :class:`~ferrylm.experts.executor.ExpertLayout` rows).
        index: ``[2 * M * n + T * k]`` int64: per staged row ``i`` and token slot ``c < n``, the token row
            (``[M * n]``), then the flat assignment position of its routing weight (``[M * n]``; ``T * k`` = the
            zero weight of a padding slot), then for each token ``t`` and rank ``r`` (ascending expert id) the row
            ``i * n + c`` of that contribution (``[T * k]``).
        extra: ``[T, H]`` added to the staged sum (an eagerly computed output when the step could not be staged;
            zeros otherwise; ``extra_dirty`` says which).
        pad_index: an ``index`` under which the staged sum is exactly zero (every weight the zero one, every
            contribution read from row 0; see :meth:`set_eager`).
        layout: the rows' :class:`~ferrylm.experts.executor.ExpertLayout`.
        tokens: ``T``; top_k: ``k``; n: token slots per staged expert (``T``).
    """

    rows: torch.Tensor
    index: torch.Tensor
    extra: torch.Tensor
    pad_index: torch.Tensor
    layout: object
    tokens: int
    top_k: int
    n: int
    extra_dirty: bool = False  # extra holds an eager output: zero it before the next staged layer

    @classmethod
    def create(cls, rows: torch.Tensor, layout, tokens: int, top_k: int, hidden_size: int,
               dtype: torch.dtype) -> "ExpertStage":
        """A stage over ``rows [M, S]`` (the caller's buffer) for steps of ``tokens`` tokens, ``top_k`` experts each,
        activations ``[tokens, hidden_size]`` in ``dtype``; its index starts as the padding index. Allocates the
        index and ``extra`` on ``rows``' device (raises torch.OutOfMemoryError when they do not fit)."""
        mn, tk = rows.shape[0] * tokens, tokens * top_k
        pad = torch.tensor([0] * mn + [tk] * mn + [0] * tk, dtype=torch.int64).to(rows.device)
        return cls(rows=rows, index=pad.clone(), extra=torch.zeros(tokens, hidden_size, dtype=dtype,
                                                                   device=rows.device),
                   pad_index=pad, layout=layout, tokens=tokens, top_k=top_k, n=tokens)

    @property
    def max_experts(self) -> int:
        return self.rows.shape[0]

    def set_eager(self, out: torch.Tensor) -> None:
        """The step was computed eagerly (``out [T, H]``): make the staged sum exactly zero and carry ``out`` in
        ``extra``. The padding index reads only row 0 of the staged products, with the zero weight; row 0 zeroed
        makes that product exactly 0 whatever the other rows hold (no inf * 0)."""
        self.rows[0].zero_()
        self.index.copy_(self.pad_index)
        self.extra.copy_(out)
        self.extra_dirty = True

    def set_staged(self) -> None:
        """The step was staged (:meth:`LayerWork.stage_into`): ``extra`` must be zero."""
        if self.extra_dirty:
            self.extra.zero_()
            self.extra_dirty = False


class LayerWork:
    """One layer's step: the activations, the assignments grouped by expert, the per-expert contributions.

    Build with ``LayerWork(layer, hidden, topk_ids, groups)`` (large steps; ``groups`` from
    :func:`group_by_expert`) or :meth:`LayerWork.from_host_ids` (small steps, planned on the host).

    Args:
        layer: decoder layer index. hidden: ``[T, H]``. topk_ids: ``[T, k]``. groups: from
            :func:`group_by_expert`.

    Attributes:
        spans: expert -> ``(start, count)`` of its assignments in grouped order (experts with count > 0 only).
        needed: those experts, ascending. small: planned on the host (``T <= SMALL_STEP_TOKENS``).
        batched: small and on CUDA: :meth:`compute` runs batched GEMMs.
    Class attribute ``batch_on_cpu`` (default False): run the batched (CUDA) path on the CPU too; tests set it to
    check the code the GPU runs, on CI machines without one.

    Attributes (continued):
        predicted: the next MoE layer's predicted experts (ascending) -> the tokens predicted to route to each,
            when the executor read them to the host together with this layer's ids (prefetch); None otherwise.
    """

    batch_on_cpu = False

    def __init__(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, groups: ExpertGroups | None,
                 *, topk_weights: torch.Tensor | None = None, ids_host: list[list[int]] | None = None,
                 math: ExpertMath | None = None):
        self.layer = layer
        self.math = math  # the layer's biases and clamped SwiGLU (gpt-oss), None = plain SwiGLU
        self.hidden = hidden
        self.topk_ids = topk_ids
        self.groups = groups
        self.spans: dict[int, tuple[int, int]] = {}
        self.small = ids_host is not None
        self.batched = self.small and (hidden.is_cuda or self.batch_on_cpu)
        self.parts: dict[int, torch.Tensor] = {}  # large mode: expert -> weighted output [count, H]
        self.predicted: dict[int, int] | None = None
        self.stage: ExpertStage | None = None  # small mode: where the GEMMs may be handed to a graph
        self.staged = False  # the GEMMs were handed to ``stage`` (stage_into)
        self.topk_weights = topk_weights  # [T, k] (large mode: kept for a fused computation of the whole layer)
        self.output: torch.Tensor | None = None  # the whole layer computed at once (fused kernel): combine() = it
        if self.small:
            self._init_small(topk_weights, ids_host)
        else:
            start = 0
            for e, n in enumerate(groups.counts):
                if n:
                    self.spans[e] = (start, n)
                start += n
        self.needed = list(self.spans)

    @classmethod
    def from_host_ids(cls, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      ids_host: list[list[int]], num_experts: int, math: ExpertMath | None = None) -> "LayerWork":
        """A small step planned on the host.

        Args:
            hidden: ``[T, H]``. topk_ids / topk_weights: ``[T, k]`` on hidden's device.
            ids_host: ``topk_ids.tolist()`` (``T`` lists of ``k`` distinct ids), read by the caller (its one
                device->host sync for the layer).
            num_experts: ``E``, the layer's experts.

        Raises:
            ValueError: an id outside ``[0, E)``.
        """
        flat = [e for row in ids_host for e in row]
        if flat and (min(flat) < 0 or max(flat) >= num_experts):
            raise ValueError(f"expert id out of range: the layer has {num_experts} experts, got {flat}")
        return cls(layer, hidden, topk_ids, None, topk_weights=topk_weights, ids_host=ids_host, math=math)

    # --- small mode -----------------------------------------------------------------------------------------
    def _init_small(self, topk_weights: torch.Tensor, ids_host: list[list[int]]) -> None:
        self.topk_weights = topk_weights
        self.k = len(ids_host[0]) if ids_host else self.topk_ids.shape[1]
        self.ids_host = ids_host
        pos: dict[int, list[int]] = {}
        self._nth: list[int] = []  # flat assignment position -> its index among its expert's assignments
        for t, row in enumerate(ids_host):
            for j, e in enumerate(row):
                p = pos.setdefault(e, [])
                self._nth.append(len(p))
                p.append(t * self.k + j)
        self._pos = {e: pos[e] for e in sorted(pos)}  # expert -> flat assignment positions, ascending
        start = 0
        for e, p in self._pos.items():
            self.spans[e] = (start, len(p))
            start += len(p)
        self._chunks: list[torch.Tensor] = []   # computed outputs, rows concatenated
        self._rows = 0                          # rows in _chunks so far
        self._row_of: dict[int, int] = {}       # expert -> row of its first contribution in cat(_chunks)
        self._src: torch.Tensor | None = None   # device gather index for combine, when known at compute time

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64)
        return t.to(self.hidden.device, non_blocking=True) if self.hidden.is_cuda else t

    def _src_host(self) -> list[int]:
        """For each dense position ``t * k + r`` (``r``: rank of the expert among token ``t``'s, ascending id), the
        row of that contribution in ``cat(_chunks)``."""
        k, nth, row_of = self.k, self._nth, self._row_of
        return [row_of[e] + nth[t * k + j] for t, row in enumerate(self.ids_host)
                for e, j in sorted((e, j) for j, e in enumerate(row))]

    def _add_chunk(self, experts: list[int], out: torch.Tensor, stride: int) -> None:
        """Record ``out`` (``[len(experts) * stride, H]``): expert ``experts[i]``'s rows start at ``i * stride``."""
        for i, e in enumerate(experts):
            self._row_of[e] = self._rows + i * stride
        self._chunks.append(out)
        self._rows += out.shape[0]

    def gather_inputs(self, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The token rows and routing weights of ``experts``' assignments, grouped by expert (ascending within):
        ``(x [N, H] in hidden's dtype, w [N] float32)`` on hidden's device, ``N = sum of their counts``."""
        if not experts:
            return self.hidden[:0], torch.zeros(0, device=self.hidden.device)
        if not self.small:
            idx = torch.cat([self.rows(e) for e in experts])
            return self.hidden.index_select(0, idx), torch.cat([self.weights(e) for e in experts]).float()
        flat = [a for e in experts for a in self._pos[e]]
        idx = self._to_device([a // self.k for a in flat] + flat)
        n = len(flat)
        return (self.hidden.index_select(0, idx[:n]),
                self.topk_weights.reshape(-1).index_select(0, idx[n:]).float())

    # --- both modes -----------------------------------------------------------------------------------------
    def rows(self, e: int) -> torch.Tensor:
        """Large mode: ``[count]`` token rows of expert ``e``'s assignments (device)."""
        start, n = self.spans[e]
        return self.groups.token_idx[start:start + n]

    def weights(self, e: int) -> torch.Tensor:
        """Large mode: ``[count]`` routing weights of expert ``e``'s assignments (device)."""
        start, n = self.spans[e]
        return self.groups.weights[start:start + n]

    def _weigh(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return weigh(y, w, self.hidden.dtype)

    def put(self, experts: list[int], out: torch.Tensor) -> None:
        """Record externally computed weighted outputs (the CPU pool's): ``out [N, H]`` holds ``experts``'
        contributions grouped by expert in :meth:`gather_inputs` order."""
        if not experts:
            return
        if not self.small:
            sizes = [self.spans[e][1] for e in experts]
            for e, y in zip(experts, out.split(sizes)):
                self.parts[e] = y
            return
        for e in experts:
            self._row_of[e] = self._rows
            self._rows += self.spans[e][1]
        self._chunks.append(out)

    def compute_each(self, experts: list[int], weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                     ) -> None:
        """Compute ``experts`` (ascending) one GEMM chain each, expert ``experts[i]`` with ``weights[i] = (gate
        [I, H], up [I, H], down [H, I])`` (any device tensors, e.g. views of different slot blocks)."""
        if not experts:
            return
        if not self.small:
            for e, (g, u, d) in zip(experts, weights):
                self.parts[e] = self._weigh(swiglu_expert(self.hidden[self.rows(e)], g, u, d, self.math, e),
                                            self.weights(e))
            return
        x, w = self.gather_inputs(experts)
        outs, start = [], 0
        for e, (g, u, d) in zip(experts, weights):
            n = self.spans[e][1]
            outs.append(self._weigh(swiglu_expert(x[start:start + n], g, u, d, self.math, e), w[start:start + n]))
            start += n
        self.put(experts, torch.cat(outs) if len(outs) > 1 else outs[0])

    def compute(self, experts: list[int], source: LayerExperts, rows: list[int] | None) -> None:
        """Compute ``experts`` (ascending) on the device; expert ``experts[i]``'s weights are row ``rows[i]`` of
        ``source`` (``gate/up [X, I, H]``, ``down [X, H, I]``: resident stacks, slot or buffer views), or row ``i``
        when ``rows`` is None (``source`` holds exactly those experts, in order)."""
        if not experts:
            return
        if rows is None:
            rows = list(range(len(experts)))
            whole = True
        else:
            whole = False
        if not self.small:
            self.compute_each(experts, [(source.gate[r], source.up[r], source.down[r]) for r in rows])
            return
        k = self.k
        if not self.batched:  # CPU: one GEMM chain per expert, no weight gather
            self.compute_each(experts, [(source.gate[r], source.up[r], source.down[r]) for r in rows])
            return
        m = len(experts)
        nmax = max(self.spans[e][1] for e in experts)
        gp = []
        for e in experts:
            p = self._pos[e]
            gp.extend(p + [p[-1]] * (nmax - len(p)))  # pad by repeating the last assignment
        # every index the device needs, in ONE non-blocking copy: token rows | assignment positions | weight rows
        # (| combine's gather, when this call computes every needed expert of the layer)
        values = [a // k for a in gp] + gp + ([] if whole else list(rows))
        final = not self._chunks and m == len(self.needed)
        if final:
            for i, e in enumerate(experts):
                self._row_of[e] = i * nmax
            values += self._src_host()
        idx = self._to_device(values)
        n = m * nmax
        x = self.hidden[idx[:n]].view(m, nmax, -1)
        w = self.topk_weights.reshape(-1)[idx[n:2 * n]].view(m, nmax)
        if whole:
            gate, up, down = source.gate, source.up, source.down
            tail = 2 * n
        else:
            ridx = idx[2 * n:2 * n + m]
            gate, up, down = (source.gate.index_select(0, ridx), source.up.index_select(0, ridx),
                              source.down.index_select(0, ridx))
            tail = 2 * n + m
        ids = self._to_device(experts) if self.math is not None else None
        out = self._weigh(swiglu_batched(x, gate, up, down, self.math, ids), w).view(n, -1)
        if final:
            self._src = idx[tail:]
            self._chunks.append(out)
            self._rows = n
        else:
            self._add_chunk(experts, out, nmax)

    def can_stage(self, experts: list[int]) -> bool:
        """True when this small step has a ``stage`` and ``experts`` (ascending) are all its experts and fit it."""
        stage = self.stage
        return (stage is not None and self.math is None and not self._chunks and len(experts) == len(self.needed)
                and len(experts) <= stage.max_experts and stage.tokens == self.hidden.shape[0]
                and stage.top_k == self.k and all(self.spans[e][1] <= stage.n for e in experts))

    def stage_into(self, experts: list[int]) -> None:
        """Write the step's index into ``stage.index`` (one host->device copy) for ``experts`` (ascending, every
        needed expert, :meth:`can_stage`), whose rows the caller put in ``stage.rows[:len(experts)]`` in that order.
        The graph's computation is :meth:`compute` + :meth:`combine` with ``nmax = stage.n`` and ``stage.rows`` as
        the source (padding slots weigh zero)."""
        stage = self.stage
        n, mn, pad_w = stage.n, stage.max_experts * stage.n, stage.tokens * stage.top_k
        tok, pos = [0] * mn, [pad_w] * mn
        for i, e in enumerate(experts):
            self._row_of[e] = i * n
            for c, a in enumerate(self._pos[e]):
                tok[i * n + c] = a // self.k
                pos[i * n + c] = a
        stage.index.copy_(torch.tensor(tok + pos + self._src_host(), dtype=torch.int64),
                          non_blocking=stage.index.is_cuda)
        self.staged = True

    def combine(self) -> torch.Tensor:
        """``[T, H]``: the contributions summed per token in float32, experts in ascending id (module docstring).

        Raises:
            RuntimeError: an expert with assignments produced no output (a backend bug).
        """
        if self.output is not None:
            return self.output
        t, k = self.topk_ids.shape
        if self.small:
            missing = [e for e in self.needed if e not in self._row_of]
            if missing:
                raise RuntimeError(f"layer {self.layer}: experts {missing} were never computed")
            src = self._src if self._src is not None else self._to_device(self._src_host())
            rows = torch.cat(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
            return sum_per_token(rows, src, t, k)
        missing = [e for e in self.needed if e not in self.parts]
        if missing:
            raise RuntimeError(f"layer {self.layer}: experts {missing} were never computed")
        pos = self.groups.positions(self.topk_ids)
        parts = torch.cat([self.parts[e] for e in self.needed]) if len(self.needed) > 1 else self.parts[self.needed[0]]
        dense = torch.empty(t * k, self.hidden.shape[1], dtype=parts.dtype, device=parts.device)
        dense.index_copy_(0, pos, parts)
        return dense.view(t, k, -1).sum(1, dtype=torch.float32).to(parts.dtype)


def weigh(y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y [..., H]`` (activation dtype) times routing weights ``w [...]`` as a float32 product, stored in ``dtype``
    (one kernel: the product promotes to float32)."""
    w = w if w.dtype == torch.float32 else w.float()
    return (y * w[..., None]).to(dtype)


def sum_per_token(rows: torch.Tensor, src: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """``rows [R, H]`` weighted contributions; ``src [t * k]`` the row of token ``i``'s ``r``-th contribution at
    ``i * k + r`` (ascending expert id) -> ``[t, H]``: the ``k`` summed in float32 in that order, in ``rows``'
    dtype (:meth:`LayerWork.combine`)."""
    return rows.index_select(0, src).view(t, k, -1).sum(1, dtype=torch.float32).to(rows.dtype)


def staged_moe_output(stage: ExpertStage, hidden: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The computation a :class:`ExpertStage` describes, with fixed shapes (captured in a CUDA graph):
    ``hidden [T, H]``, ``topk_weights [T, k]`` float32 -> ``[T, H]`` = the staged experts' weighted outputs summed per
    token in float32 in ascending expert order (as :meth:`LayerWork.compute` + :meth:`LayerWork.combine`), plus
    ``stage.extra``."""
    m, n, t, k = stage.max_experts, stage.n, stage.tokens, stage.top_k
    mn = m * n
    idx = stage.index
    x = hidden[idx[:mn]].view(m, n, -1)
    w_all = torch.cat([topk_weights.reshape(-1).float(), topk_weights.new_zeros(1, dtype=torch.float32)])
    w = w_all[idx[mn:2 * mn]].view(m, n)
    src = stage.layout.layer_views(stage.rows)
    y = weigh(swiglu_batched(x, src.gate, src.up, src.down), w, hidden.dtype).view(mn, -1)
    return sum_per_token(y, idx[2 * mn:], t, k) + stage.extra
