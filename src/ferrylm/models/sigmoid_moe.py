"""Sigmoid routing with a selection bias (DeepSeek-V3's "auxiliary-loss-free" balancing: Wang et al. 2024,
"Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"), as GLM-4.5 and MiniMax-M2 use it.

Per token, in float32: ``s = sigmoid(W_gate x)`` ``[E]``; the experts are *chosen* on ``s + b`` (``b`` the learned
``e_score_correction_bias``), optionally restricted to the best ``topk_group`` of ``n_group`` equal groups of
experts (a group scores the sum of its two best ``s + b``); the chosen experts are *weighted* by their plain ``s``,
renormalised to sum to 1 when ``norm_topk_prob``, then times ``routed_scaling_factor``. The result is the same
``(topk_ids [T, k] int64, topk_weights [T, k] float32)`` pair the softmax router hands the
:class:`~ferrylm.experts.executor.ExpertExecutor`, so every expert backend runs these families unchanged.

A shared expert here (GLM-4.5 ``shared_experts``) has no gate: ``y = routed + shared(x)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.moe import SparseMoeBlock


@dataclass(frozen=True)
class SigmoidRouting:
    """The routing rule of one family.

    Attributes:
        top_k: experts per token ``k``.
        n_group, topk_group: group-limited selection (``E % n_group == 0``, ``1 <= topk_group <= n_group``);
            ``n_group == 1`` is plain top-k.
        renormalize: divide the kept scores by their sum (GLM ``norm_topk_prob``; MiniMax-M2 always).
        scale: multiplier of the final weights (GLM ``routed_scaling_factor``; 1.0 for MiniMax-M2).
        eps: added to the renormalising denominator (GLM's reference adds 1e-20; MiniMax-M2's adds none).
        scoring: the score of a logit: ``sigmoid`` (DeepSeek-V3, GLM, MiniMax) or ``sqrtsoftplus``
            (``sqrt(softplus(x))``, DeepSeek-V4).
    """

    top_k: int
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    scale: float = 1.0
    eps: float = 0.0
    scoring: str = "sigmoid"

    def check(self, num_experts: int, where: str) -> None:
        """Raise ModelLoadError (naming the config field) when this rule cannot route ``num_experts`` experts."""
        if not 1 <= self.top_k <= num_experts:
            raise ModelLoadError(f"{where}: num_experts_per_tok must be in [1, {num_experts}], got {self.top_k}")
        if self.n_group < 1 or num_experts % self.n_group:
            raise ModelLoadError(f"{where}: n_group={self.n_group} must divide n_routed_experts={num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ModelLoadError(f"{where}: topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.n_group > 1 and num_experts // self.n_group < 2:
            raise ModelLoadError(f"{where}: n_group={self.n_group} leaves fewer than 2 experts per group")
        if self.scoring not in SCORINGS:
            raise ModelLoadError(f"{where}: scoring_func {self.scoring!r} is not supported ({', '.join(SCORINGS)})")
        if self.top_k > self.topk_group * (num_experts // self.n_group):
            raise ModelLoadError(f"{where}: num_experts_per_tok={self.top_k} exceeds the {self.topk_group} "
                                 f"groups' {self.topk_group * (num_experts // self.n_group)} experts (topk_group)")


SCORINGS = ("sigmoid", "sqrtsoftplus")


def router_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """``[T, E]`` float32 scores of float32 ``logits`` under ``scoring`` (:data:`SCORINGS`)."""
    return torch.sigmoid(logits) if scoring == "sigmoid" else F.softplus(logits).sqrt()


def sigmoid_topk(router_logits: torch.Tensor, bias: torch.Tensor, rule: SigmoidRouting
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Biased sigmoid routing (module docstring).

    Args:
        router_logits: ``[T, E]`` raw router scores (any float dtype; computed on in float32).
        bias: ``[E]`` selection bias ``e_score_correction_bias``.
        rule: :class:`SigmoidRouting`.

    Returns:
        ``(topk_ids [T, k] int64, topk_weights [T, k] float32)``, ids in descending ``s + b`` order.
    """
    scores = router_scores(router_logits.float(), rule.scoring)
    choice = scores + bias.float()
    if rule.n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, rule.n_group, e // rule.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)               # [T, G]
        keep = torch.topk(group_scores, rule.topk_group, dim=-1).indices      # [T, topk_group]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask[:, :, None].expand_as(grouped).reshape(t, e), float("-inf"))
    ids = torch.topk(choice, rule.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + rule.eps)
    if rule.scale != 1.0:
        weights = weights * rule.scale
    return ids, weights


def sigmoid_weights(router_logits: torch.Tensor, ids: torch.Tensor, rule: SigmoidRouting) -> torch.Tensor:
    """``[T, k]`` float32 weights of chosen ``ids [T, k]`` under ``rule``: the plain sigmoid scores at ``ids``,
    renormalised and scaled as :func:`sigmoid_topk` does (for ids a routing model chose)."""
    weights = router_scores(router_logits.float(), rule.scoring).gather(1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + rule.eps)
    return weights * rule.scale if rule.scale != 1.0 else weights


class SigmoidRouter(nn.Module):
    """The router's parameters: ``weight [E, H]`` and the selection bias ``e_score_correction_bias [E]`` (a
    parameter so that the loader fills it; the model class keeps it in float32). ``forward`` gives the ``[T, E]``
    logits in float32 (``x`` and the weight cast up, as GLM-4.5's reference keeps its router in float32).

    ``bias`` (``[E]``, only with ``logit_bias``) is ferrylm's synthetic-skew bias on the *logits* (see
    ``ROUTER_BIAS_KEY`` in :mod:`ferrylm.config`): the sigmoid is monotonic, so the top-1 law the synthetic
    builder calibrates on the logits holds for the choice too. Real checkpoints have none.
    """

    def __init__(self, hidden_size: int, num_experts: int, *, logit_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if logit_bias else None
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` -> ``[T, E]`` float32 logits."""
        return F.linear(hidden.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class SigmoidMoeBlock(SparseMoeBlock):
    """Sigmoid-routed experts (+ optional ungated shared expert) of one decoder layer.

    Args:
        layer_idx, hidden_size, num_experts, executor: as :class:`~ferrylm.models.moe.SparseMoeBlock`.
        rule: :class:`SigmoidRouting` (its ``top_k`` is the block's).
        shared_experts: a dense module ``[T, H] -> [T, H]`` every token goes through, added without a gate
            (GLM-4.5 ``mlp.shared_experts``), or None.
        router_bias: the synthetic logit bias ``gate.bias`` (:class:`SigmoidRouter`).

    State-dict names: ``gate.weight [E, H]``, ``gate.e_score_correction_bias [E]``, ``shared_experts.*``.

    Raises:
        ValueError: ``top_k`` outside ``[1, E]``.
    """

    def __init__(self, layer_idx: int, hidden_size: int, num_experts: int, executor: ExpertExecutor,
                 rule: SigmoidRouting, *, shared_experts: nn.Module | None = None, router_bias: bool = False):
        super().__init__(layer_idx, hidden_size, num_experts, rule.top_k, executor)
        self.rule = rule
        self.gate = SigmoidRouter(hidden_size, num_experts, logit_bias=router_bias)
        self.shared_experts = shared_experts

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, H]`` -> ``(topk_ids [T, k] int64, topk_weights [T, k] float32)`` (:func:`sigmoid_topk`; with a
        synthetic routing model, its ids weighted by :func:`sigmoid_weights`)."""
        if self.routing is not None:
            ids = self.routing_context.choose(self.routing, self.layer_idx)
            return ids, sigmoid_weights(self.gate(hidden), ids, self.rule)
        return sigmoid_topk(self.gate(hidden), self.gate.e_score_correction_bias, self.rule)

    def predict_experts(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` -> ``[T, k]`` int64: the experts :meth:`route` chooses (the bias and the groups decide
        the choice, so this is the routing itself, less the weights; a routing model's early evaluation when one
        chooses)."""
        if self.routing is not None:
            return self.routing_context.choose(self.routing, self.layer_idx, predict=True)
        return self.route(hidden)[0]

    def shared_output(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden [T, H]`` -> the shared experts' ``[T, H]`` term (no gate), or None without them."""
        return None if self.shared_experts is None else self.shared_experts(hidden)


def check_sigmoid_config(config: ModelConfig, rule: SigmoidRouting, architecture: str) -> None:
    """Raise ModelLoadError unless ``config`` has experts, a positive expert width and a routable ``rule``."""
    if not config.is_moe:
        raise ModelLoadError(f"{architecture} config needs n_routed_experts / num_local_experts >= 1")
    if config.moe_intermediate_size < 1:
        raise ModelLoadError(f"{architecture} config needs a positive expert width (moe_intermediate_size / "
                             f"intermediate_size), got {config.moe_intermediate_size}")
    rule.check(config.num_experts, architecture)
