"""The resident backend: every routed expert of every MoE layer sits on the compute device.

Tokens are grouped by expert (a stable sort of the flattened ``[T * k]`` assignments), each active expert runs
one SwiGLU over its contiguous group, and the weighted results are added back into their tokens' rows. There is
no per-token Python loop; the loop is over active experts only, after one host sync for the per-expert counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferrylm.experts.executor import ExpertExecutor, LayerExperts


@dataclass
class ExpertGroups:
    """Token → expert assignments sorted by expert.

    Attributes:
        token_idx: ``[T * k]`` int64 token row of each assignment, grouped by expert (ascending expert id; within
            an expert, ascending token order).
        weights: ``[T * k]`` routing weight of each assignment, same order.
        counts: assignments per expert, a host list of length ``E``; expert ``e`` owns the slice
            ``[sum(counts[:e]), sum(counts[:e + 1]))``.
    """

    token_idx: torch.Tensor
    weights: torch.Tensor
    counts: list[int]


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
    return ExpertGroups(token_idx=order // k, weights=topk_weights.reshape(-1)[order], counts=counts)


def swiglu_expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert, ``down @ (silu(gate @ x) * (up @ x))`` for ``x [N, H]``; ``gate``/``up`` ``[I, H]``,
    ``down`` ``[H, I]`` -> ``[N, H]`` (Jiang et al. 2024, "Mixtral of Experts", eq. 3)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def run_grouped(experts: LayerExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
    """``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` with one GEMM chain per active expert.

    Args:
        experts: the layer's stacked weights, on ``hidden``'s device.
        hidden: ``[T, H]``; topk_ids: ``[T, k]`` int64; topk_weights: ``[T, k]``.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype. Each expert's output is weighted in float32 and added in the
        activation dtype, experts in ascending id order (deterministic: no index repeats within one add).
    """
    out = torch.zeros_like(hidden)
    if hidden.shape[0] == 0:
        return out
    groups = group_by_expert(topk_ids, topk_weights, experts.num_experts)
    start = 0
    for e, n in enumerate(groups.counts):
        if n == 0:
            continue
        rows = groups.token_idx[start:start + n]
        y = swiglu_expert(hidden[rows], experts.gate[e], experts.up[e], experts.down[e])
        w = groups.weights[start:start + n, None].float()
        out.index_add_(0, rows, (y.float() * w).to(out.dtype))
        start += n
    return out


class ResidentExecutor(ExpertExecutor):
    """All experts resident on one device; see :func:`run_grouped`.

    Args:
        layers: decoder layer index -> that layer's :class:`LayerExperts` (already on the compute device).
    """

    def __init__(self, layers: dict[int, LayerExperts]):
        self.layers = dict(layers)

    def run(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
        """See :meth:`ExpertExecutor.run`. Raises KeyError for a layer without experts."""
        experts = self.layers.get(layer_idx)
        if experts is None:
            raise KeyError(f"layer {layer_idx} has no routed experts (MoE layers: {sorted(self.layers)})")
        return run_grouped(experts, hidden, topk_ids, topk_weights)
