"""Qwen3-Next (``Qwen3NextForCausalLM``, Qwen3-Next-80B-A3B) and Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``,
Qwen3.5-35B-A3B): hybrid decoders of Gated DeltaNet layers and gated full-attention layers, every MLP a sparse MoE
block with a sigmoid-gated shared expert.

Layer pattern: config ``layer_types`` (``"linear_attention"`` / ``"full_attention"``), else every
``full_attention_interval``-th layer (default 4) is full attention: layer ``i`` is linear when
``(i + 1) % interval != 0``.

* Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"): projections give ``q, k`` (``Hk`` heads of
  ``Dk``), ``v`` and the output gate ``z`` (``Hv`` heads of ``Dv``), ``b`` and ``a`` (one per value head). Qwen3-Next
  packs them per key-head group (``in_proj_qkvz [Hk * (2 Dk + 2 Dv Hv/Hk), H]``: for each key head its q, k, then its
  value heads' v, then their z; ``in_proj_ba [Hk * 2 Hv/Hk, H]`` likewise); Qwen3.5 keeps four matrices
  (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). ``[q | k | v]`` goes through a depthwise causal
  conv of ``K = linear_conv_kernel_dim`` taps + SiLU, ``q``/``k`` are L2-normalised, ``q`` scaled by ``Dk ** -0.5``,
  ``beta = sigmoid(b)``, log decay ``g = -exp(A_log) * softplus(a + dt_bias)``; the gated delta rule
  (``models/kernels/gated_delta.py``) gives ``o``, then ``RMSNorm(o) * silu(z)`` per value head (a plain weight)
  and ``out_proj``. A key head serves ``Hv / Hk`` consecutive value heads.
* Gated attention: ``q_proj`` gives per head ``[q | gate]`` (``2 D``), q/k get a zero-centred RMSNorm per head
  (``x * rsqrt(mean x^2 + eps) * (1 + w)``), RoPE over the first ``partial_rotary_factor * D`` dims (0.25 when the
  config names none, the reference's default), ``attention(q, k, v) * sigmoid(gate)``, ``o_proj``.
* Norms of the residual stream (input / post-attention / final) are zero-centred too.
* MoE: softmax router, top ``num_experts_per_tok``, renormalised when ``norm_topk_prob`` (Qwen3-Next; always for
  Qwen3.5), plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (``models/moe.SparseMoeBlock``).

State: only the full-attention layers store K/V (:meth:`Qwen3NextForCausalLM.kv_layout`); each linear layer keeps a
per-sequence recurrent state in the engine's state pool (``engine/cache/state_pool.py``,
:meth:`Qwen3NextForCausalLM.state_layout`), reached through ``attn.recurrent``. Without one (a reference backend
such as ``models/attention.DenseCausalAttention``) the backend object holds one sequence's state itself.

Checkpoint names follow transformers: ``model.layers.N.linear_attn.{in_proj_qkvz,in_proj_ba,conv1d,A_log,dt_bias,
norm,out_proj}``, ``model.layers.N.self_attn.{q,k,v,o}_proj / q_norm / k_norm``, ``mlp.gate``, ``mlp.experts``,
``mlp.shared_expert``, ``mlp.shared_expert_gate``. Multi-token-prediction tensors (``mtp.*``) are not read; a
Qwen3.5 checkpoint's ``model.language_model.*`` names map onto ``model.*`` and its vision tower is not read.
Decode CUDA graphs: the whole-step graphs (``engine/cuda_graphs.py``) and the piecewise graphs of the offloading
backends (``engine/decode_graph.py``) capture these models, the linear layers reading static slot / fresh buffers.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.models.attention import AttentionBackend
from ferrylm.models.kernels import gated_delta as gd
from ferrylm.models.layers import RotaryEmbedding, SwiGLUMLP, config_rotary_dim
from ferrylm.models.moe import SparseMoeBlock, check_moe_config, hand_routers, router_has_bias, sparse_layer_indices

LINEAR, FULL = "linear_attention", "full_attention"


# --- config ---------------------------------------------------------------------------------------------------


def _int(raw: dict, key: str, default: int | None = None) -> int:
    v = raw.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < 1:
        raise ModelLoadError(f"config field {key!r} must be a positive integer, got {v!r}")
    return int(v)


def layer_types(config: ModelConfig) -> tuple[str, ...]:
    """Each layer's token mixer (``"linear_attention"`` or ``"full_attention"``): ``layer_types``, else from
    ``full_attention_interval`` (module docstring).

    Raises:
        ModelLoadError: ``layer_types`` of the wrong length or with another kind; a bad interval.
    """
    raw = config.raw
    types = raw.get("layer_types")
    if types is None:
        every = _int(raw, "full_attention_interval", 4)
        return tuple(LINEAR if (i + 1) % every else FULL for i in range(config.num_layers))
    if not isinstance(types, list) or len(types) < config.num_layers:
        raise ModelLoadError(f"config field 'layer_types' must list the {config.num_layers} layers' kinds, got "
                             f"{types!r}")
    bad = [t for t in types if t not in (LINEAR, FULL)]
    if bad:
        raise ModelLoadError(f"config field 'layer_types': unsupported layer kind {bad[0]!r} (only {LINEAR!r} and "
                             f"{FULL!r})")
    return tuple(types[:config.num_layers])


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """Gated DeltaNet dims from the config: ``Hk`` key heads of ``Dk``, ``Hv`` value heads of ``Dv``, ``K`` taps."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @staticmethod
    def of(config: ModelConfig) -> "LinearShape":
        raw = config.raw
        s = LinearShape(key_heads=_int(raw, "linear_num_key_heads", 16), key_dim=_int(raw, "linear_key_head_dim", 128),
                        value_heads=_int(raw, "linear_num_value_heads", 32),
                        value_dim=_int(raw, "linear_value_head_dim", 128),
                        conv_kernel=_int(raw, "linear_conv_kernel_dim", 4))
        if s.value_heads % s.key_heads:
            raise ModelLoadError(f"linear_num_value_heads {s.value_heads} is not a multiple of linear_num_key_heads "
                                 f"{s.key_heads}")
        if s.conv_kernel < 2:
            raise ModelLoadError(f"linear_conv_kernel_dim must be >= 2, got {s.conv_kernel}")
        return s


def _with_default_rotary(config: ModelConfig) -> ModelConfig:
    """``config`` with ``partial_rotary_factor`` 0.25 when it names none (the reference config's default)."""
    raw = config.raw
    named = raw.get("rotary_dim") is not None or raw.get("partial_rotary_factor") is not None or any(
        isinstance(p, dict) and p.get("partial_rotary_factor") is not None
        for p in (raw.get("rope_parameters"), raw.get("rope_scaling")))
    return config if named else dataclasses.replace(config, raw={**raw, "partial_rotary_factor": 0.25})


# --- norms ----------------------------------------------------------------------------------------------------


class ZeroCentredRMSNorm(nn.Module):
    """``(x * rsqrt(mean(x^2) + eps) * (1 + w))`` computed in float32, cast back to ``x``'s dtype; ``w`` starts at 0
    (Qwen3-Next's "zero-centred" norm). ``x [..., N]`` -> ``[..., N]``."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)


#: output-gate activations of the DeltaNet's gated norm (Qwen4-Exp's ``output_gate_type``; SiLU elsewhere)
GATE_ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


class GroupedRMSNorm(nn.Module):
    """:class:`ZeroCentredRMSNorm` of each ``group``-wide slice (Qwen4-Exp's norm of its residual streams):
    ``x [..., n g]`` -> ``[..., n g]``, weight ``[n g]``."""

    def __init__(self, size: int, group: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = x.float().unflatten(-1, (-1, self.group))
        normed = F.rms_norm(g, (self.group,), eps=self.eps).flatten(-2)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``w * RMSNorm(x) * act(z)`` over the last dim (``act``: SiLU, or sigmoid, :data:`GATE_ACTIVATIONS`): the
    statistic in float32, the normalised ``x`` cast to its dtype before the weight, the gate in float32, the product
    cast back. ``x, z [..., N]`` -> ``[..., N]``."""

    def __init__(self, size: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.act = GATE_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (normed * self.act(z.float())).to(x.dtype)


# --- the linear-attention layer --------------------------------------------------------------------------------


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet token mixer (module docstring). Subclasses define :meth:`project`.

    Args:
        layer_idx: decoder layer index (its state lives under this number in the state pool).
        hidden_size: ``H``; shape: the head layout; eps: the gated norm's epsilon; gate_activation: its output
            gate's activation (a key of :data:`GATE_ACTIVATIONS`).
    """

    def __init__(self, layer_idx: int, hidden_size: int, shape: LinearShape, eps: float,
                 gate_activation: str = "silu"):
        super().__init__()
        self.layer_idx = layer_idx
        self.shape = shape
        s = shape
        self.conv1d = nn.Conv1d(s.conv_channels, s.conv_channels, s.conv_kernel, groups=s.conv_channels, bias=False,
                                padding=s.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(s.value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.value_heads))
        self.norm = GatedRMSNorm(s.value_dim, eps, gate_activation)
        self.out_proj = nn.Linear(s.value_heads * s.value_dim, hidden_size, bias=False)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden [T, H]`` -> ``(qkv [T, C] as [q | k | v], z [T, Hv, Dv], b [T, Hv], a [T, Hv])``."""
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``hidden [T, H]`` -> ``[T, H]``; reads and writes the step's sequences' states (``attn.recurrent``).

        Raises what the fault point ``deltanet_scratch`` injects (after the conv state write, before the delta
        rule's scratch), as a real allocation failure there would.
        """
        s = self.shape
        t = hidden.shape[0]
        rs = getattr(attn, "recurrent", None)
        if rs is None:
            rs = _own_state(attn, self, hidden)
        qkv, z, b, a = self.project(hidden)
        li = self.layer_idx
        conv_state, rec_state = rs.pool.conv[li], rs.pool.rec[li]
        fresh = rs.fresh
        prev = torch.where(fresh[:, None, None], 0.0, conv_state[rs.slots]).to(qkv.dtype)
        if rs.conv_index is None:
            rs.conv_index = gd.conv_window_index(rs.query_start_loc, t, s.conv_kernel, one_token_each=rs.decode_only)
        mixed, new_prev = gd.causal_conv_varlen(qkv, self.conv1d.weight[:, 0, :], prev, rs.query_start_loc,
                                                rs.conv_index)
        conv_state.index_copy_(0, rs.slots, new_prev.to(conv_state.dtype))
        rs.written = True
        faults = getattr(rs, "faults", None)
        if faults is not None and faults.enabled and not rs.decode_only:
            faults.check("deltanet_scratch", nbytes=4 * t * s.value_heads * (2 * s.key_dim + s.value_dim + 64))
        kd, vd = s.key_heads * s.key_dim, s.value_heads * s.value_dim
        q, k, v = mixed.split([kd, kd, vd], dim=-1)
        rep = s.value_heads // s.key_heads
        q = gd.l2_normalize(q.reshape(t, s.key_heads, s.key_dim)) * s.key_dim ** -0.5
        k = gd.l2_normalize(k.reshape(t, s.key_heads, s.key_dim))
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        v = v.reshape(t, s.value_heads, s.value_dim).float()
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = self._delta_rule(rs, rec_state, q, k, v, g, beta)
        o = self.norm(o.to(hidden.dtype), z)
        return self.out_proj(o.reshape(t, s.value_heads * s.value_dim))

    def _delta_rule(self, rs, rec_state: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
        """The gated delta rule over the step's sequences: one batched step for a decode-only step, else per
        prefill sequence the chunk form and the decodes batched. Writes each sequence's final state into its
        slot. Returns ``o [T, Hv, Dv]`` float32."""
        fresh = rs.fresh[:, None, None, None]
        if rs.decode_only:
            state = torch.where(fresh, 0.0, rec_state[rs.slots])
            o, state = gd.gated_delta_step(q, k, v, g, beta, state)
            rec_state.index_copy_(0, rs.slots, state)
            return o
        out = torch.empty_like(v)
        q_lens = rs.q_lens
        starts, idx, rows = rs.split()
        if idx is not None:
            slots = rs.slots[idx]
            state = torch.where(fresh[idx], 0.0, rec_state[slots])
            o, state = gd.gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
            out[rows] = o
            rec_state.index_copy_(0, slots, state)
        for i, n in enumerate(q_lens):
            if n == 1:
                continue
            lo, hi = starts[i], starts[i] + n
            slot = rs.slots[i:i + 1]
            state = torch.where(fresh[i:i + 1], 0.0, rec_state[slot])[0]
            o, state = gd.chunked(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
            out[lo:hi] = o
            rec_state.index_copy_(0, slot, state[None])
        return out


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's packing: ``in_proj_qkvz`` and ``in_proj_ba`` grouped per key head (module docstring)."""

    def __init__(self, layer_idx: int, hidden_size: int, shape: LinearShape, eps: float):
        super().__init__(layer_idx, hidden_size, shape, eps)
        s = shape
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * s.key_heads * s.key_dim + 2 * s.value_heads * s.value_dim,
                                      bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * s.value_heads, bias=False)

    def project(self, hidden):
        s = self.shape
        t, rep = hidden.shape[0], s.value_heads // s.key_heads
        grouped = self.in_proj_qkvz(hidden).view(t, s.key_heads, 2 * s.key_dim + 2 * rep * s.value_dim)
        q, k, v, z = grouped.split([s.key_dim, s.key_dim, rep * s.value_dim, rep * s.value_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).view(t, s.key_heads, 2 * rep).split([rep, rep], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return (qkv, z.reshape(t, s.value_heads, s.value_dim), b.reshape(t, s.value_heads),
                a.reshape(t, s.value_heads))


class Qwen35GatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's four projections ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""

    def __init__(self, layer_idx: int, hidden_size: int, shape: LinearShape, eps: float,
                 gate_activation: str = "silu"):
        super().__init__(layer_idx, hidden_size, shape, eps, gate_activation)
        s = shape
        self.in_proj_qkv = nn.Linear(hidden_size, s.conv_channels, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, s.value_heads * s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, s.value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, s.value_heads, bias=False)

    def project(self, hidden):
        s = self.shape
        t = hidden.shape[0]
        return (self.in_proj_qkv(hidden), self.in_proj_z(hidden).view(t, s.value_heads, s.value_dim),
                self.in_proj_b(hidden), self.in_proj_a(hidden))


def _own_state(attn, layer: GatedDeltaNet, hidden: torch.Tensor):
    """A backend without a state pool (``DenseCausalAttention``, ``SequenceCacheAttention``): one sequence, whose
    state the backend object keeps (one private one-slot pool per layer; zeros on the first call)."""
    from ferrylm.engine.cache.state_pool import RecurrentStep, StateLayout, StatePool

    pools = attn.__dict__.setdefault("_linear_state_pools", {})
    s, dev, t = layer.shape, hidden.device, hidden.shape[0]
    first = layer.layer_idx not in pools
    if first:
        pools[layer.layer_idx] = StatePool(StateLayout((layer.layer_idx,), s.conv_channels, s.conv_kernel,
                                                       s.value_heads, s.key_dim, s.value_dim), 1, hidden.dtype, dev)
    return RecurrentStep(pool=pools[layer.layer_idx], slots=torch.zeros(1, dtype=torch.long, device=dev),
                         fresh=torch.tensor([first], device=dev), query_start_loc=torch.tensor([0, t], device=dev),
                         num_tokens=t, q_lens=[t])


# --- the gated full-attention layer ----------------------------------------------------------------------------


class GatedAttention(nn.Module):
    """GQA attention with an output gate and zero-centred per-head q/k norms (module docstring).

    Args:
        layer_idx: passed to ``attn.attend``; config: the model config (heads, ``head_dim``, ``attention_bias``,
            ``rms_norm_eps``); rotary: the model's partial RoPE.
    """

    def __init__(self, layer_idx: int, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        h, hq, hk, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        bias = bool(config.raw.get("attention_bias", False))
        self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim = layer_idx, hq, hk, d
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(h, hq * d * 2, bias=bias)
        self.k_proj = nn.Linear(h, hk * d, bias=bias)
        self.v_proj = nn.Linear(h, hk * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, h, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``hidden [T, H]`` at ``positions [T]`` -> ``[T, H]``; K/V go through ``attn``."""
        q, k, v, gate = self.project(positions, hidden)
        return self.output(attn.attend(self.layer_idx, q, k, v, self.scale), gate)

    def project(self, positions: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden [T, H]`` -> ``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], gate [T, Hq, D])``, q/k normed and
        rotated."""
        t, hq, hk, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = self.q_proj(hidden).view(t, hq, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(hidden).view(t, hk, d))
        v = self.v_proj(hidden).view(t, hk, d)
        q, k = self.rotary(positions, q, k)
        return q, k, v, gate

    def output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Attention output ``[T, Hq, D]`` gated by ``sigmoid(gate)``, through ``o_proj`` -> ``[T, H]``."""
        t = out.shape[0]
        return self.o_proj(out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))


# --- decoder ----------------------------------------------------------------------------------------------------


class HybridDecoderLayer(nn.Module):
    """``h = x + mixer(norm1(x)); y = h + mlp(norm2(h))`` with a Gated DeltaNet (``linear_attn``) or a gated
    attention (``self_attn``) as the mixer."""

    def __init__(self, config: ModelConfig, layer_idx: int, kind: str, rotary: RotaryEmbedding, mlp: nn.Module,
                 linear_cls: type[GatedDeltaNet]):
        super().__init__()
        self.kind = kind
        self.layer_idx = layer_idx
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == LINEAR:
            self.linear_attn = linear_cls(layer_idx, config.hidden_size, LinearShape.of(config), config.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(layer_idx, config, rotary)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.routing_context = None  # synthetic routing model (models/moe.py)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``."""
        h = self.attention_residual(positions, x, attn)
        return h + self.mlp(self.post_attention_layernorm(h))

    def attention_residual(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``x + mixer(input_layernorm(x))`` (binds ``positions`` into a routing model's context first)."""
        if self.routing_context is not None:
            self.routing_context.bind(positions, self)
        y = self.input_layernorm(x)
        if self.kind == LINEAR:
            return x + self.linear_attn(y, attn)
        return x + self.self_attn(positions, y, attn)


class HybridStack(nn.Module):
    """Embedding, hybrid decoder layers, final zero-centred norm (HF ``model.*``); the MoE blocks' executor gets
    their routers here (``hand_routers``)."""

    def __init__(self, config: ModelConfig, mlps: list[nn.Module], linear_cls: type[GatedDeltaNet],
                 device: torch.device | str | None = None):
        super().__init__()
        self.rotary = RotaryEmbedding.from_config(_with_default_rotary(config), device=device, allow_partial=True)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        kinds = layer_types(config)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i, kinds[i], self.rotary, mlp, linear_cls)
                                    for i, mlp in enumerate(mlps))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        hand_routers(mlps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, attn)
        return self.norm(x)


class Qwen3NextForCausalLM(nn.Module):
    """Qwen3-Next causal LM; the API of :class:`~ferrylm.models.llama.LlamaForCausalLM` (``forward(input_ids [T],
    positions [T], attn) -> [T, H]``, ``compute_logits``), plus :meth:`kv_layout` / :meth:`state_layout`.

    Raises:
        ModelLoadError: an unsupported config (activation, heads, layer kinds, linear dims, experts, rotary);
        ValueError: a MoE layer exists and no executor was given.
    """

    arch_name = "Qwen3NextForCausalLM"
    linear_cls: type[GatedDeltaNet] = Qwen3NextGatedDeltaNet
    hf_renames: tuple[tuple[str, str], ...] = ()
    float32_tensors: tuple[str, ...] = ()
    partial_rotary = True
    fused_experts = "halves"

    @classmethod
    def expert_swiglu(cls, config: ModelConfig) -> None:
        """Plain SwiGLU experts (see :meth:`~ferrylm.models.llama.LlamaForCausalLM.expert_swiglu`)."""
        return None

    def __init__(self, config: ModelConfig, *, executor: ExpertExecutor | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.check_config(config)
        if executor is None and self.moe_layer_indices(config):
            raise ValueError(f"{self.arch_name} needs an ExpertExecutor")
        self.config = config
        mlps = [self._build_mlp(config, i, executor) for i in range(config.num_layers)]
        self.model = HybridStack(config, mlps, self.linear_cls, device=device)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)

    # --- what the engine and the loader ask the class ---------------------------------------------------------
    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        act = config.raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act {act!r} is not supported (only 'silu')")
        if config.num_heads % config.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {config.num_heads} is not a multiple of num_key_value_heads "
                                 f"{config.num_kv_heads}")
        kinds = cls.layer_kinds(config)
        if LINEAR in kinds:
            LinearShape.of(config)
        if config.is_moe or cls.moe_layer_indices(config):
            check_moe_config(config, cls.arch_name)
        if len(cls.moe_layer_indices(config)) < config.num_layers and config.intermediate_size < 1:
            raise ModelLoadError(f"{cls.arch_name}: dense layers need intermediate_size, got "
                                 f"{config.intermediate_size}")
        config_rotary_dim(_with_default_rotary(config), allow_partial=True)

    @classmethod
    def layer_kinds(cls, config: ModelConfig) -> tuple[str, ...]:
        """Each layer's mixer, ``LINEAR`` or ``FULL`` (:func:`layer_types`)."""
        return layer_types(config)

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        return sparse_layer_indices(config)

    @classmethod
    def renormalize(cls, config: ModelConfig) -> bool:
        return bool(config.raw.get("norm_topk_prob", True))

    @classmethod
    def skips_tensor(cls, name: str, config: ModelConfig) -> bool:
        """Multi-token-prediction (``mtp.*``) and vision-tower tensors are not read."""
        return name.startswith(("mtp.", "model.visual.", "visual.", "model.mtp."))

    @classmethod
    def kv_layout(cls, config: ModelConfig):
        """Only the full-attention layers store K/V (``engine/cache/kv_pool.KVLayout``)."""
        from ferrylm.engine.cache.kv_pool import KVLayout

        full = tuple(i for i, k in enumerate(cls.layer_kinds(config)) if k == FULL)
        return KVLayout(num_layers=config.num_layers, layers=full, k_heads=config.num_kv_heads, k_dim=config.head_dim,
                        v_heads=config.num_kv_heads, v_dim=config.head_dim)

    @classmethod
    def state_layout(cls, config: ModelConfig):
        """The linear layers' per-sequence state (``engine/cache/state_pool.StateLayout``), or None without any."""
        from ferrylm.engine.cache.state_pool import StateLayout

        linear = tuple(i for i, k in enumerate(cls.layer_kinds(config)) if k == LINEAR)
        if not linear:
            return None
        s = LinearShape.of(config)
        return StateLayout(layers=linear, conv_channels=s.conv_channels, conv_kernel=s.conv_kernel,
                           heads=s.value_heads, key_dim=s.key_dim, value_dim=s.value_dim)

    @classmethod
    def synthetic_constant(cls, name: str) -> float | None:
        """Constant initial values of a synthetic model's tensors: zero-centred norms 0 (they scale by 1 + w), the
        DeltaNet gated norm 1, ``A_log`` 0 and ``dt_bias`` 0 (a decay of ``exp(-softplus(a))`` per token)."""
        if name.endswith("linear_attn.norm.weight"):
            return 1.0
        if name.endswith("norm.weight"):
            return 0.0
        if name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
            return 0.0
        return None

    @classmethod
    def workspace_extra_bytes(cls, config: ModelConfig, tokens: int) -> int:
        """Peak scratch of one linear layer's chunk form over a prefill chunk of ``tokens`` (bytes, float32): the
        chunked q / k / v and the solved ``[beta V | beta G K]`` (``~ 3 Dk + 2 Dv`` per token and head) and the
        ``C x C`` decay, ``K K^T``, ``A`` and ``Q K^T`` matrices (``4 C``), ``C = 64``. The boot plan adds it to
        the estimated workspace on the CPU (on CUDA the warmup's full chunk measures it)."""
        if LINEAR not in cls.layer_kinds(config):
            return 0
        s = LinearShape.of(config)
        return 4 * tokens * s.value_heads * (3 * s.key_dim + 3 * s.value_dim + 4 * gd.DEFAULT_CHUNK)

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        if layer_idx not in self.moe_layer_indices(config):
            return SwiGLUMLP(config.hidden_size, config.intermediate_size)
        width = int(config.raw.get("shared_expert_intermediate_size") or 0)
        shared = SwiGLUMLP(config.hidden_size, width) if width > 0 else None
        return SparseMoeBlock(layer_idx, config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              executor, renormalize=self.renormalize(config), router_bias=router_has_bias(config),
                              shared_expert=shared)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> final-normed hidden ``[T, H]``."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` -> ``[N, V]`` float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE's text model: Qwen3-Next with four DeltaNet projections and a router that always renormalises.
    A multimodal checkpoint's text tower (``model.language_model.*``) loads under the same names."""

    arch_name = "Qwen3_5MoeForCausalLM"
    linear_cls = Qwen35GatedDeltaNet
    hf_renames = (("model.language_model.", "model."),)

    @classmethod
    def renormalize(cls, config: ModelConfig) -> bool:
        return True
