"""Llama-family decoder (Touvron et al. 2023, "LLaMA"): pre-norm blocks of GQA attention + SwiGLU MLP.

The generic pieces here (DecoderLayer, DecoderStack, the causal-LM wrapper) are reused by the MoE families,
which only swap the per-layer MLP. Module names mirror the HF checkpoint names (``model.layers.N.self_attn.q_proj``
...) so the loader places tensors by name.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ModelLoadError
from ferrylm.experts.executor import ClampedSwiGLU, ExpertExecutor
from ferrylm.models.attention import AttentionBackend
from ferrylm.models.capabilities import ModelCapabilities
from ferrylm.models.layers import Attention, RMSNorm, RotaryEmbedding, SwiGLUMLP, config_rope_frequencies
from ferrylm.models.moe import SparseMoeBlock, check_moe_config, hand_routers, router_has_bias

log = logging.getLogger("ferrylm.models")


def check_decoder_config(config: ModelConfig, *, allow_partial_rotary: bool = False) -> None:
    """Raise ModelLoadError when ``config`` asks for something this decoder does not compute (activation,
    head layout, RoPE type, partial rotary unless ``allow_partial_rotary``). Cheap: builds no tensors beyond the
    ``[D/2]`` RoPE frequencies."""
    act = config.raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"hidden_act {act!r} is not supported (only 'silu')")
    if config.num_heads % config.num_kv_heads:
        raise ModelLoadError(f"num_attention_heads {config.num_heads} is not a multiple of "
                             f"num_key_value_heads {config.num_kv_heads}")
    config_rope_frequencies(config, allow_partial=allow_partial_rotary)


def sliding_window_in_use(config: ModelConfig) -> int | None:
    """The sliding-window width the reference applies to some layer, or None when attention is full everywhere.

    Reads Mistral/Mixtral ``sliding_window`` (always on when set) and Qwen's ``use_sliding_window`` switch
    (``sliding_window`` counts only when it is true). A window no shorter than the context changes nothing.
    """
    raw = config.raw
    window = raw.get("sliding_window")
    if "use_sliding_window" in raw and not raw.get("use_sliding_window"):
        return None
    if not window or int(window) >= config.max_position_embeddings:
        return None
    return int(window)


def warn_sliding_window(config: ModelConfig) -> None:
    """Log that a configured sliding window is ignored (attention here is full causal everywhere)."""
    window = sliding_window_in_use(config)
    if window is not None:
        # NOTE: attention here is full causal; outputs differ from the reference past `window` tokens.
        log.warning("%s: sliding_window=%d is ignored (full attention); contexts longer than it will differ",
                    config.architecture, window)


class DecoderLayer(nn.Module):
    """``h = x + attn(norm1(x)); y = h + mlp(norm2(h))`` (pre-norm residual block).

    Args:
        config: model config; layer_idx: 0-based; rotary: the model's shared RoPE; mlp: dense MLP or MoE block
            (any module mapping ``[T, H] -> [T, H]``).
        attention_kwargs: keyword arguments of :class:`~ferrylm.models.layers.Attention` (biases, q/k norm,
            clamp); default: Llama's (``attention_bias`` on q/k/v/o).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module,
                 attention_kwargs: dict[str, Any] | None = None):
        super().__init__()
        if attention_kwargs is None:
            attention_kwargs = LlamaForCausalLM.attention_kwargs(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(layer_idx, config.hidden_size, config.num_heads, config.num_kv_heads,
                                   config.head_dim, rotary, **attention_kwargs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.routing_context = None  # synthetic routing model: the layer binds its positions there (models/moe.py)
        # tensor parallel (models/tensor_parallel.attach_reduce): sums a rank's partial attention / MLP output over
        # the group, ``[T, H] -> [T, H]``; None (TP = 1) skips it
        self.tp_reduce = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``."""
        h = self.attention_residual(positions, x, attn)
        out = self.mlp(self.post_attention_layernorm(h))
        return h + (out if self.tp_reduce is None else self.tp_reduce(out))

    def attention_residual(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """The first half of :meth:`forward`: ``x + attention(input_layernorm(x))``, ``[T, H]`` -> ``[T, H]`` (the
        decode graphs of ``engine/decode_graph.py`` run the halves apart). Binds ``positions`` into the routing
        context when a routing model chooses this model's experts."""
        if self.routing_context is not None:
            self.routing_context.bind(positions, self)
        out = self.self_attn(positions, self.input_layernorm(x), attn)
        return x + (out if self.tp_reduce is None else self.tp_reduce(out))


class DecoderStack(nn.Module):
    """Embedding, decoder layers, final norm (HF ``model.*``).

    Args:
        config: model config.
        mlps: one MLP module per layer (the MoE blocks' executor gets their routers here: ``hand_routers``).
        device: where the RoPE tables are built (see :class:`RotaryEmbedding`).
        attention_kwargs: passed to every :class:`DecoderLayer`.
        partial_rotary: the family rotates only part of each head (``rotary_dim`` / ``partial_rotary_factor``).
    """

    def __init__(self, config: ModelConfig, mlps: list[nn.Module], device: torch.device | str | None = None,
                 attention_kwargs: dict[str, Any] | None = None, partial_rotary: bool = False):
        super().__init__()
        rotary = RotaryEmbedding.from_config(config, device=device, allow_partial=partial_rotary)
        self._assemble(config, mlps, rotary, lambda i, mlp: DecoderLayer(config, i, rotary, mlp, attention_kwargs),
                       RMSNorm)

    def _assemble(self, config: ModelConfig, mlps: list[nn.Module], rotary: RotaryEmbedding,
                  make_layer: Callable[[int, nn.Module], nn.Module],
                  norm_cls: Callable[[int, float], nn.Module]) -> None:
        """Set the modules every stack has, in checkpoint order: ``rotary`` (shared by the layers), the embedding,
        ``make_layer(i, mlps[i])`` per layer, ``norm_cls(H, rms_norm_eps)``; then hand the MoE blocks' routers to
        their executor (``hand_routers``). Subclasses with their own layers call it from their ``__init__``."""
        self.rotary = rotary
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i, mlp) for i, mlp in enumerate(mlps))
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps)
        hand_routers(mlps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> normed hidden ``[T, H]``."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, attn)
        return self.norm(x)


class StackCausalLM(nn.Module):
    """What a causal LM over a :class:`DecoderStack`-like ``model`` (``embed_tokens``, ``model(input_ids,
    positions, attn)``) shares: ``num_layers``, ``forward``, ``compute_logits`` through ``lm_head`` or the tied
    embedding. Subclasses set ``config``, ``model`` and ``lm_head`` (:meth:`set_lm_head`)."""

    config: ModelConfig

    def set_lm_head(self, config: ModelConfig) -> None:
        """``lm_head``: a ``[V, H]`` linear, or None when ``tie_word_embeddings`` (logits read the embedding)."""
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Run the decoder over a flattened batch.

        Args:
            input_ids: ``[T]`` int64 token ids of all sequences' new tokens, concatenated.
            positions: ``[T]`` int64 absolute position of each token in its sequence.
            attn: stores K/V and computes causal attention per layer.

        Returns:
            ``[T, H]`` final-normed hidden states.
        """
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` -> ``[N, V]`` float32 logits (tied to the embedding when ``tie_word_embeddings``)."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()


class LlamaForCausalLM(StackCausalLM):
    """Dense Llama causal LM.

    Args:
        config: model config (``ModelConfig``).
        executor: routed-expert executor; unused by dense models (the MoE subclasses require it).
        device: where the RoPE tables are built; parameters follow the ambient device (the loader builds on
            ``meta`` and assigns checkpoint tensors).

    Raises:
        ModelLoadError: unsupported config (activation, head layout, RoPE type).

    Class attributes used by the loader:
        hf_renames: ``(old, new)`` substrings mapping checkpoint names onto module names.
        float32_tensors: state-dict name suffixes kept in float32 whatever the load dtype (routing-bias buffers
            whose small differences pick experts).
        partial_rotary: the family's reference supports partial rotary embedding (else such configs are refused).
        fused_experts: how fused expert tensors are laid out: ``"halves"`` (transformers' ``[E, 2I, H]``, gate rows
            then up) or ``"gpt_oss"`` (see ``checkpoints/assemble.py``).
        tensor_weights: module-name suffixes whose weight the family reads as a tensor (not through the module's
            forward): a GGUF's blocks for them are dequantized, never kept compact (``models/quant_linear.py``).

        ignores_sliding_window: the family's configs may ask for a sliding window, which this decoder does not
            compute: a window in use is logged as ignored (:func:`warn_sliding_window`).

    Class attributes used by the engine: ``capabilities`` (:class:`~ferrylm.models.capabilities.ModelCapabilities`);
    ``arch_name`` names the class in errors.

    Raises (constructor): ValueError: a MoE layer exists (:meth:`moe_layer_indices`) and no executor was given.
    """

    arch_name: ClassVar[str] = "LlamaForCausalLM"
    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities()
    hf_renames: tuple[tuple[str, str], ...] = ()
    float32_tensors: tuple[str, ...] = ()
    partial_rotary: bool = False
    fused_experts: str = "halves"
    tensor_weights: tuple[str, ...] = ()
    ignores_sliding_window: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, *, executor: ExpertExecutor | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        if executor is None and self.moe_layer_indices(config):
            raise ValueError(f"{self.arch_name} needs an ExpertExecutor")
        if self.ignores_sliding_window:
            warn_sliding_window(config)
        self.check_config(config)
        self.config = config
        mlps = [self._build_mlp(config, i, executor) for i in range(config.num_layers)]
        self.model = DecoderStack(config, mlps, device=device, attention_kwargs=self.attention_kwargs(config),
                                  partial_rotary=self.partial_rotary)
        self.set_lm_head(config)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Raise ModelLoadError when this class cannot compute ``config`` (called before weights are read)."""
        check_decoder_config(config, allow_partial_rotary=cls.partial_rotary)

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        """Decoder layers whose MLP is a routed MoE block (none for dense Llama)."""
        return ()

    @classmethod
    def skips_tensor(cls, name: str, config: ModelConfig) -> bool:
        """True for a checkpoint tensor the loader deliberately leaves unread (e.g. multi-token-prediction layers
        past ``num_hidden_layers``); none for Llama."""
        return False

    @classmethod
    def expert_swiglu(cls, config: ModelConfig) -> ClampedSwiGLU | None:
        """The clamped SwiGLU of a family whose experts clamp (gpt-oss, DeepSeek-V4); None: plain SwiGLU experts."""
        return None

    @classmethod
    def attention_kwargs(cls, config: ModelConfig) -> dict[str, Any]:
        """Keyword arguments of every layer's :class:`~ferrylm.models.layers.Attention`. Llama: config
        ``attention_bias`` puts biases on q/k/v and o; no q/k norm."""
        bias = bool(config.raw.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias}

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        return SwiGLUMLP(config.hidden_size, config.intermediate_size, bias=bool(config.raw.get("mlp_bias", False)))


class SparseLlamaForCausalLM(LlamaForCausalLM):
    """The Llama decoder with every layer's MLP a softmax-routed :class:`~ferrylm.models.moe.SparseMoeBlock`
    (Mixtral, OLMoE, gpt-oss); same API as :class:`LlamaForCausalLM`.

    Raises:
        ModelLoadError: no experts, ``num_experts_per_tok`` out of range, or any decoder check;
        ValueError: no executor given.
    """

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        check_moe_config(config, cls.arch_name)
        super().check_config(config)

    @classmethod
    def moe_layer_indices(cls, config: ModelConfig) -> tuple[int, ...]:
        """Every decoder layer is MoE."""
        return tuple(range(config.num_layers))

    @classmethod
    def renormalize(cls, config: ModelConfig) -> bool:
        """Whether the router divides the kept top-k probabilities by their sum (Mixtral: always)."""
        return True

    def _build_mlp(self, config: ModelConfig, layer_idx: int, executor: ExpertExecutor | None) -> nn.Module:
        return SparseMoeBlock(layer_idx, config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              executor, renormalize=self.renormalize(config), router_bias=router_has_bias(config))
