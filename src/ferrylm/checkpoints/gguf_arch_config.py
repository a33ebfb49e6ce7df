"""Each served MoE GGUF architecture's HF config fields from llama.cpp's metadata (``ARCH_CONFIG``; the fields
every architecture shares are :func:`ferrylm.checkpoints.gguf_config.config_from_gguf`'s). Keys are gguf-py's
``Keys`` templates; defaults are what llama.cpp assumes when a key is absent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ferrylm.errors import ModelLoadError
from ferrylm.checkpoints.gguf_reader import GGUFFile, _f32_clean


@dataclass(frozen=True)
class Meta:
    """A GGUF header's metadata for one architecture, read by gguf-py ``Keys`` templates (``{arch}.block_count``)."""

    g: GGUFFile
    arch: str

    def get(self, key: str, default: Any = None) -> Any:
        """The scalar value of ``key`` or ``default``. Raises ModelLoadError for a per-layer (array) value."""
        name = key.format(arch=self.arch)
        v = self.g.get(name, default)
        if isinstance(v, (np.ndarray, list)):
            raise ModelLoadError(f"{self.g.path}: per-layer '{name}' is not supported")
        return v

    def int(self, key: str, default: int | None = None) -> int:
        """``key`` as an int. Raises ModelLoadError naming the key when it is absent and has no default."""
        v = self.get(key, default)
        if v is None:
            raise ModelLoadError(f"{self.g.path}: GGUF metadata lacks '{key.format(arch=self.arch)}'")
        return int(v)

    def float(self, key: str, default: float | None = None) -> float | None:
        """``key`` as the shortest decimal of its float32 value, or ``default``."""
        v = self.get(key)
        return default if v is None else _f32_clean(v)

    def has(self, tensor: str) -> bool:
        """True when the file holds a tensor named ``tensor``."""
        return tensor in self.names

    @cached_property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.g.tensors)

    def sparse_layers(self, layers: int) -> list[int]:
        """The decoder layers holding routed experts."""
        names = self.names
        return [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in names]


def _keys():
    from gguf.constants import Keys

    return Keys


def _widths(m: Meta) -> tuple[int, int]:
    """``(moe width, dense width)``: ``expert_feed_forward_length`` and ``feed_forward_length``, each standing in
    for the other when absent."""
    k = _keys().LLM
    moe, dense = m.int(k.EXPERT_FEED_FORWARD_LENGTH, 0), m.int(k.FEED_FORWARD_LENGTH, 0)
    return moe or dense, dense or moe


def _dense_layers(m: Meta, cfg: dict) -> list[int]:
    layers = cfg["num_hidden_layers"]
    sparse = m.sparse_layers(layers)
    return [i for i in range(layers) if i not in sparse]


def _qwen3moe(m: Meta, cfg: dict) -> None:
    moe, dense = _widths(m)
    cfg.update(model_type="qwen3_moe", num_experts=cfg.pop("_experts"), moe_intermediate_size=moe,
               intermediate_size=dense, norm_topk_prob=True, decoder_sparse_step=1, attention_bias=False,
               mlp_only_layers=_dense_layers(m, cfg))


def _qwen2moe(m: Meta, cfg: dict) -> None:
    moe, dense = _widths(m)
    cfg.update(model_type="qwen2_moe", num_experts=cfg.pop("_experts"), moe_intermediate_size=moe,
               intermediate_size=dense, norm_topk_prob=False, decoder_sparse_step=1,
               mlp_only_layers=_dense_layers(m, cfg),
               shared_expert_intermediate_size=m.int(_keys().LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH))


def _olmoe(m: Meta, cfg: dict) -> None:
    moe, dense = _widths(m)
    cfg.update(model_type="olmoe", num_experts=cfg.pop("_experts"), moe_intermediate_size=moe,
               intermediate_size=dense, norm_topk_prob=False, clip_qkv=None, attention_bias=False)


def _mixtral(m: Meta, cfg: dict) -> None:
    moe, _ = _widths(m)
    cfg.update(model_type="mixtral", num_local_experts=cfg.pop("_experts"), intermediate_size=moe,
               sliding_window=None)


def _llama(m: Meta, cfg: dict) -> None:
    """``llama``: Mixtral when the file has experts, else the dense Llama (``feed_forward_length`` wide MLP,
    q/k/v/o biases when the file holds ``attn_q.bias``)."""
    if cfg["_experts"]:
        _mixtral(m, cfg)
        return
    cfg.pop("_experts")
    cfg.pop("num_experts_per_tok")
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama",
               intermediate_size=m.int(_keys().LLM.FEED_FORWARD_LENGTH), mlp_bias=False,
               attention_bias=m.has("blk.0.attn_q.bias"))


def _sigmoid_router(m: Meta, default: int) -> None:
    """Refuse a router other than sigmoid (``expert_gating_func`` 2; ``default`` when absent, llama.cpp's)."""
    from gguf.constants import ExpertGatingFuncType

    kind = m.int(_keys().LLM.EXPERT_GATING_FUNC, default)
    if kind != ExpertGatingFuncType.SIGMOID:
        raise ModelLoadError(f"{m.g.path}: {m.arch} with expert_gating_func {kind} (not sigmoid) is not served")


def _glm4moe(m: Meta, cfg: dict) -> None:
    """GLM-4.5: ``leading_dense_block_count`` dense layers, ungated shared experts, biased sigmoid routing with
    groups; the multi-token-prediction block counted in ``block_count`` is skipped (``num_layers``)."""
    k = _keys().LLM
    _sigmoid_router(m, 2)
    moe, dense = _widths(m)
    cfg.update(model_type="glm4_moe", n_routed_experts=cfg.pop("_experts"), moe_intermediate_size=moe,
               intermediate_size=dense, n_shared_experts=m.int(k.EXPERT_SHARED_COUNT, 0),
               first_k_dense_replace=m.int(k.LEADING_DENSE_BLOCK_COUNT, 0),
               routed_scaling_factor=m.float(k.EXPERT_WEIGHTS_SCALE, 1.0),
               norm_topk_prob=bool(m.get(k.EXPERT_WEIGHTS_NORM, False)), n_group=m.int(k.EXPERT_GROUP_COUNT, 1),
               topk_group=m.int(k.EXPERT_GROUP_USED_COUNT, 1), attention_bias=m.has("blk.0.attn_q.bias"),
               use_qk_norm=m.has("blk.0.attn_q_norm.weight"))


def _deepseek2(m: Meta, cfg: dict) -> None:
    """DeepSeek-V3 / R1, Kimi-K2 (MLA): ``key_length_mla`` / ``value_length_mla`` (files with ``attn_k_b`` /
    ``attn_v_b``) or, in older files, ``key_length`` / ``value_length`` give the per-head dims; RoPE on interleaved
    pairs (GGML's normal RoPE, no permutation); yarn's ``mscale_all_dim`` from ``yarn_log_multiplier`` (0.1 x it,
    and ``mscale`` equal to it, as the published configs). A softmax router (DeepSeek-V2, ``expert_gating_func``
    absent or 1) is refused."""
    keys = _keys()
    k, a = keys.LLM, keys.Attention
    _sigmoid_router(m, 1)
    rope = cfg.pop("rotary_dim")
    if m.get(a.KEY_LENGTH_MLA) is not None:
        nope, v = m.int(a.KEY_LENGTH_MLA) - rope, m.int(a.VALUE_LENGTH_MLA)
    else:
        nope, v = m.int(a.KEY_LENGTH) - rope, m.int(a.VALUE_LENGTH)
    moe, dense = _widths(m)
    q_lora = m.get(a.Q_LORA_RANK)
    cfg.update(model_type="deepseek_v3", num_key_value_heads=cfg["num_attention_heads"], head_dim=rope,
               q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=m.int(a.KV_LORA_RANK),
               qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v, rope_interleave=True,
               attention_bias=False, n_routed_experts=cfg.pop("_experts"), moe_intermediate_size=moe,
               intermediate_size=dense, n_shared_experts=m.int(k.EXPERT_SHARED_COUNT, 0),
               first_k_dense_replace=m.int(k.LEADING_DENSE_BLOCK_COUNT, 0),
               routed_scaling_factor=m.float(k.EXPERT_WEIGHTS_SCALE, 1.0),
               norm_topk_prob=bool(m.get(k.EXPERT_WEIGHTS_NORM, False)), n_group=m.int(k.EXPERT_GROUP_COUNT, 1),
               topk_group=m.int(k.EXPERT_GROUP_USED_COUNT, 1))
    log_mul = m.float(keys.Rope.SCALING_YARN_LOG_MUL)
    if cfg["rope_parameters"]["rope_type"] == "yarn" and log_mul:
        cfg["rope_parameters"].update(mscale_all_dim=round(log_mul / 0.1, 6), mscale=round(log_mul / 0.1, 6))


def _gpt_oss(m: Meta, cfg: dict) -> None:
    """gpt-oss: every layer MoE with biased experts, even layers sliding-window (llama.cpp's pattern of 2), its
    constant clamped SwiGLU (alpha 1.702, limit 7.0, as llama.cpp) and yarn without truncation (the published
    config)."""
    moe, _ = _widths(m)
    layers = cfg["num_hidden_layers"]
    cfg.update(model_type="gpt_oss", num_local_experts=cfg.pop("_experts"), intermediate_size=moe,
               sliding_window=m.int(_keys().Attention.SLIDING_WINDOW), attention_bias=True, swiglu_limit=7.0,
               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    if cfg["rope_parameters"]["rope_type"] == "yarn":
        cfg["rope_parameters"]["truncate"] = False


def _minimax_m2(m: Meta, cfg: dict) -> None:
    """MiniMax-M2: every layer MoE, biased sigmoid routing always renormalised, partial rotary (``rotary_dim``)."""
    _sigmoid_router(m, 2)
    moe, _ = _widths(m)
    cfg.update(model_type="minimax_m2", num_local_experts=cfg.pop("_experts"), intermediate_size=moe,
               scoring_func="sigmoid", use_routing_bias=m.has("blk.0.exp_probs_b.bias"))


def _qwen3next(m: Meta, cfg: dict) -> None:
    """Qwen3-Next: Gated DeltaNet layers (``ssm.*``) with every ``full_attention_interval``-th layer gated
    attention, a gated shared expert, renormalised softmax routing (llama.cpp's); every layer MoE (llama.cpp has no
    dense layers for it)."""
    keys = _keys()
    k, s = keys.LLM, keys.SSM
    moe, dense = _widths(m)
    nv = m.int(s.TIME_STEP_RANK)
    cfg.update(model_type="qwen3_next", num_experts=cfg.pop("_experts"), moe_intermediate_size=moe,
               intermediate_size=dense, norm_topk_prob=True, decoder_sparse_step=1, attention_bias=False,
               shared_expert_intermediate_size=m.int(k.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0),
               mlp_only_layers=[], full_attention_interval=m.int(k.FULL_ATTENTION_INTERVAL, 4),
               linear_conv_kernel_dim=m.int(s.CONV_KERNEL), linear_key_head_dim=m.int(s.STATE_SIZE),
               linear_num_key_heads=m.int(s.GROUP_COUNT), linear_num_value_heads=nv,
               linear_value_head_dim=m.int(s.INNER_SIZE) // nv)


def _qwen35moe(m: Meta, cfg: dict) -> None:
    """Qwen3.5-MoE's text model: Qwen3-Next's fields (its four DeltaNet projections are the tables' business);
    the multimodal RoPE sections are the identity for text and not read; MTP blocks are skipped."""
    _qwen3next(m, cfg)
    cfg["model_type"] = "qwen3_5_moe_text"


#: ``general.architecture`` -> the function adding its fields to the shared ones (``_experts`` holds the expert
#: count until the architecture names its field)
ARCH_CONFIG: dict[str, Callable[[Meta, dict], None]] = {
    "qwen3moe": _qwen3moe, "qwen2moe": _qwen2moe, "olmoe": _olmoe, "llama": _llama, "glm4moe": _glm4moe,
    "deepseek2": _deepseek2, "gpt-oss": _gpt_oss, "minimax-m2": _minimax_m2,
    "qwen3next": _qwen3next, "qwen35moe": _qwen35moe,
}
