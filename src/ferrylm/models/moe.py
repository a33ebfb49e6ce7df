"""The sparse MoE block: the router lives here, the routed experts live behind an :class:`ExpertExecutor`.

Routing (Shazeer et al. 2017 top-k gating; Mixtral: Jiang et al. 2024, "Mixtral of Experts", eq. 1-2):
``p = softmax(W_gate x)`` in float32, keep the ``k`` largest (``torch.topk``, so ties break as the reference
implementation does), optionally renormalise the kept probabilities to sum to 1, then
``y = sum_j p_j * expert_{id_j}(x)``.
"""

from __future__ import annotations

import torch
from torch import nn

from ferrylm.experts.executor import ExpertExecutor


def softmax_topk(router_logits: torch.Tensor, top_k: int, *, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing over experts.

    Args:
        router_logits: ``[T, E]`` raw router scores (any float dtype).
        top_k: experts per token ``k`` (``1 <= k <= E``).
        renormalize: divide the kept probabilities by their sum (Mixtral: always; Qwen-MoE: config
            ``norm_topk_prob``).

    Returns:
        ``(topk_ids [T, k] int64, topk_weights [T, k] float32)``, ids in descending probability order.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


class SparseMoeBlock(nn.Module):
    """Router + routed experts of one decoder layer (Mixtral ``block_sparse_moe`` / ``mlp``).

    Args:
        layer_idx: decoder layer index (passed to the executor).
        hidden_size: ``H``.
        num_experts: routed experts ``E``.
        top_k: experts per token.
        executor: runs the chosen experts (holds their weights).
        renormalize: renormalise the top-k weights (see :func:`softmax_topk`).

    The router weight is ``gate.weight [E, H]`` (HF name ``gate``); it stays in the model, not in the executor.
    """

    def __init__(self, layer_idx: int, hidden_size: int, num_experts: int, top_k: int,
                 executor: ExpertExecutor, *, renormalize: bool = True):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.layer_idx = layer_idx
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.executor = executor

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, H]`` -> ``(topk_ids [T, k] int64, topk_weights [T, k] float32)``."""
        return softmax_topk(self.gate(hidden), self.top_k, renormalize=self.renormalize)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` -> ``[T, H]``, the routing-weighted sum of the chosen experts' outputs."""
        ids, weights = self.route(hidden)
        return self.executor.run(self.layer_idx, hidden, ids, weights)
