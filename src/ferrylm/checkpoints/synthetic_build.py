"""Build a synthetic model (:mod:`ferrylm.synthetic.spec`) in memory: real shapes, seeded random weights.

Weight values (cheap and seeded). Drawing billions of normal samples costs seconds per GiB on a CPU, so
:class:`SeededPool` draws ``POOL_SIZE`` (16 Mi) standard-normal values once from ``torch.Generator`` seeded with the
spec's seed, and fills every tensor with windows of that pool times a random sign per column
(:meth:`SeededPool.fill_`), offsets and signs drawn from generators seeded with ``(seed, tensor name)``. Filling
runs at memory-copy speed (a few seconds for the 1.9 G parameters of ``qwen3-30b-a3b:layers=2`` on two CPU
cores). Values within a window are independent normals; two tensors (or two chunks of a tensor larger than half
the pool) may read the same values, but under different sign patterns, so their rows are uncorrelated. That is
enough for what synthetic models are for (timing, memory, routing and cache behaviour). Scales: norms 1, biases
0, embeddings ``N(0, 1)``, every other matrix ``N(0, 1/fan_in)`` (so activations stay O(1) through the residual
stream) except the ones that write into the residual stream (``o_proj``, ``down``), which get an extra
``1 / sqrt(2 L)`` (:func:`residual_scale`, GPT-2's scaled initialisation) so that every layer routes by the current
token; router rows random directions of norm ``ROUTER_STD`` (below).

Routing skew (``skew=A``). Expert ``e`` of a MoE layer gets a popularity rank ``r_e`` (a seeded random permutation of
``1..E`` per layer) and target top-1 probability ``p_e = r_e^-A / sum_r r^-A`` (Zipf's law; A = 0 is uniform).
The router gets a bias ``b_e`` (``gate.bias``, switched on by the config's ``ferrylm_router_bias``) chosen so
that the top-1 expert of a random token follows ``p`` exactly under this model of the router logits:

- the router input ``x`` is the output of the RMSNorm before the MoE block (RMS 1); for a random direction of
  ``x`` the data term ``(W x)_e`` is ``N(0, |w_e|^2)``; the router rows are rescaled to equal norm
  ``ROUTER_STD`` (= 1), so every expert's logit is ``N(b_e, 1)``, nearly independent across experts (random rows
  are nearly orthogonal when ``E <= H``);
- for independent ``N(b_e, s^2)`` logits, ``P(argmax = e) = P_e(b) = integral phi_s(t - b_e) prod_{j != e}
  Phi_s(t - b_j) dt``. :func:`calibrated_bias` solves ``P_e(b) = p_e`` by Newton's method with the analytic
  Jacobian on a 4001-point grid (3-6 iterations, about a second at most for 128 experts; max |log P - log p| below
  1e-7), once per ``(E, A)``; each layer permutes the result by its ranks.

Simply adding ``log p_e`` (exact for Gumbel-distributed data terms, the Gumbel-max trick) over-sharpens Gaussian
logits: at ``A = 1``, ``E = 128`` the top expert would get 48 % of the tokens instead of 18 %. The top-k
(k > 1) choices are flatter than ``p`` by construction; ``skew`` describes the top-1 law. Real hidden states are
not isotropic, so inside a model the law holds approximately; the ranking holds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import random

import torch

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts import ExpertOptions, build_executor
from ferrylm.experts.executor import ExpertMath, LayerExperts
from ferrylm.checkpoints.assemble import (LoadedModel, build_on_meta, placement, prepare_for_inference,
                                          tensor_dtype)
from ferrylm.checkpoints.ple_tables import PoolTable
from ferrylm.models.registry import get_model_class
from ferrylm.synthetic.routing_profiles import ROUTER, get_profile
from ferrylm.synthetic.spec import SyntheticSpec, parse_synthetic_spec, synthetic_config
from ferrylm.models.tensor_parallel import (TPShard, check_shardable, full_shape, shard_config, split_of,
                                            split_part)

log = logging.getLogger("ferrylm.models")

POOL_SIZE = 1 << 24
ROUTER_STD = 1.0  # norm of every router row = std of each expert's data term for a unit-RMS input
_GRID = 4001


def _int_seed(*parts: object) -> int:
    """A 63-bit seed derived from ``parts`` (stable across runs and platforms, unlike ``hash``)."""
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:15], 16)


class SeededPool:
    """``size`` standard-normal values from a seeded generator; tensors are filled with scaled windows of them.

    Args:
        seed: generator seed (the spec's ``seed``).
        size: pool length; a tensor larger than this is filled in ``size``-long chunks, each its own window.
    """

    def __init__(self, seed: int, size: int = POOL_SIZE):
        self.seed = seed
        self._base = torch.randn(size, generator=torch.Generator().manual_seed(_int_seed(seed, "pool")))
        self._copies: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def _values(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._copies:
            self._copies[key] = self._base.to(device=device, dtype=dtype)
        return self._copies[key]

    def fill_(self, t: torch.Tensor, std: float, key: str) -> torch.Tensor:
        """Fill the contiguous floating tensor ``t`` in place with pool windows times ``std``, chosen by ``key``
        (the same key and seed always give the same values). Returns ``t``.

        ``t`` is viewed as rows of its last dim ``L`` and filled in chunks of whole rows (at most half the pool);
        each chunk is one pool window at a random offset, multiplied column-wise by its own random sign vector
        ``[L]``. The signs keep rows of different chunks or tensors that happen to read the same pool values
        uncorrelated (no repeated lm_head rows, no embedding row aligned with an lm_head row)."""
        vals = self._values(t.device, t.dtype)
        size = vals.numel()
        width = t.shape[-1] if t.dim() else 1
        rows = t.view(-1, width)
        chunk_rows = max(1, (size // 2) // width)
        rng = random.Random(_int_seed(self.seed, key))
        g = torch.Generator().manual_seed(rng.getrandbits(63))
        start, total = 0, rows.shape[0]
        while start < total:
            r = min(total - start, chunk_rows)
            off = rng.randrange(size - r * width + 1)
            signs = torch.randint(0, 2, (width,), generator=g).to(torch.float32).mul_(2.0 * std).sub_(std)
            torch.mul(vals[off:off + r * width].view(r, width), signs.to(device=t.device, dtype=t.dtype),
                      out=rows[start:start + r])
            start += r
        return t


def zipf_probs(num_experts: int, skew: float) -> torch.Tensor:
    """``[E]`` float64 Zipf probabilities by rank: ``p_r = r^-skew / sum_j j^-skew`` for ``r = 1..E``."""
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
    logits = -skew * torch.log(ranks)
    return torch.softmax(logits, 0)


def expert_ranks(num_experts: int, seed: int, layer_idx: int) -> torch.Tensor:
    """``[E]`` int64 popularity rank (1 = most popular) of each expert of a layer: a permutation seeded by
    ``(seed, layer_idx)``."""
    g = torch.Generator().manual_seed(_int_seed(seed, layer_idx, "zipf"))
    return torch.randperm(num_experts, generator=g) + 1


def _top1_terms(bias: torch.Tensor, std: float):
    """Grid quantities of ``P_e(b)`` (module docstring): ``z [E, N]``, ``log Phi(z)``, ``log pdf``,
    ``log integrand [E, N]``, ``log P [E]``, grid step."""
    t = torch.linspace(bias.min().item() - 8 * std, bias.max().item() + 8 * std, _GRID, dtype=torch.float64)
    dt = (t[1] - t[0]).item()
    z = (t[None, :] - bias[:, None]) / std
    log_cdf = torch.special.log_ndtr(z)
    log_pdf = -0.5 * z * z - 0.5 * math.log(2 * math.pi) - math.log(std)
    log_integrand = log_pdf + log_cdf.sum(0)[None, :] - log_cdf
    log_p = torch.logsumexp(log_integrand, 1) + math.log(dt)
    return z, log_cdf, log_pdf, log_integrand, log_p, dt


def top1_probs(bias: torch.Tensor, std: float = ROUTER_STD) -> torch.Tensor:
    """``[E]`` probability that expert ``e`` has the largest of independent ``N(bias_e, std^2)`` logits."""
    return torch.exp(_top1_terms(bias.double(), std)[4])


@functools.lru_cache(maxsize=64)
def _calibrated_by_rank(num_experts: int, skew: float, std: float) -> torch.Tensor:
    target = torch.log(zipf_probs(num_experts, skew))
    bias = target.clone()
    for _ in range(50):
        z, log_cdf, log_pdf, log_integrand, log_p, dt = _top1_terms(bias, std)
        err = target - log_p
        worst = err.abs().max().item()
        if worst < 1e-9:
            break
        # d log P_e / d b_k = -E_e[pdf_k / Phi_k] (k != e), E_e[z_e / std] (k == e); E_e = integrand_e / P_e
        w = torch.exp(log_integrand - log_p[:, None]) * dt
        jac = -(w @ torch.exp(log_pdf - log_cdf).T)
        jac.diagonal().copy_((w * z / std).sum(1))
        step = torch.linalg.solve(jac + 1.0 / num_experts, err)  # + 1/E fixes the shift invariance (jac @ 1 = 0)
        scale = 1.0
        while scale > 1e-6:  # backtracking: accept the first step that lowers the worst error
            trial = bias + scale * step
            if (target - _top1_terms(trial, std)[4]).abs().max().item() < worst:
                bias = trial
                break
            scale /= 2
        else:
            break
    return (bias - bias.max()).float()


def calibrated_bias(num_experts: int, skew: float, seed: int, layer_idx: int,
                    std: float = ROUTER_STD) -> torch.Tensor:
    """Router bias ``[E]`` (float32) of one layer for the Zipf law of exponent ``skew`` (method in the module
    docstring): the per-rank solution, permuted by :func:`expert_ranks`. All zeros when ``skew == 0``."""
    if skew == 0:
        return torch.zeros(num_experts)
    by_rank = _calibrated_by_rank(num_experts, float(skew), float(std))
    return by_rank[expert_ranks(num_experts, seed, layer_idx) - 1]


def _init_(t: torch.Tensor, name: str, config: ModelConfig, spec: SyntheticSpec, pool: SeededPool) -> None:
    """Initialise the model tensor ``name`` in place (scales in the module docstring; a model class may name
    constants of its own: ``synthetic_constant(name) -> float | None``, e.g. zero-centred norms start at 0)."""
    constant = getattr(get_model_class(config.architecture), "synthetic_constant", None)
    value = constant(name) if constant is not None else None
    if value is not None:
        t.fill_(value)
    elif name.endswith("norm.weight"):
        t.fill_(1.0)
    elif name.endswith("gate.tid2eid"):  # a hash router's table (DeepSeek-V4): k distinct experts per token
        e, k = config.num_experts, t.shape[1]
        rows = torch.arange(t.shape[0], device=t.device)[:, None] * 7919 + torch.arange(k, device=t.device) * (e // k)
        t.copy_(rows % e)
    elif name.endswith(".mlp.gate.bias"):  # router bias: the Zipf law of this layer
        layer = int(name.split(".")[2])
        t.copy_(calibrated_bias(t.shape[0], spec.skew, spec.seed, layer))
    elif name.endswith((".bias", "e_score_correction_bias")):  # a sigmoid router's selection bias: no skew of its own
        t.zero_()
    elif name.endswith("embed_tokens.weight"):
        pool.fill_(t, 1.0, name)
    elif name.endswith(".mlp.gate.weight"):  # router: random directions, every row of norm ROUTER_STD
        pool.fill_(t, 1.0, name)
        norms = t.float().norm(dim=1, keepdim=True)
        t.copy_(t.float() * (ROUTER_STD / norms))
    elif name.endswith(("o_proj.weight", "down_proj.weight")):  # writes into the residual stream
        pool.fill_(t, residual_scale(config) / math.sqrt(t.shape[-1]), name)
    else:
        pool.fill_(t, 1.0 / math.sqrt(t.shape[-1]), name)


def residual_scale(config: ModelConfig) -> float:
    """Extra factor ``1 / sqrt(2 L)`` on the std of every matrix that writes into the residual stream (attention
    ``o_proj``, MLP and expert ``down``): the scaled initialisation of GPT-2 (Radford et al. 2019, §2.3) and
    Megatron-LM. Without it, the ``2 L`` unit-size residual writes of a random model swamp the token embedding:
    the hidden state converges to a token-independent direction, and the deeper layers of a deep model route most
    of each token's experts exactly as the previous token did (docs/BENCHMARKS.md). With it every layer routes by
    the current token, so the popularity law (``skew``) is what the expert cache sees."""
    return 1.0 / math.sqrt(2 * config.num_layers)


def attach_routing_model(model, config: ModelConfig, spec: SyntheticSpec, device: torch.device | str):
    """Let the routing model of ``spec.routing`` choose every MoE block's experts (models/moe.py): one
    :class:`~ferrylm.synthetic.routing_model.RoutingModel` (seeded by ``spec.seed``) and one
    :class:`~ferrylm.synthetic.routing_model.RoutingContext` shared by all blocks, bound by every decoder layer.
    Returns the routing context (the step's owner sets sequence keys on it)."""
    from ferrylm.synthetic.routing_model import RoutingContext, RoutingModel

    moe_layers = tuple(model.moe_layer_indices(config))
    routing = RoutingModel(get_profile(spec.routing), config.num_experts, config.num_experts_per_tok, spec.seed,
                           layers=moe_layers, device=device)
    context = RoutingContext(first_layer=model.model.layers[0])
    for i, layer in enumerate(model.model.layers):
        layer.routing_context = context
        if i in moe_layers:
            layer.mlp.use_routing(routing, context)
    model.routing_context = context
    return context


def _pool_ple_tables(model, model_cls: type, config: ModelConfig, pool: SeededPool, device: torch.device,
                     dtype: torch.dtype) -> None:
    """Give a model with per-layer embeddings tables that read rows from the seeded pool (``PoolTable``: the
    published tables hold ~51B parameters; a synthetic model keeps none)."""
    shape_of = getattr(model_cls, "ple_shape", None)   # only Qwen4-Exp has per-layer embeddings
    shape = shape_of(config) if shape_of is not None else None
    if shape is None:
        return

    values = pool._values(torch.device(device), dtype)
    model.use_ple_tables({layer: PoolTable(values, shape.head_dim, 1.0) for layer in shape.layers})


def build_synthetic(spec: SyntheticSpec | str, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.bfloat16, moe_backend: str | ExpertOptions = "resident",
                    expert_device: torch.device | str | None = None, pin_experts: bool = False,
                    tp: TPShard | None = None) -> LoadedModel:
    """Make the model of ``spec`` with seeded random weights; nothing is read from or written to disk.

    Args:
        spec: a :class:`~ferrylm.synthetic.spec.SyntheticSpec` or a ``synthetic:...`` string.
        device: where the non-expert weights (and RoPE tables) are made; the compute device.
        dtype: floating dtype of every weight (bfloat16 by default: a synthetic model is about shapes and bytes).
        moe_backend: expert backend (``ferrylm.experts.MOE_BACKENDS``); the resident backend moves the experts to
            ``device``.
        expert_device: where the routed-expert stacks are made (default: ``device`` for the resident backend,
            host memory for the offloading ones, see ``ferrylm.experts.expert_home``).
        pin_experts: allocate CPU expert stacks in page-locked memory (only when CUDA is available; ignored
            otherwise).
        tp: a tensor-parallel rank's shard (:mod:`ferrylm.models.tensor_parallel`): the same values as the whole
            model's, cut to this rank (each split tensor is made whole, one at a time, then cut: an expert stack of
            one layer and projection at most), so TP = N computes what TP = 1 does. Plain (unquantized) only.

    Returns:
        :class:`~ferrylm.checkpoints.assemble.LoadedModel`, model in eval mode, gradients off. Memory: about
        ``(L * E * 3 * H * I + 2 * V * H + attention) * dtype bytes``, e.g. 3.7 GiB for
        ``qwen3-30b-a3b:layers=2`` in bfloat16.

    Raises:
        ModelLoadError: a bad spec string or an architecture config the model class refuses; ValueError: unknown
        ``moe_backend``.
    """
    if isinstance(spec, str):
        spec = parse_synthetic_spec(spec)
    full = ModelConfig.from_dict(synthetic_config(spec))
    split = tp is not None and tp.is_split
    if split and spec.quant:
        raise ModelLoadError(f"--tensor-parallel-size {tp.size}: quantized synthetic experts ({spec.quant}) are not "
                             f"split by tensor parallel yet")
    config = shard_config(full, tp) if split else full
    model_cls, device, exp_dev, pin = placement(config, device, moe_backend, expert_device, pin_experts)
    if split:
        check_shardable(model_cls, config, tp)
    if pin_experts and not pin:
        log.info("pin_experts ignored: experts are on %s or CUDA is unavailable", exp_dev)
    mk = _Maker(spec, model_cls, config, full, tp if split else None, SeededPool(spec.seed), device, exp_dev, dtype,
                pin)
    stacks = {layer: mk.layer_experts(layer) for layer in model_cls.moe_layer_indices(config)}
    executor = build_executor(moe_backend, stacks, device) if stacks else None

    model = build_on_meta(model_cls, config, executor, device)
    model.load_state_dict(mk.tensors(model.state_dict()), strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    prepare_for_inference(model)
    _pool_ple_tables(model, model_cls, config, mk.pool, device, dtype)
    if spec.routing != ROUTER:
        attach_routing_model(model, config, spec, device)
    log.info("built %s: %d layers (%d MoE), %s on %s, experts on %s%s", spec.name, config.num_layers, len(stacks),
             str(dtype).removeprefix("torch."), device, exp_dev, f" ({mk.quant.describe()})" if mk.quant else "")
    return LoadedModel(model=model, config=config, executor=executor)


class _Maker:
    """Makes the weights of one synthetic build from the seeded pools: the routed-expert stacks (plain, or random
    codes of ``spec.quant``) and every other tensor of the model, each cut to the shard ``tp`` (None: whole).
    ``config`` is the (per-rank) config, ``full`` the whole model's."""

    def __init__(self, spec: SyntheticSpec, model_cls: type, config: ModelConfig, full: ModelConfig,
                 tp: TPShard | None, pool: SeededPool, device: torch.device, exp_dev: torch.device,
                 dtype: torch.dtype, pin: bool) -> None:
        self.spec, self.model_cls, self.config, self.full, self.tp = spec, model_cls, config, full, tp
        self.pool, self.device, self.exp_dev, self.dtype, self.pin = pool, device, exp_dev, dtype, pin
        self.quant = self.codes = None
        if spec.quant:
            from ferrylm.synthetic.quant import SYNTHETIC_FORMATS, CodePool

            self.quant, self.codes = SYNTHETIC_FORMATS[spec.quant], CodePool(spec.seed)
            try:
                self.quant.check(config.hidden_size, config.moe_intermediate_size)
            except ValueError as err:
                raise ModelLoadError(f"{spec.name}: {err}") from None

    def layer_experts(self, layer: int) -> LayerExperts:
        """MoE layer ``layer``'s stacks (and, for gpt-oss, small random expert biases on the compute device)."""
        c = self.config
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        i_full = self.full.moe_intermediate_size   # the fan-in of down: the whole expert's width
        experts = LayerExperts(gate=self._stack(layer, "gate", e, i, h, fan_in=h),
                               up=self._stack(layer, "up", e, i, h, fan_in=h),
                               down=self._stack(layer, "down", e, h, i, fan_in=i_full, scale=residual_scale(c)))
        swiglu = self.model_cls.expert_swiglu(c)
        if swiglu is not None:
            def bias(part: str, *shape: int) -> torch.Tensor:
                return self.pool.fill_(torch.empty(*shape, device=self.device, dtype=self.dtype), 0.02,
                                       f"model.layers.{layer}.mlp.experts.{part}_bias")
            experts.math = ExpertMath(bias("gate", e, i), bias("up", e, i), bias("down", e, h), *swiglu)
        return experts

    def _stack(self, layer: int, part: str, *shape: int, fan_in: int, scale: float = 1.0) -> torch.Tensor:
        key = f"model.layers.{layer}.mlp.experts.{part}"
        std = scale / math.sqrt(fan_in)
        if self.quant is not None:
            from ferrylm.synthetic.quant import random_stack

            fmt = self.quant.down if part == "down" else self.quant.gate_up
            return random_stack(self.codes, fmt, *shape, std, key, device=self.exp_dev, dtype=self.dtype,
                                pin_memory=self.pin)
        t = torch.empty(*shape, device=self.exp_dev, dtype=self.dtype, pin_memory=self.pin)
        if self.tp is None:
            return self.pool.fill_(t, std, key)
        # the whole stack's values (one layer, one projection), then this rank's part
        cut = 1 if part != "down" else 2
        whole = list(shape)
        whole[cut] *= self.tp.size
        values = self.pool.fill_(torch.empty(*whole, device=self.exp_dev, dtype=self.dtype), std, key)
        return t.copy_(split_part(values, cut, self.tp))

    def tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor of the meta-built model's ``state`` dict, made on the compute device: split ones made whole
        (the same values as TP = 1), then cut; rank-0-only ones zero on the other ranks."""
        full, tp, tensors = self.full, self.tp, {}
        for name, meta in state.items():
            kind = tensor_dtype(self.model_cls, name, self.dtype) if meta.is_floating_point() else meta.dtype
            how = split_of(name, full, tp) if tp is not None else None
            if isinstance(how, tuple):
                whole = torch.empty(full_shape(name, tuple(meta.shape), full, tp), device=self.device, dtype=kind)
                _init_(whole, name, full, self.spec, self.pool)
                t = split_part(whole, how[0], TPShard(how[2], how[1]))
            else:
                t = torch.empty(meta.shape, device=self.device, dtype=kind)
                _init_(t, name, full, self.spec, self.pool)
                if how == "rank0" and tp.rank:
                    t.zero_()
            tensors[name] = t
        return tensors
