"""Building blocks shared by the decoder families: RMSNorm, rotary position embedding, GQA attention (optional q/k
RMSNorm per head or over the projection, optional q/k/v clamp), SwiGLU MLP.

All activations use the flattened batch layout of ``models/attention.py``: dim 0 is the step's ``T`` tokens.
Module attribute names follow the Hugging Face checkpoint names (``q_proj``, ``gate_proj`` ...) so that the
loader can place tensors by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.errors import ModelLoadError
from ferrylm.models.attention import AttentionBackend
from ferrylm.models.quant_linear import FusedLinears, fuse_linears
from ferrylm.triton_util import use_triton

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
QK_NORM_MODES = (None, "head", "proj")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

    ``y = w * x / sqrt(mean(x^2) + eps)`` over the last dim. The statistic is computed in float32 and the
    normalised activations are cast back to the input dtype before the weight multiply (the order the
    reference checkpoints were trained with).

    Args:
        hidden_size: size ``H`` of the normalised (last) dim.
        eps: added to the mean square for stability.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]`` in ``x``'s dtype (times the weight's dtype)."""
        if use_triton(x) and x.dtype == self.weight.dtype:  # one kernel (models/kernels/norm_rope.py)
            from ferrylm.models.kernels.norm_rope import rms_norm

            return rms_norm(x, self.weight, self.eps)
        # F.rms_norm without a weight computes in float32 (opmath) and returns x's dtype: exactly the float32
        # statistic + cast above, in one fused kernel on CUDA instead of seven
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


# --- rotary position embedding --------------------------------------------------------------------------------


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """``theta ** (-2i / dim)`` for ``i = 0 .. dim/2 - 1`` in float32 (Su et al. 2021, "RoFormer", eq. 15)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, Any], original_max: int) -> torch.Tensor:
    """Llama 3.1 frequency scaling (Meta's Llama 3.1 reference, ``apply_scaling`` in ``llama/model.py``).

    Wavelengths shorter than ``original_max / high_freq_factor`` are kept, longer than
    ``original_max / low_freq_factor`` divided by ``factor``; in between, a linear blend in ``original_max /
    wavelength``.
    """
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    low_freq_wavelen = original_max / low
    high_freq_wavelen = original_max / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn_inv_freq(dim: int, theta: float, params: Mapping[str, Any], original_max: int,
                   max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN "NTK-by-parts" interpolation (Peng et al. 2023, "YaRN: Efficient Context Window Extension", §3.2-3.4).

    Dims that rotate more than ``beta_fast`` times over the original context are extrapolated (kept), dims that
    rotate fewer than ``beta_slow`` times are interpolated (divided by ``factor``), with a linear ramp between.
    Returns the frequencies and the attention factor ``0.1 ln(factor) + 1`` (or the configured value) that
    scales cos/sin.
    """
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / original_max
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # dim index whose wavelength fits `rotations` times
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    idx = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((idx - lo) / (hi - lo)).clamp(0, 1)  # 1 = interpolate (slow dims), 0 = keep (fast dims)
    wavelength_base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    extrapolated = 1.0 / wavelength_base
    interpolated = 1.0 / (factor * wavelength_base)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def rope_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None, *, max_positions: int,
                     original_max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of RoPE with the config's ``rope_scaling`` applied.

    Args:
        head_dim: rotated dims ``D`` (even).
        theta: RoPE base (config ``rope_theta``).
        scaling: the config's ``rope_scaling`` / ``rope_parameters`` dict (``rope_type`` or legacy ``type``), or
            None for plain RoPE. Supported types: ``SUPPORTED_ROPE_TYPES``.
        max_positions: the model context (``max_position_embeddings``).
        original_max_positions: pre-extension context for llama3 / yarn when the config states it outside the
            scaling dict; otherwise the dict's ``original_max_position_embeddings``, else ``max_positions``.

    Returns:
        ``(inv_freq [D/2] float32, attention_factor)``; cos/sin are multiplied by ``attention_factor``.

    Raises:
        ModelLoadError: unsupported rope type (e.g. ``dynamic``, whose frequencies depend on the current sequence
            length and so cannot be cached, or ``longrope``), or partial rotary embedding.
    """
    if head_dim % 2:
        raise ModelLoadError(f"RoPE needs an even head_dim, got {head_dim}")
    params = dict(scaling or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("partial rotary embedding (partial_rotary_factor != 1) is not supported")
    original_max = int(original_max_positions or params.get("original_max_position_embeddings") or max_positions)
    if rope_type == "default":
        return _base_inv_freq(head_dim, theta), 1.0
    if rope_type == "linear":  # position interpolation (Chen et al. 2023)
        return _base_inv_freq(head_dim, theta) / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(head_dim, theta), params, original_max), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, params, original_max, max_positions)
    raise ModelLoadError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def config_rotary_dim(config, *, allow_partial: bool = False) -> int:
    """The rotated dims per head of a :class:`~ferrylm.config.ModelConfig`: ``head_dim`` unless the config asks for
    partial rotary embedding, by ``rotary_dim`` (MiniMax-M2) or ``partial_rotary_factor`` (GLM-4.5; top level, or in
    ``rope_parameters`` / ``rope_scaling`` as transformers 5 writes it): then ``int(head_dim * factor)`` (the rule of
    transformers' default RoPE init), ``rotary_dim`` winning when both are given.

    Raises:
        ModelLoadError: partial rotary while ``allow_partial`` is False (the family's reference rotates every dim),
            or a rotated width that is odd, below 2 or above ``head_dim`` (the message names the field).
    """
    raw = config.raw or {}
    d = config.head_dim
    if raw.get("rotary_dim") is not None:
        field, dim = "rotary_dim", int(raw["rotary_dim"])
    else:
        factor = raw.get("partial_rotary_factor")
        for params in (raw.get("rope_parameters"), raw.get("rope_scaling")):
            if factor is None and isinstance(params, Mapping):
                factor = params.get("partial_rotary_factor")
        field, dim = "partial_rotary_factor", int(d * float(1.0 if factor is None else factor))
    if dim == d:
        return d
    if not allow_partial:
        raise ModelLoadError(f"partial rotary embedding ({field}: {dim} of {d} dims) is not supported by "
                             f"{config.architecture}")
    if dim < 2 or dim > d or dim % 2:
        raise ModelLoadError(f"{field} gives {dim} rotated dims per head; needs an even number in [2, head_dim={d}]")
    return dim


def config_rope_frequencies(config, *, allow_partial: bool = False) -> tuple[torch.Tensor, float]:
    """:func:`rope_frequencies` for a :class:`~ferrylm.config.ModelConfig` (``head_dim``, ``rope_theta``,
    ``rope_scaling``, ``max_position_embeddings``, top-level ``original_max_position_embeddings`` from ``raw``),
    over the :func:`config_rotary_dim` rotated dims. Raises ModelLoadError like :func:`rope_frequencies` and
    :func:`config_rotary_dim`."""
    raw = config.raw or {}
    dim = config_rotary_dim(config, allow_partial=allow_partial)
    scaling = config.rope_scaling
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}  # consumed above
    return rope_frequencies(dim, config.rope_theta, scaling, max_positions=config.max_position_embeddings,
                            original_max_positions=raw.get("original_max_position_embeddings"))


def apply_rotary_full(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor,
                      rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by per-token angles (Su et al. 2021, "RoFormer"), "half-split" pairing: dim ``i``
    with dim ``i + R/2`` over the first ``R = rotary_dim`` dims (default ``D``; the Hugging Face / GPT-NeoX layout,
    and with ``R < D`` its partial rotary: the last ``D - R`` dims pass unchanged),
    ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``, computed in four kernels as
    ``x * [cos, cos, 1] + [x2, x1, x_pass] * [-sin, sin, 0]``; ``cos_full`` / ``sin_signed`` are ``[T, D]`` in
    ``x``'s dtype (:meth:`RotaryEmbedding._tables`). Bit-identical to the two-half formula: the same products, each
    rounded once, ``a - b == a + (-b)``, and ``x * 1 + y * 0 == x`` for finite values."""
    d = x.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    half = r // 2
    parts = (x[..., half:r], x[..., :half]) + ((x[..., r:],) if r < d else ())
    swapped = torch.cat(parts, dim=-1)
    return x * cos_full[:, None, :] + swapped * sin_signed[:, None, :]


class RotaryEmbedding(nn.Module):
    """RoPE with cos/sin tables precomputed once for positions ``0 .. max_positions - 1``.

    The tables are float32 non-persistent buffers ``[max_positions, R/2]`` (already multiplied by the scaling's
    attention factor); lookups gather rows by absolute position and cast to the activations' dtype. With partial
    rotary (``R < D``, GLM-4.5, MiniMax-M2) the rows handed out are still ``[T, D]``, padded with cos 1 / sin 0 over
    the ``D - R`` dims that pass unrotated, so callers that size buffers by ``head_dim`` (the decode graphs) work
    unchanged.

    Args:
        head_dim: per-head dims ``D``.
        max_positions: table length; positions must lie in ``[0, max_positions)``.
        inv_freq: ``[D/2]`` inverse frequencies (see :func:`rope_frequencies`).
        attention_factor: multiplier of cos/sin (YaRN), 1.0 otherwise.
        device: where the tables live (explicit, so that a model built under ``torch.device("meta")`` still gets
            real tables).
        The rotated dims ``R`` are ``2 * len(inv_freq)`` (``R <= D``).

    Raises:
        ValueError: ``2 * len(inv_freq) > head_dim``.
    """

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor, attention_factor: float = 1.0,
                 device: torch.device | str | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * int(inv_freq.shape[0])
        if self.rotary_dim > head_dim:
            raise ValueError(f"{self.rotary_dim} rotated dims exceed head_dim {head_dim}")
        self.max_positions = max_positions
        pos = torch.arange(max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(pos, inv_freq.to(device=device, dtype=torch.float32))  # [P, D/2] radians
        self.register_buffer("cos_table", angles.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_table", angles.sin() * attention_factor, persistent=False)
        self._rows = None  # (key, positions, cos [T, D/2], sin [T, D/2]) of the last lookup

    @classmethod
    def from_config(cls, config, device: torch.device | str | None = None, *,
                    allow_partial: bool = False) -> "RotaryEmbedding":
        """Build from a :class:`~ferrylm.config.ModelConfig` (``head_dim``, ``rope_theta``, ``rope_scaling``,
        ``max_position_embeddings``, partial rotary when ``allow_partial``). Raises ModelLoadError for unsupported
        scaling (see :func:`config_rope_frequencies`).
        """
        inv_freq, factor = config_rope_frequencies(config, allow_partial=allow_partial)
        return cls(config.head_dim, config.max_position_embeddings, inv_freq, factor, device=device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` at absolute ``positions [T]`` (int64).

        The cos/sin rows of a ``positions`` tensor are looked up once and reused by every layer of the forward
        (the same tensor object is passed to each layer; keyed by the tensor's identity and the dtype: callers
        never modify a positions tensor in place)."""
        cos_full, sin_signed = self._tables(positions, q.dtype)
        r = self.rotary_dim
        return apply_rotary_full(q, cos_full, sin_signed, r), apply_rotary_full(k, cos_full, sin_signed, r)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, D]`` (e.g. queries and keys side by side) at ``positions [T]``: as :meth:`forward`
        on each part, in one pass (four kernels)."""
        return apply_rotary_full(x, *self._tables(positions, x.dtype), self.rotary_dim)

    def fill_tables(self, positions: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> None:
        """Write the ``[T, D]`` rows of ``positions [T]`` into the caller's buffers ``cos_full`` / ``sin_signed``
        (their dtype), in place: the values :meth:`_tables` computes. For CUDA graphs, whose tensors must keep
        their addresses (see :meth:`bind_tables`)."""
        half, r = self.rotary_dim // 2, self.rotary_dim
        cos, sin = self.cos_table[positions], self.sin_table[positions]
        cos_full[:, :half].copy_(cos)
        cos_full[:, half:r].copy_(cos)
        sin_signed[:, :half].copy_(-sin)
        sin_signed[:, half:r].copy_(sin)
        if r < self.head_dim:  # the dims that pass unrotated
            cos_full[:, r:].fill_(1)
            sin_signed[:, r:].zero_()

    def bind_tables(self, positions: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> None:
        """Make ``cos_full`` / ``sin_signed`` ``[T, D]`` the rows every layer uses for the ``positions`` tensor
        (the lookup cache of :meth:`_tables`), so that no layer looks them up again. The caller keeps them
        filled (:meth:`fill_tables`)."""
        self._rows = ((id(positions), cos_full.dtype), positions, cos_full, sin_signed)

    def clear_tables(self) -> None:
        """Forget the cached / bound rows (the next lookup computes them)."""
        self._rows = None

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos_full, sin_signed)`` ``[T, D]`` for ``positions``, cached for the last positions tensor."""
        key = (id(positions), dtype)
        if self._rows is None or self._rows[0] != key or self._rows[1] is not positions:
            cos = self.cos_table[positions].to(dtype)
            sin = self.sin_table[positions].to(dtype)
            if self.rotary_dim == self.head_dim:
                self._rows = (key, positions, torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
            else:
                rest = self.head_dim - self.rotary_dim
                one, zero = cos.new_ones(cos.shape[0], rest), cos.new_zeros(cos.shape[0], rest)
                self._rows = (key, positions, torch.cat((cos, cos, one), -1), torch.cat((-sin, sin, zero), -1))
        return self._rows[2], self._rows[3]


# --- attention and MLP ------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Grouped-query self-attention (Ainslie et al. 2023, "GQA") with RoPE; K/V storage is the backend's job.

    Args:
        layer_idx: decoder layer index passed to ``attn.attend``.
        hidden_size: model width ``H``.
        num_heads, num_kv_heads: query and key/value heads (``num_heads % num_kv_heads == 0``).
        head_dim: per-head width ``D``; the softmax scale is ``D ** -0.5``.
        rotary: the model's shared :class:`RotaryEmbedding`.
        qkv_bias: biases on q/k/v projections (Llama ``attention_bias``, Qwen2).
        o_bias: bias on the output projection (Llama ``attention_bias``).
        qk_norm: RMSNorm of queries and keys before RoPE (weights ``q_norm`` / ``k_norm``):
            ``None`` (Llama, Qwen2); ``"head"``: over each head's ``D`` dims, one ``[D]`` weight shared by all
            heads (Qwen3, Yang et al. 2025, "Qwen3 Technical Report"); ``"proj"``: over the whole projection,
            weights ``[Hq * D]`` / ``[Hkv * D]`` (Muennighoff et al. 2024, "OLMoE: Open Mixture-of-Experts
            Language Models").
        norm_eps: epsilon of the q/k norms.
        clip_qkv: clamp q, k and v to ``[-clip_qkv, clip_qkv]`` after the projections (and after a ``"proj"``
            norm), as OLMoE's ``clip_qkv``; None = no clamp.
        sinks: a learned attention-sink logit per query head (``sinks [Hq]``, gpt-oss), kept in float32.
        window: sliding window of the layer (see :meth:`~ferrylm.models.attention.AttentionBackend.attend`);
            None = full causal attention.

    Raises:
        ValueError: heads not divisible; unknown ``qk_norm``.
    """

    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: str | None = None, norm_eps: float = 1e-6, clip_qkv: float | None = None,
                 sinks: bool = False, window: int | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if qk_norm not in QK_NORM_MODES:
            raise ValueError(f"qk_norm must be one of {QK_NORM_MODES}, got {qk_norm!r}")
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm = qk_norm
        self.clip_qkv = None if clip_qkv is None else float(clip_qkv)
        if qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, norm_eps)
            self.k_norm = RMSNorm(head_dim, norm_eps)
        elif qk_norm == "proj":
            self.q_norm = RMSNorm(num_heads * head_dim, norm_eps)
            self.k_norm = RMSNorm(num_kv_heads * head_dim, norm_eps)
        self.rotary = rotary
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.window = window
        self._qkv: Callable[[torch.Tensor], torch.Tensor] | None = None    # the fused projection, see below
        self._qk_norm_weight: torch.Tensor | None = None                   # [Hq + Hkv, D] for "head" norm
        self._fused_from: tuple = ()

    def fuse_projections(self) -> None:
        """Serve q, k and v from ONE matrix multiply (vLLM's QKVParallelLinear idea; :func:`fuse_linears`: the
        three weights ``[(Hq + 2 Hkv) * D, H]`` concatenated, the projections re-pointed at views of it, so no
        memory is added and the state dict keeps its names). With a per-head q/k norm, its two ``[D]`` weights are laid out per head
        ``[Hq + Hkv, D]`` so queries and keys are normalised (and rotated) together. Call once after loading (the
        loader does); idempotent. Results equal the separate projections (each output element is the same dot
        product)."""
        if self._qkv is not None:
            return
        with torch.no_grad():
            self._qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])   # a callable, not a submodule
            if self.qk_norm == "head":
                self._qk_norm_weight = torch.cat([self.q_norm.weight.expand(self.num_heads, -1),
                                                  self.k_norm.weight.expand(self.num_kv_heads, -1)])
        self._fused_from = self._fusion_inputs()

    def _fusion_inputs(self) -> tuple:
        """The parameter objects the fused tensors are views of (identity says whether they still are)."""
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm == "head" else ()
        return (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.q_proj.bias) + norms

    def _fused_valid(self) -> bool:
        return self._qkv is not None and all(a is b for a, b in zip(self._fusion_inputs(), self._fused_from))

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.float()`` / ``.cuda()`` convert each parameter on its own: fuse again afterwards."""
        fused = self._qkv is not None
        self._qkv, self._qk_norm_weight = None, None
        out = super()._apply(fn, recurse)
        if fused:
            self.fuse_projections()
        return out

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``hidden [T, H]`` at absolute ``positions [T]`` -> ``[T, H]``; K/V go through ``attn``.

        Order (as the reference implementations): project → ``"proj"`` q/k norm → clamp → split heads →
        ``"head"`` q/k norm → RoPE → attention → output projection.
        """
        t = hidden.shape[0]
        fused = self._fused_valid()  # False if a parameter was replaced since (e.g. load_state_dict(assign=True))
        if fused and self.qk_norm != "proj" and self.clip_qkv is None:
            return self._forward_fused(positions, hidden, attn)
        if fused:
            nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self._qkv(hidden).split([nq, nk, nk], dim=-1)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = attn.attend(self.layer_idx, q, k, v, self.scale, **self._extras())
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _extras(self) -> dict:
        """The window / sink keywords of ``attend`` (none for the plain layers)."""
        if self.sinks is None and self.window is None:
            return {}
        return {"window": self.window, "sinks": self.sinks}

    def _forward_fused(self, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """:meth:`forward` after :meth:`fuse_projections` (no ``"proj"`` norm, no clamp): one projection, then
        queries and keys normalised per head and rotated side by side ``[T, Hq + Hkv, D]``."""
        t, hq, hk, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._qkv(hidden).view(t, hq + 2 * hk, d)
        qk, v = qkv[:, :hq + hk], qkv[:, hq + hk:]
        # per-head norm + RoPE in one kernel (models/kernels/norm_rope.py; it rotates every dim: not partial rotary)
        if use_triton(qkv) and d & (d - 1) == 0 and self.rotary.rotary_dim == d:
            from ferrylm.models.kernels.norm_rope import norm_rope

            eps = self.q_norm.eps if self._qk_norm_weight is not None else 0.0
            qk = norm_rope(qk, positions, self.rotary.cos_table, self.rotary.sin_table, self._qk_norm_weight, eps)
            out = attn.attend(self.layer_idx, qk[:, :hq], qk[:, hq:], v, self.scale, **self._extras())
            return self.o_proj(out.reshape(t, hq * d))
        if self._qk_norm_weight is not None:  # RMSNorm.forward over each head, both weights at once
            qk = self._qk_norm_weight * F.rms_norm(qk, (d,), eps=self.q_norm.eps)
        qk = self.rotary.rotate(positions, qk)
        out = attn.attend(self.layer_idx, qk[:, :hq], qk[:, hq:], v, self.scale, **self._extras())
        return self.o_proj(out.reshape(t, hq * d))


class SwiGLUMLP(FusedLinears):
    """Dense gated MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020, "GLU Variants Improve Transformer").

    Args:
        hidden_size: ``H``; intermediate_size: ``I``; bias: biases on all three projections (Llama ``mlp_bias``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def fused_children(self) -> list[nn.Module]:
        return [self.gate_proj, self.up_proj]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``."""
        return self.down(*self.projections(x))

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The MLP after its gate/up projections: ``gate, up [T, I]`` -> ``down(silu(gate) * up) [T, H]``."""
        return self.down_proj(F.silu(gate) * up)
