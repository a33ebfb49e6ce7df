"""The expert math every backend shares, so that they agree wherever their kernels do.

Expert (Jiang et al. 2024, "Mixtral of Experts", eq. 3): ``expert_e(x) = W_down[e] @ (silu(W_gate[e] @ x) *
(W_up[e] @ x))``; the layer output is ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])``.

One layer's step (:class:`LayerWork`):
  1. :func:`group_by_expert` sorts the ``[T, k]`` assignments by expert (one device->host sync for the counts);
  2. experts are computed in batches from any weight source (resident stacks, cache slots, a prefill buffer):
     on CUDA, steps of at most ``SMALL_STEP_TOKENS`` tokens (decode) gather the batch's weights and run three
     batched GEMMs with the tokens padded per expert (a few kernels per layer instead of a few per expert);
     larger steps, and every step on the CPU, run one GEMM chain per expert over its contiguous token group;
  3. each expert's output is weighted (float32 product, stored in the activation dtype) and
     :meth:`LayerWork.combine` places every contribution at ``(token, rank of its expert among the token's
     experts)`` and sums the ``k`` of each token in float32, in ascending expert order: deterministic, and
     independent of which backend computed which expert where.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferrylm.experts.executor import LayerExperts

# NOTE: steps with at most this many tokens (decode) run their experts as batched GEMMs.
SMALL_STEP_TOKENS = 8


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


def swiglu_expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert, ``down @ (silu(gate @ x) * (up @ x))`` for ``x [N, H]``; ``gate``/``up`` ``[I, H]``,
    ``down`` ``[H, I]`` -> ``[N, H]``."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def swiglu_batched(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``m`` experts at once: ``x [m, n, H]``, ``gate``/``up`` ``[m, I, H]``, ``down`` ``[m, H, I]`` ->
    ``[m, n, H]``."""
    g = torch.bmm(x, gate.transpose(1, 2))
    u = torch.bmm(x, up.transpose(1, 2))
    return torch.bmm(F.silu(g) * u, down.transpose(1, 2))


class LayerWork:
    """One layer's step: the activations, the assignments grouped by expert, the per-expert contributions.

    Args:
        layer: decoder layer index. hidden: ``[T, H]``. topk_ids: ``[T, k]``. groups: from
            :func:`group_by_expert`.

    Attributes:
        spans: expert -> ``(start, count)`` of its assignments (experts with count > 0 only).
        needed: those experts, ascending. small: the step runs batched GEMMs (``T <= SMALL_STEP_TOKENS``, on CUDA).
        parts: expert -> weighted output ``[count, H]`` in hidden's dtype, filled by :meth:`compute` or a backend.
    """

    def __init__(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, groups: ExpertGroups):
        self.layer = layer
        self.hidden = hidden
        self.topk_ids = topk_ids
        self.groups = groups
        self.spans: dict[int, tuple[int, int]] = {}
        start = 0
        for e, n in enumerate(groups.counts):
            if n:
                self.spans[e] = (start, n)
            start += n
        self.needed = list(self.spans)
        # NOTE: batched GEMMs gather the active experts' weights (an extra read + write of every active expert).
        # On a GPU that costs microseconds of HBM time and saves launches; on a CPU it doubles the memory traffic
        # of a memory-bound decode (measured: 128 -> 207 ms per step on the built-in MoE), so CPUs loop.
        self.small = hidden.shape[0] <= SMALL_STEP_TOKENS and hidden.is_cuda
        self.parts: dict[int, torch.Tensor] = {}

    def rows(self, e: int) -> torch.Tensor:
        start, n = self.spans[e]
        return self.groups.token_idx[start:start + n]

    def weights(self, e: int) -> torch.Tensor:
        start, n = self.spans[e]
        return self.groups.weights[start:start + n]

    def _weigh(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (y.float() * w.float()[..., None]).to(self.hidden.dtype)

    def compute(self, experts: list[int], source: LayerExperts, rows: list[int]) -> None:
        """Compute ``experts`` (ascending) on the device; expert ``experts[i]``'s weights are row ``rows[i]`` of
        ``source`` (``gate/up [X, I, H]``, ``down [X, H, I]``: resident stacks, slot or buffer views)."""
        if not experts:
            return
        if not self.small:
            for e, r in zip(experts, rows):
                y = swiglu_expert(self.hidden[self.rows(e)], source.gate[r], source.up[r], source.down[r])
                self.parts[e] = self._weigh(y, self.weights(e))
            return
        dev = self.hidden.device
        idx = torch.tensor(rows, device=dev)
        counts = [self.spans[e][1] for e in experts]
        nmax = max(counts)
        starts = torch.tensor([self.spans[e][0] for e in experts], device=dev)
        offs = torch.arange(nmax, device=dev)
        last = torch.tensor(counts, device=dev) - 1
        pos = starts[:, None] + torch.minimum(offs[None, :], last[:, None])  # pad by repeating the last row
        x = self.hidden[self.groups.token_idx[pos]]  # [m, nmax, H]
        y = swiglu_batched(x, source.gate.index_select(0, idx), source.up.index_select(0, idx),
                           source.down.index_select(0, idx))
        out = self._weigh(y, self.groups.weights[pos])
        for i, (e, n) in enumerate(zip(experts, counts)):
            self.parts[e] = out[i, :n]

    def combine(self) -> torch.Tensor:
        """``[T, H]``: the contributions summed per token in float32, experts in ascending id (module docstring).

        Raises:
            RuntimeError: an expert with assignments produced no output (a backend bug).
        """
        missing = [e for e in self.needed if e not in self.parts]
        if missing:
            raise RuntimeError(f"layer {self.layer}: experts {missing} were never computed")
        t, k = self.topk_ids.shape
        rank = torch.argsort(torch.argsort(self.topk_ids, dim=1, stable=True), dim=1, stable=True)
        pos = self.groups.token_idx * k + rank.reshape(-1)[self.groups.order]
        parts = torch.cat([self.parts[e] for e in self.needed]) if len(self.needed) > 1 else self.parts[self.needed[0]]
        dense = torch.empty(t * k, self.hidden.shape[1], dtype=parts.dtype, device=parts.device)
        dense.index_copy_(0, pos, parts)
        return dense.view(t, k, -1).sum(1, dtype=torch.float32).to(self.hidden.dtype)
