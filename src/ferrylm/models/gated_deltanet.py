"""The Gated DeltaNet token mixer of the hybrid models (Qwen3-Next, Qwen3.5-MoE, Qwen4-Exp) and the norms they share.

Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"): projections give ``q, k`` (``Hk`` heads of
``Dk``), ``v`` and the output gate ``z`` (``Hv`` heads of ``Dv``), ``b`` and ``a`` (one per value head). Qwen3-Next
packs them per key-head group (``in_proj_qkvz [Hk * (2 Dk + 2 Dv Hv/Hk), H]``: for each key head its q, k, then its
value heads' v, then their z; ``in_proj_ba [Hk * 2 Hv/Hk, H]`` likewise); Qwen3.5 keeps four matrices
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). ``[q | k | v]`` goes through a depthwise causal
conv of ``K = linear_conv_kernel_dim`` taps + SiLU, ``q``/``k`` are L2-normalised, ``q`` scaled by ``Dk ** -0.5``,
``beta = sigmoid(b)``, log decay ``g = -exp(A_log) * softplus(a + dt_bias)``; the gated delta rule
(``models/kernels/gated_delta.py``) gives ``o``, then ``RMSNorm(o) * silu(z)`` per value head (a plain weight)
and ``out_proj``. A key head serves ``Hv / Hk`` consecutive value heads.

Each layer keeps a per-sequence recurrent state (conv window and delta-rule state) in the engine's state pool
(``engine/cache/state_pool.py``), reached through ``attn.recurrent``; a backend without one holds one sequence's
state itself (:func:`_own_state`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.models.attention import AttentionBackend
from ferrylm.models.kernels import gated_delta as gd
from ferrylm.models.quant_linear import FusedLinears
from ferrylm.triton_util import use_triton


def positive_int(raw: dict, key: str, default: int | None = None) -> int:
    """``raw[key]`` (or ``default``) as a positive integer. Raises ModelLoadError naming the field otherwise."""
    v = raw.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < 1:
        raise ModelLoadError(f"config field {key!r} must be a positive integer, got {v!r}")
    return int(v)


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
        s = LinearShape(key_heads=positive_int(raw, "linear_num_key_heads", 16),
                        key_dim=positive_int(raw, "linear_key_head_dim", 128),
                        value_heads=positive_int(raw, "linear_num_value_heads", 32),
                        value_dim=positive_int(raw, "linear_value_head_dim", 128),
                        conv_kernel=positive_int(raw, "linear_conv_kernel_dim", 4))
        if s.value_heads % s.key_heads:
            raise ModelLoadError(f"linear_num_value_heads {s.value_heads} is not a multiple of linear_num_key_heads "
                                 f"{s.key_heads}")
        if s.conv_kernel < 2:
            raise ModelLoadError(f"linear_conv_kernel_dim must be >= 2, got {s.conv_kernel}")
        return s


# --- norms ----------------------------------------------------------------------------------------------------


class ZeroCentredRMSNorm(nn.Module):
    """``(x * rsqrt(mean(x^2) + eps) * (1 + w))`` computed in float32, cast back to ``x``'s dtype; ``w`` starts at 0
    (Qwen3-Next's "zero-centred" norm). ``x [..., N]`` -> ``[..., N]``."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):  # one kernel (models/kernels/norm_rope.py)
            from ferrylm.models.kernels.norm_rope import rms_norm

            return rms_norm(x, self.weight, self.eps, zero_centred=True)
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
        self.activation = activation   # a key of GATE_ACTIVATIONS

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (normed * GATE_ACTIVATIONS[self.activation](z.float())).to(x.dtype)


# --- the linear-attention layer --------------------------------------------------------------------------------


class GatedDeltaNet(FusedLinears):
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
        if rs.decode_only and use_triton(qkv):  # one kernel for the whole mixer (models/kernels/gated_delta_decode.py)
            from ferrylm.models.kernels.gated_delta_decode import fused_decode

            o = fused_decode(qkv, z, b, a, self.decode_weights(), conv_state, rec_state, rs.slots, rs.fresh,
                             s.key_heads)
            rs.written = True
            return self.out_proj(o)
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

    def decode_weights(self):
        """The small weights :func:`~ferrylm.models.kernels.gated_delta_decode.fused_decode` reads."""
        from ferrylm.models.kernels.gated_delta_decode import DeltaNetDecodeWeights

        k = self.shape.conv_kernel
        return DeltaNetDecodeWeights(self.conv1d.weight.view(-1, k), self.A_log, self.dt_bias, self.norm.weight,
                                     self.norm.eps, self.norm.activation == "sigmoid")

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
            o, state = gd.gated_delta_chunked(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
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

    def fused_children(self) -> list[nn.Module]:
        return [self.in_proj_qkvz, self.in_proj_ba]

    def project(self, hidden):
        s = self.shape
        t, rep = hidden.shape[0], s.value_heads // s.key_heads
        qkvz, ba = self.projections(hidden)
        grouped = qkvz.reshape(t, s.key_heads, 2 * s.key_dim + 2 * rep * s.value_dim)
        q, k, v, z = grouped.split([s.key_dim, s.key_dim, rep * s.value_dim, rep * s.value_dim], dim=-1)
        b, a = ba.reshape(t, s.key_heads, 2 * rep).split([rep, rep], dim=-1)
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

    def fused_children(self) -> list[nn.Module]:
        return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]

    def project(self, hidden):
        s = self.shape
        qkv, z, b, a = self.projections(hidden)
        return qkv, z.unflatten(-1, (s.value_heads, s.value_dim)), b, a


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
