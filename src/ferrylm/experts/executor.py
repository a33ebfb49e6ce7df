"""The ExpertExecutor interface: where routed experts live and run.

The MoE block in ``models/moe.py`` owns the router; it hands the executor the tokens, their chosen expert ids
and their (already normalised) routing weights, and gets back the weighted sum of the chosen experts' outputs.
Backends (resident, offload, cpu, hybrid; ``auto`` picks one) differ only in where the expert bytes are when the
GEMMs run, never in the result.

Expert math (Mixtral / Qwen-MoE SwiGLU expert, Jiang et al. 2024 "Mixtral of Experts"):
``expert_e(x) = W_down[e] @ (silu(W_gate[e] @ x) * (W_up[e] @ x))``; gpt-oss adds biases to the three projections
and clamps its SwiGLU (:class:`ExpertMath`).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ferrylm.experts.quantized import ALIGN, ExpertQuant, QuantTensor, RowFields
from ferrylm.experts.stats import ExpertReport
from ferrylm.faults import NO_FAULTS, FaultInjector

Router = Callable[[torch.Tensor], torch.Tensor]  # hidden [T, H] -> predicted topk_ids [T, k]


class ClampedSwiGLU(NamedTuple):
    """The clamped SwiGLU of a family's experts: ``alpha`` the sigmoid's gain, ``limit`` the clamp, ``up_shift`` added
    to the clamped up projection (gpt-oss: 1.702, 7.0, 1; DeepSeek-V4: 1, ``swiglu_limit``, 0 — plain SiLU)."""

    alpha: float
    limit: float
    up_shift: float = 1.0


@dataclass
class ExpertMath:
    """What a layer's experts compute beyond ``down @ (silu(gate @ x) * (up @ x))``: projection biases and a clamped
    SwiGLU (gpt-oss's ``GptOssExperts``; DeepSeek-V4's with zero biases): ``g = min(gate @ x + b_g, limit)``,
    ``u = clamp(up @ x + b_u, -limit, limit)``, ``y = down @ ((u + up_shift) * g * sigmoid(alpha * g)) + b_d``.

    Attributes:
        gate_bias, up_bias: ``[E, I]``; down_bias: ``[E, H]`` (on the compute device; small, never offloaded).
        alpha, limit, up_shift: :class:`ClampedSwiGLU`.
    """

    gate_bias: torch.Tensor
    up_bias: torch.Tensor
    down_bias: torch.Tensor
    alpha: float
    limit: float
    up_shift: float = 1.0

    @staticmethod
    def unbiased(num_experts: int, hidden_size: int, intermediate_size: int, swiglu: ClampedSwiGLU,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> "ExpertMath":
        """The clamped SwiGLU without biases (zero ones: every backend computes one form)."""
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return ExpertMath(zeros(num_experts, intermediate_size), zeros(num_experts, intermediate_size),
                          zeros(num_experts, hidden_size), *swiglu)

    def act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of ``g`` / ``u`` (biases already added), in their dtype."""
        g = g.clamp(max=self.limit)
        u = u.clamp(-self.limit, self.limit)
        return (u + self.up_shift) * (g * torch.sigmoid(g * self.alpha))

    def expert(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               e: int) -> torch.Tensor:
        """Expert ``e`` (plain weights ``gate``/``up`` ``[I, H]``, ``down`` ``[H, I]``) of ``x [N, H]`` -> ``[N, H]``."""
        dt = x.dtype
        h = self.act(F.linear(x, gate, self.gate_bias[e].to(dt)), F.linear(x, up, self.up_bias[e].to(dt)))
        return F.linear(h, down, self.down_bias[e].to(dt))

    def batched(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
        """``m`` experts at once: ``x [m, n, H]``, ``gate``/``up`` ``[m, I, H]``, ``down`` ``[m, H, I]``, their ids
        ``[m]`` (device) -> ``[m, n, H]``."""
        dt = x.dtype
        g = torch.bmm(x, gate.transpose(1, 2)) + self.gate_bias[ids, None].to(dt)
        u = torch.bmm(x, up.transpose(1, 2)) + self.up_bias[ids, None].to(dt)
        return torch.bmm(self.act(g, u), down.transpose(1, 2)) + self.down_bias[ids, None].to(dt)

    def to(self, device: torch.device | str) -> "ExpertMath":
        return ExpertMath(self.gate_bias.to(device), self.up_bias.to(device), self.down_bias.to(device), self.alpha,
                          self.limit, self.up_shift)


@dataclass
class LayerExperts:
    """All routed experts of one MoE layer, stacked.

    Attributes:
        gate: ``[E, I, H]`` gate projection (HF ``w1`` / ``gate_proj``).
        up:   ``[E, I, H]`` up projection   (HF ``w3`` / ``up_proj``).
        down: ``[E, H, I]`` down projection (HF ``w2`` / ``down_proj``).
        math: the biases and clamped activation of gpt-oss's experts (:class:`ExpertMath`); None = plain SwiGLU.
    ``E`` experts, ``H`` hidden size, ``I`` expert intermediate size. Each is a plain tensor, or, for quantized
    experts, a :class:`~ferrylm.experts.quantized.QuantTensor` of those dequantized shapes (gate and up of one
    format, down of one format).
    """

    gate: torch.Tensor | QuantTensor
    up: torch.Tensor | QuantTensor
    down: torch.Tensor | QuantTensor
    math: ExpertMath | None = None

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def quant(self) -> ExpertQuant | None:
        """The quantized formats, or None for plain tensors."""
        if isinstance(self.gate, QuantTensor):
            return ExpertQuant(gate_up=self.gate.fmt, down=self.down.fmt)
        return None

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (plain tensors) or the compute dtype quantized ones dequantize to."""
        return self.gate.dtype

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate + up + down; quantized: every field)."""
        if isinstance(self.gate, QuantTensor):
            return sum(p[0].nbytes for p in (self.gate, self.up, self.down))
        per = self.gate[0].numel() + self.up[0].numel() + self.down[0].numel()
        return per * self.gate.element_size()

    def to(self, device: torch.device | str) -> "LayerExperts":
        """The three projections on ``device`` (no copy where they are already there)."""
        return LayerExperts(gate=self.gate.to(device), up=self.up.to(device), down=self.down.to(device),
                            math=None if self.math is None else self.math.to(device))


@dataclass(frozen=True)
class ExpertLayout:
    """Shape of one expert row.

    Attributes:
        hidden: ``H``; inter: ``I`` (expert intermediate size).
        dtype: element type of a plain row; for quantized experts the compute dtype they dequantize to.
        quant: the quantized formats (:class:`~ferrylm.experts.quantized.ExpertQuant`), or None.

    A plain row is ``gate [I, H] | up [I, H] | down [H, I]`` elements of ``dtype``. A quantized row is uint8 bytes:
    the fused gate|up projection's fields (``[2I, H]``: data, scales, mins, row scale; gate rows then up rows in
    each) then down's fields (``[H, I]``), each field aligned to 64 bytes (``quantized.RowFields``), the row
    length rounded up to 64 bytes. Either way one row is one expert, so copies move exactly its stored bytes.
    """

    hidden: int
    inter: int
    dtype: torch.dtype
    quant: ExpertQuant | None = None

    @functools.cached_property
    def _rows(self) -> tuple[RowFields, RowFields]:
        q = self.quant
        gu = RowFields.build(q.gate_up, 2 * self.inter, self.hidden, 0)
        return gu, RowFields.build(q.down, self.hidden, self.inter, gu.end)

    @property
    def row_dtype(self) -> torch.dtype:
        """Element type of a row (``uint8`` for quantized experts)."""
        return torch.uint8 if self.quant is not None else self.dtype

    @property
    def numel(self) -> int:
        """Elements of one row: ``3 * I * H`` (plain), or its bytes (quantized)."""
        if self.quant is not None:
            return -(-self._rows[1].end // ALIGN) * ALIGN
        return 3 * self.inter * self.hidden

    @property
    def nbytes(self) -> int:
        """Bytes of one expert."""
        return self.numel * torch.empty((), dtype=self.row_dtype).element_size()

    def gate_up(self, rows: torch.Tensor) -> torch.Tensor | QuantTensor:
        """``rows [..., S]`` -> the fused ``[..., 2I, H]`` gate|up block (views, gate rows first)."""
        i, h = self.inter, self.hidden
        if self.quant is not None:
            return self._rows[0].view(self.quant.gate_up, rows, self.dtype)
        return rows[..., :2 * i * h].view(*rows.shape[:-1], 2 * i, h)

    def down(self, rows: torch.Tensor) -> torch.Tensor | QuantTensor:
        """``rows [..., S]`` -> the ``[..., H, I]`` down projection (a view)."""
        i, h = self.inter, self.hidden
        if self.quant is not None:
            return self._rows[1].view(self.quant.down, rows, self.dtype)
        return rows[..., 2 * i * h:].view(*rows.shape[:-1], h, i)

    def views(self, row: torch.Tensor) -> tuple:
        """``row [S]`` -> ``(gate [I, H], up [I, H], down [H, I])`` views (no copy)."""
        le = self.layer_views(row)
        return le.gate, le.up, le.down

    def layer_views(self, packed: torch.Tensor) -> LayerExperts:
        """``packed [E, S]`` (or one row ``[S]``) -> :class:`LayerExperts` whose ``gate/up/down`` are
        ``[E, I, H]``/``[E, H, I]`` views (each expert contiguous; the stacks are strided across experts)."""
        i = self.inter
        gu = self.gate_up(packed)
        if isinstance(gu, QuantTensor):
            return LayerExperts(gate=gu.rows(0, i), up=gu.rows(i, 2 * i), down=self.down(packed))
        return LayerExperts(gate=gu[..., :i, :], up=gu[..., i:, :], down=self.down(packed))

    def pack(self, rows: torch.Tensor, experts: LayerExperts) -> None:
        """Copy ``experts`` (stacks of ``E`` experts, any device) into ``rows [E, S]`` (``row_dtype``)."""
        dst = self.layer_views(rows)
        for part in ("gate", "up", "down"):
            getattr(dst, part).copy_(getattr(experts, part))

    @classmethod
    def of(cls, experts: LayerExperts) -> "ExpertLayout":
        _, i, h = experts.gate.shape
        quant = experts.quant
        if quant is not None and experts.up.fmt != quant.gate_up:
            raise ValueError("gate and up projections must share one quantized format")
        return cls(hidden=h, inter=i, dtype=experts.dtype, quant=quant)


@dataclass(frozen=True)
class ExpertNeeds:
    """What a backend with a device slot cache needs from the memory plan: ``slot_bytes`` per expert slot,
    ``fixed_bytes`` (prefill stream buffers and the offload device table), ``total_experts`` (slots that would hold
    every routed expert), ``min_slots``, and ``backend`` (name, for messages)."""

    slot_bytes: int
    fixed_bytes: int
    total_experts: int
    min_slots: int
    backend: str = "offload"
    step_slots: int = 0  # an automatically sized cache holds at least this many (one layer of a full decode step)

    def bytes_for(self, slots: int) -> int:
        return slots * self.slot_bytes + self.fixed_bytes


class ExpertExecutor(ABC):
    """Computes ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` for every token t of a step, for one layer.

    The whole contract between the experts and their callers (the MoE blocks, the model runner and its graphs, the
    memory plan, the OOM guard, the tensor-parallel follower): callers use only what is defined here; every backend
    (resident, offload, cpu, hybrid) implements it, the defaults being a backend without a slot cache.

    Attributes:
        name: the backend's ``--moe-backend`` name.
        faults: the fault injector (point ``expert_fetch``); the engine sets it, the warmup turns it off.
        min_slots: device slots the backend cannot work without (0: none, or no slot cache).
    """

    name: str = ""
    faults: FaultInjector = NO_FAULTS
    min_slots: int = 0

    # --- wiring (when the model is built) ----------------------------------------------------------------------
    def use_routers(self, routers: Mapping[int, Router]) -> None:
        """Hand over how each MoE layer routes: ``routers[layer](hidden [T, H]) -> topk_ids [T, k]`` (the experts
        the layer would choose for those activations); replaces any routers handed before. The model's decoder stack
        calls this once when it is built; backends that prefetch apply layer L+1's router to layer L's hidden state
        (Eliseev & Mazur 2023). Default: ignored."""

    # --- the step ----------------------------------------------------------------------------------------------
    @property
    def graph_safe(self) -> bool:
        """True when decode steps make no host decision inside the step, so a whole step can be one CUDA graph.
        Default: False."""
        return False

    def begin_step(self, num_tokens: int) -> None:
        """Prepare a step of ``num_tokens`` tokens before it is launched (eager or a graph replay): host decisions
        made between steps. The model runner (and each tensor-parallel follower) calls it before every step.
        Default: nothing to prepare."""

    def count_replayed_step(self, num_tokens: int) -> None:
        """Count a step that ran as a whole-step CUDA graph replay of ``num_tokens`` padded tokens (its Python
        :meth:`run` calls did not run). Default: nothing counted."""

    @property
    @abstractmethod
    def expert_bytes(self) -> int:
        """Bytes of one routed expert as this backend reads it (gate + up + down; quantized: every field)."""

    @abstractmethod
    def run(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
            ids_and_predicted: torch.Tensor | None = None, stage=None) -> torch.Tensor | None:
        """Run the chosen experts.

        Args:
            layer_idx: decoder layer index (the executor maps it to its own MoE-layer storage).
            hidden: ``[T, H]`` input activations.
            topk_ids: ``[T, k]`` int64 expert ids in ``[0, E)``.
            topk_weights: ``[T, k]`` routing weights (same dtype as ``hidden`` or float32).
            ids_and_predicted: ``[2T, k]`` int64, ``topk_ids`` followed by the next layer's predicted ids, when the
                caller computed them ahead with :meth:`next_layer_predictor`'s router (the decode graphs do, inside
                the layer's graph); None: an executor that prefetches predicts itself. Others ignore it.
            stage: an :class:`~ferrylm.experts.work.ExpertStage` (decode graphs): an executor with a
                :attr:`stage_layout` may put the step's expert rows and index there instead of computing them, and return None; the caller
                then computes :func:`~ferrylm.experts.work.staged_moe_output` (inside a CUDA graph). Others ignore
                it.

        Returns:
            ``[T, H]`` in ``hidden``'s dtype; None only when the step was staged into ``stage``.
        """

    def next_layer_predictor(self, layer_idx: int, num_tokens: int) -> Router | None:
        """The router (one of :meth:`use_routers`') whose prediction this executor would compute from layer ``layer_idx``'s input for a step of
        ``num_tokens`` tokens (the next MoE layer's, with prefetch on), or None. A caller that computes it ahead
        passes the result to :meth:`run` as ``ids_and_predicted``. Default: None."""
        return None

    @property
    def stage_layout(self) -> ExpertLayout | None:
        """The row layout of the expert rows :meth:`run` puts in a ``stage`` (the decode graphs allocate the stage
        with it); None: this backend never stages (it ignores ``stage``). Default: None."""
        return None

    # --- device memory (sized by the memory plan, given back to the OOM guard) ----------------------------------
    def slot_needs(self) -> ExpertNeeds | None:
        """What the memory plan must set aside for this backend's slot cache; None: no slot cache (the experts are
        weights the plan measures with the model). Default: None."""
        return None

    def reserve(self, budget_bytes: int | None = None) -> int:
        """Allocate the device slot cache within ``budget_bytes`` (None: no budget); returns the slots made.
        Default: 0 (no slot cache)."""
        return 0

    @property
    def num_slots(self) -> int:
        """Device expert slots held now (slots). Default: 0."""
        return 0

    @property
    def slot_bytes(self) -> int:
        """Device bytes per slot (bytes; 0: no slot cache)."""
        return 0

    def shrink_slots(self, n: int) -> int:
        """Give up at least ``n`` slots between steps; returns the device bytes released (0: nothing could go).
        Never raises. Default: 0."""
        return 0

    def grow_slots(self, n: int) -> int:
        """Add up to ``n`` slots between steps; returns the slots added (0 when memory is short). Default: 0."""
        return 0

    # --- stats -------------------------------------------------------------------------------------------------
    @abstractmethod
    def stats(self) -> ExpertReport:
        """Counters and the cache's shape for the engine's stats; read-only, so the heartbeat thread may call it
        while a step runs."""

    def sync_stats(self) -> None:
        """Fold timings still pending (copy timings) into the counters now; call from the thread that runs the
        model. Default: nothing pending."""

    def close(self) -> None:
        """Release threads and device memory held by the executor. Default: nothing to release."""
