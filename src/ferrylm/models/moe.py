"""The sparse MoE block: the router lives here, the routed experts live behind an :class:`ExpertExecutor`.

Routing (Shazeer et al. 2017 top-k gating; Mixtral: Jiang et al. 2024, "Mixtral of Experts", eq. 1-2):
``p = softmax(W_gate x [+ b])`` in float32, keep the ``k`` largest (``torch.topk``, so ties break as the reference
implementation does), optionally renormalise the kept probabilities to sum to 1, then
``y = sum_j p_j * expert_{id_j}(x)``.

Routing model (synthetic checkpoints, ``routing=<profile>``): when a block has ``routing`` set, the *choice* of the
top-k ids comes from :class:`~ferrylm.synthetic.routing_model.RoutingModel` (a seeded function of the token's sequence
key and position, read from the shared :class:`~ferrylm.synthetic.routing_model.RoutingContext`), and the weights are
the router's softmax at those ids (renormalised over them when ``renormalize``), so numerics stay the router's.

Shared experts (Qwen1.5-MoE / Qwen2-MoE): a dense SwiGLU MLP every token passes through, scaled by a learned
sigmoid gate, added to the routed sum: ``y += sigmoid(w_s . x) * shared_expert(x)``. It is an ordinary module of
the model (the executor only ever sees routed experts).
"""

from __future__ import annotations

import torch
from torch import nn

from ferrylm.config import ROUTER_BIAS_KEY, ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.layers import SwiGLUMLP
from ferrylm.models.quant_linear import FusedLinears
from ferrylm.triton_util import use_triton


def router_has_bias(config: ModelConfig) -> bool:
    """True when ``config`` asks for router biases (see ``ROUTER_BIAS_KEY``)."""
    return bool(config.raw.get(ROUTER_BIAS_KEY, False))


def sparse_layer_indices(config: ModelConfig) -> tuple[int, ...]:
    """MoE layers of a Qwen-MoE style config: layer ``i`` is sparse when ``i`` is not in ``mlp_only_layers``,
    there are experts, and ``(i + 1) % decoder_sparse_step == 0`` (the rule of transformers'
    ``Qwen2MoeDecoderLayer`` / ``Qwen3MoeDecoderLayer``); the others use a dense MLP of ``intermediate_size``.

    Raises:
        ModelLoadError: ``decoder_sparse_step`` < 1.
    """
    raw = config.raw
    value = raw.get("decoder_sparse_step", 1)
    step = 1 if value is None else int(value)
    if step < 1:
        raise ModelLoadError(f"decoder_sparse_step must be >= 1, got {raw.get('decoder_sparse_step')!r}")
    dense = {int(i) for i in (raw.get("mlp_only_layers") or [])}
    if not config.is_moe:
        return ()
    return tuple(i for i in range(config.num_layers) if i not in dense and (i + 1) % step == 0)


def check_moe_config(config: ModelConfig, architecture: str) -> None:
    """Raise ModelLoadError unless ``config`` has ``num_experts >= num_experts_per_tok >= 1`` and a positive
    expert width."""
    if not config.is_moe or not 1 <= config.num_experts_per_tok <= config.num_experts:
        raise ModelLoadError(f"{architecture} config needs num_experts >= num_experts_per_tok >= 1, "
                             f"got {config.num_experts} and {config.num_experts_per_tok}")
    if config.moe_intermediate_size < 1:
        raise ModelLoadError(f"{architecture} config needs a positive expert width (moe_intermediate_size / "
                             f"intermediate_size), got {config.moe_intermediate_size}")


def softmax_topk(router_logits: torch.Tensor, top_k: int, *, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing over experts.

    Args:
        router_logits: ``[T, E]`` raw router scores (any float dtype).
        top_k: experts per token ``k`` (``1 <= k <= E``).
        renormalize: divide the kept probabilities by their sum (Mixtral: always; Qwen-MoE and OLMoE: config
            ``norm_topk_prob``).

    Returns:
        ``(topk_ids [T, k] int64, topk_weights [T, k] float32)``, ids in descending probability order.

    With ``renormalize`` the kept weights are the softmax of the kept logits (equal to the softmax over all experts
    renormalised over the kept ones, to float32 rounding): three kernels instead of five. The top-k runs on the
    float32 logits either way, so equal probabilities are equal logits and ties fall as in the reference.
    """
    logits = router_logits.float()
    if renormalize:
        top, ids = torch.topk(logits, top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return ids, weights


def routed_weights(router_logits: torch.Tensor, ids: torch.Tensor, *, renormalize: bool) -> torch.Tensor:
    """``[T, k]`` float32 weights of the chosen ``ids [T, k]`` under softmax routing: the softmax of the kept
    logits with ``renormalize`` (as :func:`softmax_topk`), else the full softmax's values at ``ids``."""
    logits = router_logits.float()
    if renormalize:
        return torch.softmax(logits.gather(1, ids), dim=-1)
    return torch.softmax(logits, dim=-1).gather(1, ids)


class SparseMoeBlock(FusedLinears):
    """Router + routed experts (+ optional gated shared expert) of one decoder layer (HF ``mlp`` /
    ``block_sparse_moe``).

    Args:
        layer_idx: decoder layer index (passed to the executor).
        hidden_size: ``H``.
        num_experts: routed experts ``E``.
        top_k: experts per token.
        executor: runs the chosen experts (holds their weights).
        renormalize: renormalise the top-k weights (see :func:`softmax_topk`).
        router_bias: the router has a bias ``gate.bias [E]`` (synthetic skew; see ``ROUTER_BIAS_KEY``).
        shared_expert: a dense module ``[T, H] -> [T, H]`` every token goes through (Qwen2-MoE
            ``shared_expert``); it comes with the gate ``shared_expert_gate.weight [1, H]``.

    The router weight is ``gate.weight [E, H]`` (HF name ``gate``); it stays in the model, not in the executor.

    Raises:
        ValueError: ``top_k`` outside ``[1, E]``.
    """

    def __init__(self, layer_idx: int, hidden_size: int, num_experts: int, top_k: int,
                 executor: ExpertExecutor, *, renormalize: bool = True, router_bias: bool = False,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.layer_idx = layer_idx
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=router_bias)
        self.executor = executor  # it gets this block's router with the others' (hand_routers, at the stack's build)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None
        self.routing = None           # a RoutingModel (synthetic routing=<profile>), set by the synthetic builder
        self.routing_context = None   # its RoutingContext (positions, sequence keys)

    def use_routing(self, routing, context) -> None:
        """Let ``routing`` (a :class:`~ferrylm.synthetic.routing_model.RoutingModel`) choose this block's experts,
        reading positions and keys from ``context``."""
        self.routing, self.routing_context = routing, context

    def fused_children(self) -> list[nn.Module]:
        """The router and, with a gated MLP as the shared expert, its gate and gate/up projections: one matrix
        multiply of the block's input (nothing to fuse when the router has a bias and the others none)."""
        shared = self.shared_expert
        if not isinstance(shared, SwiGLUMLP) or self.gate.bias is not None or shared.gate_proj.bias is not None:
            return []
        return [self.gate, self.shared_expert_gate, *shared.fused_children()]

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, H]`` -> ``(topk_ids [T, k] int64, topk_weights [T, k] float32)``."""
        return self._route_logits(self.gate(hidden))

    def _route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.routing is not None:
            ids = self.routing_context.choose(self.routing, self.layer_idx)
            return ids, routed_weights(logits, ids, renormalize=self.renormalize)
        if use_triton(logits) and self.top_k & (self.top_k - 1) == 0:  # one kernel (models/kernels/norm_rope.py)
            from ferrylm.models.kernels.norm_rope import topk_softmax

            return topk_softmax(logits, self.top_k, renormalize=self.renormalize)
        return softmax_topk(logits, self.top_k, renormalize=self.renormalize)

    def predict_experts(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` -> ``[T, k]`` int64: the experts :meth:`route` would choose (top-k of the logits;
        softmax is monotonic, so only exact float ties may order differently), without the weights: two kernels,
        for prefetch prediction (Eliseev & Mazur 2023). With a routing model: its early evaluation of this layer
        (:meth:`~ferrylm.synthetic.routing_model.RoutingModel.predict`; ``hidden`` is not read)."""
        if self.routing is not None:
            return self.routing_context.choose(self.routing, self.layer_idx, predict=True)
        return torch.topk(self.gate(hidden), self.top_k, dim=-1).indices

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` -> ``[T, H]``: the routing-weighted sum of the chosen experts' outputs, plus the
        sigmoid-gated shared expert when there is one (router, shared gate and gate/up in one product once
        fused)."""
        if self.is_fused:
            logits, shared_gate, gate, up = self.projections(hidden)
            ids, weights = self._route_logits(logits)
            shared = torch.sigmoid(shared_gate) * self.shared_expert.down(gate, up)
        else:
            ids, weights = self.route(hidden)
            shared = self.shared_output(hidden)
        out = self.executor.run(self.layer_idx, hidden, ids, weights)
        return out if shared is None else out + shared

    def shared_output(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden [T, H]`` -> the gated shared expert's ``[T, H]`` term ``sigmoid(w_s . x) * shared(x)``, or None
        without a shared expert."""
        if self.shared_expert is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)


def hand_routers(mlps) -> None:
    """Point the executor of the MoE blocks among ``mlps`` (a model's per-layer MLP modules, in layer order) at
    their routers: one ``use_routers({layer: block.predict_experts})`` call (the decoder stacks make it when a model
    is built; whoever points the blocks at another executor makes it again). No MoE block: nothing to hand."""
    blocks = [m for m in mlps if isinstance(m, SparseMoeBlock)]
    if blocks:
        blocks[0].executor.use_routers({b.layer_idx: b.predict_experts for b in blocks})
