"""A routing model for synthetic checkpoints: which experts each token chooses, with the locality real MoE models
show (``synthetic:<preset>:routing=<profile>``).

Random router weights route a token by its current hidden state only, so the expert cache of a synthetic model
meets either no locality at all or an artefact of the random network. This module replaces the
router's *choice* (the top-k ids; the weights stay the router's softmax at those ids) by a seeded, stateless
function of ``(seed, sequence key, layer, position)``:

``score[e] = zipf * log_pop_L(e) + sum_j bonus_j * hot_j(e, p) + sqrt(phi) * F_L(p, e) + sqrt((1 - phi) / D) *
sum_{d=1..D} F_{L-d}(p, e)``, ``ids = top-k(score)``.

- **Popularity skew** (``zipf``): ``log_pop_L(e) = -log(rank_L(e))`` with a seeded rank permutation per layer
  (Zipf's law; ``zipf = 0`` is flat). Reproduces the static share of the most used experts (OLMoE's top half
  carrying ~75-78 % of selections).
- **Temporal reuse** (``hot``): component ``j`` gives every expert of a layer its own clock of period
  ``period_j`` tokens and a seeded phase; in each period the expert is *hot* with probability ``prob_j``
  (a hash of ``(seed, key, layer, j, expert, epoch)``), and hot experts get ``bonus_j`` added to their score
  (``continuous`` components add ``bonus_j * z`` with ``z`` a standard normal per period instead).
  The hot set churns smoothly (about ``E / period_j`` experts re-drawn per token), so a sequence keeps choosing
  from a slowly moving working set: this sets the repeat-at-next-token rate, the reuse-distance distribution and
  the per-layer LRU hit rate (Qwen3-30B-A3B's 45 % / 80 % within 8 / LRU 90-95 % at 40 % residency).
- **Cross-layer correlation** (``phi``, ``depth = D``): the per-token noise ``F_m(p, .)`` is a standard normal
  field drawn per *layer index m* and indexed by a per-layer relabelling of the experts, and layer ``L`` mixes its
  own fresh field with those of the ``D`` layers before it. Layer ``L + 1``'s choice is then correlated with
  layer ``L``'s (through different expert ids), and :meth:`RoutingModel.predict` (the early evaluation of layer
  ``L + 1`` made while layer ``L`` runs: everything but the fresh field ``F_{L+1}``) has a recall set by ``phi``,
  calibrated to the 70-85 % one-layer-ahead recall reported for hidden-state predictors.

Everything is device-side integer hashing plus ``ndtri`` and ``topk`` over ``[T, E]``: no host read, no Python
branch on tensor values, so it captures in CUDA graphs (tests/gpu/test_routing_model_cuda.py). On CUDA the scores
are one Triton kernel per step (``routing_kernel.py``: the same hash bits, ``ndtri`` within a few float32 ulps);
the torch form is the CPU path and its reference. A token's ids depend on its own ``(key, position)`` and the seed
only, never on the other tokens of the batch, so prefill chunking, batching and preemption by recompute give the
same routing. Figures and their sources:
docs/ROUTING.md; the profiles (:mod:`ferrylm.synthetic.routing_profiles`) were fitted by search on the statistics
of :mod:`ferrylm.synthetic.routing_stats`.

The sequence key ``s`` names a token's sequence (:func:`sequence_key` of a request's opening prompt ids); the
step's owner sets keys on the :class:`RoutingContext` (without them every token has key 0 and sequences at the
same positions route alike). It never reads model weights.
"""

from __future__ import annotations

import hashlib
import math

import torch

from ferrylm.synthetic.routing_profiles import RoutingProfile
from ferrylm.triton_util import use_triton

_M64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch stores (two's complement)."""
    c &= _M64
    return c - (1 << 64) if c >= 1 << 63 else c


_C1, _C2, _GOLD = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(0x9E3779B97F4A7C15)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``s`` bits (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping multiplication), elementwise."""
    x = x ^ _srl(x, 30)
    x = x * _C1
    x = x ^ _srl(x, 27)
    x = x * _C2
    return x ^ _srl(x, 31)


def _mix_int(x: int) -> int:
    """:func:`_mix` on a Python int (exact 64-bit arithmetic), for the constant parts of a hash."""
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def hash_fold(*parts: torch.Tensor | int) -> torch.Tensor:
    """A 64-bit hash of broadcast int64 ``parts`` (tensors or ints), elementwise: ``h = mix(h ^ (v * GOLD))``.
    Leading ints are folded on the host, so only the tensor parts cost kernels; at least one part is a tensor."""
    h: torch.Tensor | int = 0
    for v in parts:
        if isinstance(v, torch.Tensor):
            h = _mix((v * _GOLD) ^ (_signed(h) if isinstance(h, int) else h))
        elif isinstance(h, int):
            h = _mix_int(h ^ ((v * 0x9E3779B97F4A7C15) & _M64))
        else:
            h = _mix(h ^ _signed(v * 0x9E3779B97F4A7C15))
    if not isinstance(h, torch.Tensor):
        raise TypeError("hash_fold needs at least one tensor part")
    return h


def to_uniform(h: torch.Tensor) -> torch.Tensor:
    """int64 hash -> float32 uniform in ``(0, 1)`` from its top 24 bits."""
    return (_srl(h, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _int_seed(*parts: object) -> int:
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:15], 16)


class RoutingModel:
    """The routing of one synthetic model: a profile at a shape, seeded.

    Args:
        profile: the parameters.
        num_experts: ``E``; top_k: ``k`` (``1 <= k <= E``).
        seed: the model seed (``synthetic:...:seed=S``).
        layers: decoder layer indices the model routes (for the per-layer tables).
        device: where the per-layer tables live (the router's device).

    Raises:
        ValueError: ``top_k`` outside ``[1, E]``.
    """

    def __init__(self, profile: RoutingProfile, num_experts: int, top_k: int, seed: int = 0,
                 layers: range | tuple[int, ...] | list[int] = range(1), device: torch.device | str = "cpu"):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.profile, self.num_experts, self.top_k, self.seed = profile, num_experts, top_k, seed
        self.device = torch.device(device)
        self._log_pop: dict[int, torch.Tensor] = {}
        self._labels: dict[int, torch.Tensor] = {}
        for layer in layers:
            self._tables(layer)
        self.layers = tuple(layers)
        self._slot = {layer: i for i, layer in enumerate(self.layers)}
        # the listed layers' tables stacked [L, 1, E] and their indices [L, 1, 1], for route_all
        self._stack = None
        if self.layers:
            self._stack = (torch.tensor(self.layers, dtype=torch.int64, device=self.device)[:, None, None],
                           torch.stack([self._log_pop[layer] for layer in self.layers])[:, None, :],
                           torch.stack([self._labels[layer] for layer in self.layers])[:, None, :])
        hot = profile.hot
        self._hot = (torch.tensor([c.period for c in hot], dtype=torch.int64, device=self.device),
                     torch.tensor([c.prob for c in hot], dtype=torch.float32, device=self.device),
                     torch.tensor([c.bonus for c in hot], dtype=torch.float32, device=self.device),
                     torch.tensor([int(c.continuous) for c in hot], dtype=torch.int32, device=self.device))

    def _tables(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log_pop [E] float32, labels [E] int64)`` of ``layer`` (made once, on the host, at construction for
        the listed layers so a captured graph never builds them)."""
        if layer not in self._log_pop:
            e = self.num_experts
            g = torch.Generator().manual_seed(_int_seed(self.seed, layer, "routing-rank"))
            ranks = torch.randperm(e, generator=g).to(torch.float32) + 1.0
            self._log_pop[layer] = (-torch.log(ranks)).to(self.device)
            g = torch.Generator().manual_seed(_int_seed(self.seed, layer, "routing-label"))
            self._labels[layer] = torch.randperm(e, generator=g).to(self.device)
        return self._log_pop[layer], self._labels[layer]

    def _field(self, m, keys: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``F_m``: standard normals hashed from ``(seed, key, m, position, label)``, broadcast over the shapes
        given (``m`` an int or a tensor)."""
        h = hash_fold(self.seed, keys, 0x1F1E1D + m, positions, labels)
        return torch.special.ndtri(to_uniform(h))

    def _known_score(self, layer, keys: torch.Tensor, positions: torch.Tensor, log_pop: torch.Tensor,
                     labels: torch.Tensor) -> torch.Tensor:
        """Every term of the score but the fresh field, float32. ``layer`` is an int (then ``keys``/``positions``
        are ``[T, 1]``, tables ``[1, E]``: result ``[T, E]``) or an int64 tensor ``[L, 1, 1]`` (``[1, T, 1]`` and
        ``[L, 1, E]``: ``[L, T, E]``); both give the same bits for the same layer (the hash folds an int and a
        tensor part alike)."""
        p = self.profile
        score = (p.zipf * log_pop).expand(*torch.broadcast_shapes(log_pop.shape, positions.shape))
        experts = torch.arange(self.num_experts, device=positions.device)
        for j, c in enumerate(p.hot):
            phase = hash_fold(self.seed, keys, layer, 0x407 + j, experts) % c.period
            epoch = (positions + phase) // c.period
            u = to_uniform(hash_fold(self.seed, keys, layer, 0x4070 + j, experts, epoch))
            hot = torch.special.ndtri(u) if c.continuous else (u < c.prob).to(torch.float32)
            score = score + c.bonus * hot
        if p.phi < 1.0:
            w = math.sqrt((1.0 - p.phi) / p.depth)
            for d in range(1, p.depth + 1):
                score = score + w * self._field(layer - d, keys, positions, labels)
        return score

    def _known(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        log_pop, labels = self._tables(layer)
        return self._known_score(layer, keys[:, None], positions[:, None], log_pop[None, :], labels[None, :])

    def _fused(self, positions: torch.Tensor, layer: int | None = None) -> bool:
        """Scores from the one-kernel form (``routing_kernel.py``): on CUDA, for the listed layers."""
        return use_triton(positions) and self._stack is not None and (layer is None or layer in self._slot)

    def _kernel_scores(self, rows: slice, keys: torch.Tensor, positions: torch.Tensor, with_score: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(known, score or None)`` ``[Ls, T, E]`` of the listed layers ``rows`` by the one-kernel form."""
        from ferrylm.synthetic.routing_kernel import routing_scores

        lt, log_pop, labels = self._stack
        p = self.profile
        fields = p.phi < 1.0
        seed_hash = _signed(_mix_int((self.seed * 0x9E3779B97F4A7C15) & _M64))
        return routing_scores(lt.view(-1)[rows], log_pop[:, 0][rows], labels[:, 0][rows], keys, positions,
                              self._hot, seed_hash, p.zipf, math.sqrt((1.0 - p.phi) / p.depth) if fields else 0.0,
                              p.depth if fields else 0, math.sqrt(p.phi), with_score)

    def scores(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` float32 routing scores of ``layer`` for tokens at ``positions [T]`` of sequences ``keys [T]``
        (int64, same device)."""
        if self._fused(positions, layer):
            i = self._slot[layer]
            return self._kernel_scores(slice(i, i + 1), keys, positions, True)[1][0]
        _, labels = self._tables(layer)
        fresh = self._field(layer, keys[:, None], positions[:, None], labels[None, :])
        return self._known(layer, keys, positions) + math.sqrt(self.profile.phi) * fresh

    def route(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[T, k]`` int64: the experts ``layer`` chooses, best first."""
        return torch.topk(self.scores(layer, keys, positions), self.top_k, dim=-1).indices

    def predict(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[T, k]`` int64: the early evaluation of ``layer`` (made while the layer before runs): the top-k of
        its score without its fresh field (what a predictor reading the previous layer's state can know)."""
        if self._fused(positions, layer):
            i = self._slot[layer]
            return self._top_known(self._kernel_scores(slice(i, i + 1), keys, positions, False)[0][0])
        return self._top_known(self._known(layer, keys, positions))

    def _top_known(self, known: torch.Tensor) -> torch.Tensor:
        """Top-k of the known score, ties to the lower expert id on every device (a profile without hot terms,
        ``uniform``, scores every expert alike)."""
        return torch.sort(known, dim=-1, descending=True, stable=True).indices[..., :self.top_k]

    #: most ``layers x tokens x experts`` elements :meth:`route_all` works on at once (32 MiB per int64 temporary)
    ALL_LAYERS_MAX_ELEMENTS = 1 << 22

    def batches_layers(self, num_tokens: int) -> bool:
        """True when a step of ``num_tokens`` tokens is routed for all layers at once (:meth:`route_all`): the
        per-layer path costs a few hundred small kernels per layer, which at decode sizes is launch-bound."""
        return self._stack is not None and \
            len(self.layers) * num_tokens * self.num_experts <= self.ALL_LAYERS_MAX_ELEMENTS

    def route_all(self, keys: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [L, T, k], predicted [L, T, k])`` for every listed layer (``self.layers`` order) at once:
        bit-identical to :meth:`route` / :meth:`predict` per layer, in one pass of kernels over ``[L, T, E]``."""
        if self._stack is None:
            raise ValueError("route_all needs the routing model built with its layers listed")
        if self._fused(positions):
            known, score = self._kernel_scores(slice(None), keys, positions, True)
            return (torch.topk(score, self.top_k, dim=-1).indices, self._top_known(known))
        lt, log_pop, labels = self._stack
        k3, p3 = keys[None, :, None], positions[None, :, None]
        known = self._known_score(lt, k3, p3, log_pop, labels)
        score = known + math.sqrt(self.profile.phi) * self._field(lt, k3, p3, labels)
        return (torch.topk(score, self.top_k, dim=-1).indices, self._top_known(known))

    def layer_slot(self, layer: int) -> int:
        """Index of ``layer`` in :meth:`route_all`'s outputs. Raises KeyError for an unlisted layer."""
        return self._slot[layer]




class RoutingContext:
    """Where the routing model reads a step's token positions and sequence keys (one object per model, shared by
    its MoE blocks).

    ``positions`` is bound by every decoder layer before its attention (``DecoderLayer.attention_residual``), so
    the eager forward, the whole-step CUDA graph and the piecewise decode graphs all route from the positions
    they were given (a captured graph keeps reading its static buffer). ``keys`` is ``[T]`` int64, one value per
    token naming its sequence (e.g. :func:`sequence_key` of the request), set by the step's owner with
    :meth:`set_keys` (into a static buffer when graphs are replayed); without keys every token gets key 0, so
    sequences at the same positions share their routing (a batch then overlaps more than independent requests
    would).
    """

    def __init__(self, first_layer: object | None = None) -> None:
        self.positions: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None
        self.first_layer = first_layer
        self._all: tuple[torch.Tensor, torch.Tensor] | None = None  # route_all of the current step

    def bind(self, positions: torch.Tensor, layer: object | None = None) -> None:
        """The step's positions, bound by decoder ``layer``. Binding by the model's first layer (or by an unnamed
        caller) starts a new step: the all-layers routing of the last one is dropped."""
        self.positions = positions
        if layer is None or layer is self.first_layer:
            self._all = None

    def set_keys(self, keys: torch.Tensor | None) -> None:
        """``keys [T]`` int64 on the positions' device, or None (all zero)."""
        self.keys = keys
        self._all = None

    def choose(self, routing: RoutingModel, layer: int, *, predict: bool = False) -> torch.Tensor:
        """``[T, k]`` int64: ``routing``'s choice (or, ``predict``, its early evaluation) for ``layer`` this step.
        Small steps route every layer in one :meth:`RoutingModel.route_all` at the first call of the step (kept
        until the first layer binds again; in a captured graph those kernels replay with it); larger ones per
        layer."""
        keys, pos = self.current()
        if routing.batches_layers(pos.shape[0]):
            if self._all is None:
                self._all = routing.route_all(keys, pos)
            return self._all[1 if predict else 0][routing.layer_slot(layer)]
        return routing.predict(layer, keys, pos) if predict else routing.route(layer, keys, pos)

    def current(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys [T], positions [T])`` of the step. Raises RuntimeError when no positions were bound."""
        if self.positions is None:
            raise RuntimeError("routing model: no positions bound (a MoE block ran outside a decoder layer)")
        pos = self.positions
        keys = self.keys
        if keys is None or keys.shape != pos.shape:
            keys = torch.zeros_like(pos)
        return keys, pos


def sequence_key(token_ids: list[int], seed: int = 0, prefix: int = 16) -> int:
    """A sequence's routing key from its first ``prefix`` prompt token ids (a resend or a preempted request gets
    the same key; two requests with the same opening share their routing, as they would in a real model until
    they diverge): a non-negative 63-bit int."""
    return _int_seed(seed, "routing-key", *token_ids[:prefix])
